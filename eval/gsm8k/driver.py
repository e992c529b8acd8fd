"""Run the benchmark: build prompts, query the server concurrently, score, print and save the results."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from eval.gsm8k.client import Backend, RequestFailed, RetryPolicy, make_backend
from eval.gsm8k.data import DataError, load_questions
from eval.gsm8k.prompt import INVALID, MAX_NEW_TOKENS, STOP, TEMPERATURE, few_shot_prefix, format_example
from eval.gsm8k.prompt import get_answer_value as extract


@dataclass(frozen=True)
class EvalConfig:
    backend: str = "sglang"
    base_url: str = "http://127.0.0.1:30000"
    model: str | None = None
    num_questions: int = 200
    num_shots: int = 5
    parallel: int = 64
    data_path: str | None = None
    output_dir: str = "gsm8k_out"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    progress: bool = True


@dataclass(frozen=True)
class QuestionResult:
    index: int
    question: str
    label: int
    pred: int
    correct: bool
    output: str
    completion_tokens: int
    attempts: int
    error: str | None


@dataclass(frozen=True)
class Summary:
    backend: str
    base_url: str
    model: str | None
    data_path: str
    num_questions: int
    num_shots: int
    parallel: int
    max_new_tokens: int
    temperature: float
    stop: list[str]
    accuracy: float
    invalid: float
    latency: float
    output_throughput: float
    num_output_tokens: int
    failed: int
    retried: int

    def report(self) -> str:
        """The four lines bench_sglang.py prints, in its order and number formats."""
        return (
            f"Accuracy: {self.accuracy:.3f}\n"
            f"Invalid: {self.invalid:.3f}\n"
            f"Latency: {self.latency:.3f} s\n"
            f"Output throughput: {self.output_throughput:.3f} token/s"
        )


def base_url(host: str, port: int) -> str:
    """``http://host:port``; an IPv6 host gets brackets, a host given with a scheme keeps it."""
    if host.startswith(("http://", "https://")):
        return f"{host.rstrip('/')}:{port}"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _ask(backend: Backend, index: int, question: str, prompt: str, label: int) -> QuestionResult:
    try:
        c = backend.complete(prompt)
    except RequestFailed as e:
        return QuestionResult(index, question, label, INVALID, False, "", 0, e.attempts, str(e))
    pred = extract(c.text)
    return QuestionResult(index, question, label, pred, pred == label, c.text, c.completion_tokens, c.attempts, None)


def labelled_questions(data_path: str | None, num_questions: int) -> tuple[list[dict[str, str]], Path, list[int]]:
    """Every record, the file they came from, and the integer answers of the first ``num_questions``;
    raises DataError before anything is asked where one of those has none."""
    lines, path = load_questions(data_path)
    labels = [extract(line["answer"]) for line in lines[:num_questions]]
    unlabelled = [i for i, label in enumerate(labels) if label == INVALID]
    if unlabelled:
        raise DataError(f"{path}: records {unlabelled[:5]} have no integer answer")
    return lines, path, labels


def run_eval(config: EvalConfig) -> tuple[Summary, list[QuestionResult]]:
    """Ask every question once (greedy), score against the reference answers, write both output files."""
    lines, data_path, labels = labelled_questions(config.data_path, config.num_questions)
    prefix = few_shot_prefix(lines, config.num_shots)
    selected = lines[: config.num_questions]
    backend = make_backend(config.backend, config.base_url, config.retry, config.model)

    tic = time.perf_counter()  # bench_sglang.py's latency includes the frontend's prefix warm-up
    if len(selected) > 1:  # the frontend warms up batches only
        backend.warm_up(prefix)
    pool = ThreadPoolExecutor(max_workers=config.parallel)
    try:
        futures = [
            pool.submit(_ask, backend, i, line["question"], prefix + format_example(line, False), labels[i])
            for i, line in enumerate(selected)
        ]
        progress = tqdm(as_completed(futures), total=len(futures), disable=not config.progress)
        results = sorted((future.result() for future in progress), key=lambda r: r.index)
    finally:  # on an interrupt, drop the questions not yet sent instead of asking them all
        pool.shutdown(wait=False, cancel_futures=True)
    latency = time.perf_counter() - tic

    n = len(results)
    num_output_tokens = sum(r.completion_tokens for r in results)
    summary = Summary(
        backend=config.backend,
        base_url=config.base_url,
        model=backend.model,
        data_path=str(data_path),
        num_questions=n,
        num_shots=config.num_shots,
        parallel=config.parallel,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        stop=list(STOP),
        accuracy=sum(r.correct for r in results) / n,
        invalid=sum(r.pred == INVALID for r in results) / n,
        latency=latency,
        output_throughput=num_output_tokens / latency,
        num_output_tokens=num_output_tokens,
        failed=sum(r.error is not None for r in results),
        retried=sum(r.attempts > 1 for r in results),
    )
    write_outputs(Path(config.output_dir), summary, results)
    return summary, results


def write_outputs(output_dir: Path, summary: Summary, results: list[QuestionResult]) -> None:
    """``results.jsonl`` (one line per question, in data order) and ``summary.json``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / "results.jsonl", "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(asdict(r)) + "\n")
    (output_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")


def warn_failures(summary: Summary, output_dir: str) -> None:
    if summary.failed:
        print(
            f"warning: {summary.failed} of {summary.num_questions} questions failed after retries and count "
            f"as invalid; see {output_dir}/results.jsonl",
            file=sys.stderr,
        )
