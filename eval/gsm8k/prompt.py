"""Prompt construction and answer extraction, kept identical to SGLang's GSM8K benchmark.

The benchmark's numbers are only comparable when the prompt, the stop strings, the generation length
and the extraction rule are the same, so each rule here mirrors
``benchmark/gsm8k/bench_sglang.py`` / ``sglang/test/few_shot_gsm8k.py`` (SGLang 0.5.x).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

INVALID = -9999999
STOP = ("Question", "Assistant:", "<|separator|>")
MAX_NEW_TOKENS = 512
TEMPERATURE = 0.0

_NUMBER = re.compile(r"\d+")


def format_example(line: Mapping[str, str], include_answer: bool) -> str:
    """One ``Question: ...\\nAnswer:`` block; the few-shot blocks carry the reference solution."""
    text = "Question: " + line["question"] + "\nAnswer:"
    if include_answer:
        text += " " + line["answer"]
    return text


def few_shot_prefix(lines: Sequence[Mapping[str, str]], num_shots: int) -> str:
    """The first ``num_shots`` examples of the data file, each followed by a blank line (as upstream)."""
    return "".join(format_example(line, True) + "\n\n" for line in lines[:num_shots])


def get_answer_value(text: str) -> int:
    """The last integer in ``text`` with commas removed, or INVALID.

    Upstream runs ``ast.literal_eval`` on the last ``\\d+`` match and maps a SyntaxError to INVALID;
    that rejects leading zeros ("007"), non-ASCII digits and numbers over Python's digit limit, so
    those are INVALID here too.
    """
    numbers = _NUMBER.findall(text.replace(",", ""))
    if not numbers:
        return INVALID
    last = numbers[-1]
    if not last.isascii() or (last[0] == "0" and last.strip("0")):
        return INVALID
    try:
        return int(last)
    except ValueError:  # more digits than sys.get_int_max_str_digits()
        return INVALID
