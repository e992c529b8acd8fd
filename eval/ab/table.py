"""The A/B result table: accuracy per combine dtype, its difference to bf16, and the bytes on the wire."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from mori_sglang.config import COMBINE_ENV_VALUES
from mori_sglang.formats import combine_row_bytes
from mori_sglang.wire_formats import REFERENCE_COMBINE_ENV_NAMES

# The SGLANG_MORI_COMBINE_DTYPE values compared: those whose bytes (and so payload column) we define.
AB_DTYPES = REFERENCE_COMBINE_ENV_NAMES


def payload_bytes_per_token(combine_dtype: str, hidden: int) -> int:
    """Bytes of one expert output row for an ``SGLANG_MORI_COMBINE_DTYPE`` value (core's wire format)."""
    return combine_row_bytes(COMBINE_ENV_VALUES[combine_dtype], hidden)


@dataclass(frozen=True)
class Row:
    combine_dtype: str
    accuracy: float | None  # None: the run failed
    error: str | None = None


def markdown_table(rows: list[Row], hidden: int) -> str:
    """``| combine dtype | gsm8k | vs bf16 | payload B/token |``, accuracies to three places.

    The difference is taken between the printed accuracies, so the table reads consistently.
    """
    shown = {r.combine_dtype: Decimal(f"{r.accuracy:.3f}") for r in rows if r.accuracy is not None}
    lines = ["| combine dtype | gsm8k | vs bf16 | payload B/token |", "| --- | --- | --- | --- |"]
    for row in rows:
        accuracy = shown.get(row.combine_dtype) if row.accuracy is not None else None
        if accuracy is None:
            gsm8k, delta = "failed", "n/a"
        elif row.combine_dtype == "bf16":
            gsm8k, delta = str(accuracy), "—"
        elif "bf16" in shown:
            gsm8k, delta = str(accuracy), f"{accuracy - shown['bf16']:+.3f}"
        else:
            gsm8k, delta = str(accuracy), "n/a"
        payload = payload_bytes_per_token(row.combine_dtype, hidden)
        lines.append(f"| {row.combine_dtype} | {gsm8k} | {delta} | {payload} |")
    return "\n".join(lines)
