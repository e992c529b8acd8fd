"""The GSM8K driver against a real HTTP server on 127.0.0.1 whose answers are scripted.

The prompt, the request parameters, the extraction rule and the printed lines are checked against
SGLang's benchmark/gsm8k/bench_sglang.py; accuracy, retries and concurrency against the script.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eval.gsm8k import data
from eval.gsm8k.__main__ import main
from eval.gsm8k.client import Client, RequestFailed, RetryPolicy
from eval.gsm8k.driver import EvalConfig
from eval.gsm8k.options import add_driver_args, config_from_args
from eval.gsm8k.prompt import INVALID, STOP, few_shot_prefix, format_example, get_answer_value
from eval.scripted_server import ScriptedServer, question_of
from tests.helpers import GSM8K_TEST_JSONL

TEST_JSONL = GSM8K_TEST_JSONL
LINES = data.read_jsonl(TEST_JSONL)


def upstream_answer_value(text: str) -> int:
    """bench_sglang.py's rule, restated as the oracle: last \\d+ after dropping commas, literal_eval'd."""
    numbers = re.findall(r"\d+", text.replace(",", ""))
    if not numbers:
        return INVALID
    try:
        return ast.literal_eval(numbers[-1])
    except SyntaxError:
        return INVALID


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (" She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", 18),
        ("The total is 1,234,567 dollars.", 1234567),
        ("It costs $3.50", 50),
        ("The temperature drops to -7 degrees", 7),
        ("I cannot tell.", INVALID),
        ("", INVALID),
        ("The code is 007", INVALID),
        ("The answer is 00", 0),
        ("The answer is 0", 0),
        ("fullwidth \uff13", INVALID),
        ("arabic-indic \u0663", INVALID),
        ("1e5", 5),
        ("answer 12\nQuestion", 12),
    ],
)
def test_answer_extraction_known_cases(text: str, value: int) -> None:
    assert get_answer_value(text) == value == upstream_answer_value(text)


def test_answer_extraction_matches_upstream_on_random_text(rng: random.Random) -> None:
    alphabet = "0123456789,. -x\n$\u0663\uff13"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 24)))
        assert get_answer_value(text) == upstream_answer_value(text), text
    huge = "9" * 5000  # over Python's digit limit: upstream's literal_eval fails too
    assert get_answer_value(huge) == INVALID == upstream_answer_value(huge)


def test_every_reference_answer_parses_to_its_final_number() -> None:
    """Labels are the number after ####, without its sign: upstream's \\d+ drops it (on both sides)."""
    negative = 0
    for line in LINES:
        final = int(line["answer"].split("####")[-1].strip().replace(",", ""))
        negative += final < 0
        assert get_answer_value(line["answer"]) == abs(final)
    assert negative > 0


def test_prompt_layout(rng: random.Random) -> None:
    k = rng.randrange(0, 9)
    prefix = few_shot_prefix(LINES, k)
    expected = "".join(f"Question: {line['question']}\nAnswer: {line['answer']}\n\n" for line in LINES[:k])
    assert prefix == expected
    i = rng.randrange(len(LINES))
    block = format_example(LINES[i], include_answer=False)
    assert block == f"Question: {LINES[i]['question']}\nAnswer:"
    assert question_of(prefix + block) == LINES[i]["question"]
    assert STOP == ("Question", "Assistant:", "<|separator|>")


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer({})
    srv.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def scripted_run(rng: random.Random, n: int) -> tuple[dict, list[int], dict[int, list[str]]]:
    """A script over the first n questions: right (in varied wording), wrong or unparseable answers,
    with a few questions failing transiently first. Returns the script, the expected predictions
    and the scripted failures by question index."""
    answers, preds, failures = {}, [], {}
    flaky = rng.sample(range(n), 3)
    for i, line in enumerate(LINES[:n]):
        label = get_answer_value(line["answer"])
        kind = rng.choice(["right", "right", "wrong", "invalid"])
        if kind == "right":
            text, pred = rng.choice([f" So she has {label:,} left.", f" ... #### {label}", f" {label}\n\n"]), label
        elif kind == "wrong":
            pred = label + rng.randrange(1, 50)
            text = f" The answer is {pred}."
        else:
            text, pred = " I am not sure.", INVALID
        entry = {"text": text, "completion_tokens": rng.randrange(1, 300), "delay_s": 0.005}
        if i in flaky:
            failures[i] = entry["failures"] = [rng.choice(["500", "drop", "hang"]) for _ in range(rng.randrange(1, 3))]
        answers[line["question"]] = entry
        preds.append(pred)
    return {"answers": answers, "hang_s": 2.0, "model": "scripted-moe"}, preds, failures


@pytest.mark.parametrize("backend", ["sglang", "openai"])
def test_driver_against_scripted_server(
    rng: random.Random, backend: str, server: ScriptedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n, shots, parallel = rng.randrange(30, 60), rng.randrange(1, 6), rng.randrange(4, 9)
    server.script, preds, failures = scripted_run(rng, n)
    labels = [get_answer_value(line["answer"]) for line in LINES[:n]]
    out = tmp_path / "out"
    code = main([
        "--backend", backend, "--port", str(server.port), "--data-path", str(TEST_JSONL),
        "--num-questions", str(n), "--num-shots", str(shots), "--parallel", str(parallel),
        "--timeout", "1.5", "--retries", "2", "--retry-wait", "0.01", "--output-dir", str(out),
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out.splitlines()
    accuracy = sum(p == label for p, label in zip(preds, labels, strict=True)) / n
    invalid = sum(p == INVALID for p in preds) / n
    assert printed[0] == f"Accuracy: {accuracy:.3f}"
    assert printed[1] == f"Invalid: {invalid:.3f}"
    assert re.fullmatch(r"Latency: \d+\.\d{3} s", printed[2])
    assert re.fullmatch(r"Output throughput: \d+\.\d{3} token/s", printed[3])

    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["index"] for r in results] == list(range(n))
    assert [r["pred"] for r in results] == preds
    assert [r["attempts"] for r in results] == [1 + len(failures.get(i, [])) for i in range(n)]
    assert all(r["error"] is None for r in results)
    summary = json.loads((out / "summary.json").read_text())
    tokens = sum(e["completion_tokens"] for e in server.script["answers"].values())
    assert summary["num_output_tokens"] == tokens
    assert summary["accuracy"] == pytest.approx(accuracy)
    assert summary["retried"] == len(failures) and summary["failed"] == 0
    assert summary["model"] == (None if backend == "sglang" else "scripted-moe")

    # SGLang's frontend first warms the server up with the shared few-shot prefix and no new tokens;
    # through the OpenAI API it does not.
    prefix = few_shot_prefix(LINES, shots)
    requests = server.requests
    if backend == "sglang":
        assert requests[0] == ("/generate", {"text": prefix, "sampling_params": {"max_new_tokens": 0}})
        requests = requests[1:]
    # Every other request is the benchmark's: few-shot prefix + question, greedy, 512 tokens, upstream stops.
    assert len(requests) == n + sum(len(f) for f in failures.values())
    path = "/generate" if backend == "sglang" else "/v1/completions"
    for route, body in requests:
        assert route == path
        if backend == "sglang":
            prompt, params = body["text"], body["sampling_params"]
            assert params["max_new_tokens"] == 512
        else:
            prompt, params = body["prompt"], body
            assert params["max_tokens"] == 512 and params["model"] == "scripted-moe"
        assert params["temperature"] == 0 and params["stop"] == list(STOP)
        assert prompt.startswith(prefix) and prompt.endswith("\nAnswer:")
        assert prompt[len(prefix) :] == format_example(LINES[_index_of(question_of(prompt))], False)
    # A scripted hang keeps its handler busy after the client gave up on it and sent the retry.
    abandoned = sum(kinds.count("hang") for kinds in failures.values())
    assert 1 < server.peak_in_flight <= parallel + abandoned


def _index_of(question: str | None) -> int:
    return next(i for i, line in enumerate(LINES) if line["question"] == question)


def test_exhausted_retries_count_as_invalid_and_fail_the_run(
    rng: random.Random, server: ScriptedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = 12
    doomed = rng.randrange(n)
    answers = {
        line["question"]: {"text": f" {get_answer_value(line['answer'])}", "completion_tokens": 3} for line in LINES[:n]
    }
    answers[LINES[doomed]["question"]]["failures"] = ["500"] * 5
    server.script = {"answers": answers}
    out = tmp_path / "out"
    code = main([
        "--port", str(server.port), "--data-path", str(TEST_JSONL), "--num-questions", str(n),
        "--retries", "2", "--retry-wait", "0.01", "--output-dir", str(out), "--no-progress",
    ])  # fmt: skip
    assert code == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[:2] == [f"Accuracy: {(n - 1) / n:.3f}", f"Invalid: {1 / n:.3f}"]
    assert f"warning: 1 of {n} questions failed after retries" in captured.err
    result = json.loads((out / "results.jsonl").read_text().splitlines()[doomed])
    assert result["pred"] == INVALID and "3 attempts failed, last: HTTP 500" in result["error"]
    assert server.attempts[LINES[doomed]["question"]] == 3


@pytest.mark.parametrize("backend", ["sglang", "openai"])
@pytest.mark.parametrize(("text", "tokens"), [(None, 3), (["a list"], 3), (" 18", -2)])
def test_a_malformed_reply_fails_its_question_only(
    server: ScriptedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str, text: object, tokens: int
) -> None:
    """A reply whose text is not a string, or with a negative token count, is that question's failure
    (counted as invalid), not a crash of the run that loses every result."""
    n = 3
    answers = {
        line["question"]: {"text": f" {get_answer_value(line['answer'])}", "completion_tokens": 3} for line in LINES[:n]
    }
    answers[LINES[1]["question"]] = {"text": text, "completion_tokens": tokens}
    server.script = {"answers": answers, "model": "scripted-moe"}
    out = tmp_path / "out"
    code = main([
        "--port", str(server.port), "--backend", backend, "--data-path", str(TEST_JSONL), "--num-questions", str(n),
        "--retries", "1", "--retry-wait", "0.01", "--output-dir", str(out), "--no-progress",
    ])  # fmt: skip
    assert code == 1
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["pred"] == INVALID for r in results] == [False, True, False]
    assert "reply lacks a string" in results[1]["error"]
    assert json.loads((out / "summary.json").read_text())["num_output_tokens"] == 6


def test_an_output_dir_that_is_a_file_is_refused_before_any_question(
    server: ScriptedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "afile"
    taken.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["--port", str(server.port), "--data-path", str(TEST_JSONL), "--output-dir", str(taken)])
    assert exit_info.value.code == 2
    assert f"argument --output-dir: {taken} is a file; name a folder" in capsys.readouterr().err
    assert not server.requests


def test_client_does_not_retry_a_bad_request(server: ScriptedServer) -> None:
    client = Client(f"http://127.0.0.1:{server.port}", RetryPolicy(retries=3, timeout_s=5, backoff_s=0))
    with pytest.raises(RequestFailed, match="HTTP 400"):
        client.request_json("POST", "/generate", {"text": "not a GSM8K prompt"})
    assert len(server.requests) == 1


@pytest.mark.parametrize(("backend", "route"), [("sglang", "/model_info"), ("openai", "/v1/models")])
@pytest.mark.parametrize("questions", ["1", "3"])
def test_unreachable_server_is_an_error(
    backend: str, route: str, questions: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler) as probe:
        port = probe.server_address[1]  # free once the block ends
    code = main([
        "--backend", backend, "--port", str(port), "--data-path", str(TEST_JSONL), "--num-questions", questions,
        "--retries", "1", "--retry-wait", "0.01", "--output-dir", str(tmp_path),
    ])  # fmt: skip
    assert code == 2
    captured = capsys.readouterr()
    assert re.search(rf"error: GET http://127\.0\.0\.1:\d+{route}: 2 attempts failed", captured.err)
    assert "Accuracy" not in captured.out


@pytest.mark.parametrize("shots", [0, 1])
def test_warm_up_only_for_a_batch_with_a_long_prefix(
    shots: int, server: ScriptedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the frontend: one question, or a prefix of at most 64 characters, is not warmed up."""
    answers = {line["question"]: {"text": " 1", "completion_tokens": 1} for line in LINES[:2]}
    server.script = {"answers": answers}
    for n in (1, 2):
        server.requests.clear()
        code = main([
            "--port", str(server.port), "--data-path", str(TEST_JSONL), "--num-questions", str(n),
            "--num-shots", str(shots), "--output-dir", str(tmp_path), "--no-progress",
        ])  # fmt: skip
        assert code == 0
        warm_ups = [body for _, body in server.requests if body["sampling_params"]["max_new_tokens"] == 0]
        assert warm_ups == (
            [{"text": few_shot_prefix(LINES, 1), "sampling_params": {"max_new_tokens": 0}}] if n > 1 and shots else []
        )
        assert len(server.requests) == n + len(warm_ups)


def test_defaults_are_bench_sglang_s(capsys: pytest.CaptureFixture[str]) -> None:
    """bench_sglang.py: 200 questions, 5 shots, 64 in flight (its common --parallel default)."""
    parser = argparse.ArgumentParser()
    add_driver_args(parser)
    args = parser.parse_args([])
    assert (args.num_questions, args.num_shots, args.parallel) == (200, 5, 64)
    config = config_from_args(args, "http://127.0.0.1:30000", "out")
    assert config.parallel == EvalConfig().parallel == 64


def test_data_is_downloaded_once_and_cached(
    rng: random.Random, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = tmp_path / "www"
    served.mkdir()
    k = rng.randrange(5, 20)
    (served / "test.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES[:k]))
    hits = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            hits.append(self.path)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(served)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        monkeypatch.setattr(data, "DATA_URL", f"http://127.0.0.1:{httpd.server_address[1]}/test.jsonl")
        for _ in range(2):
            records, path = data.load_questions(None)
            assert records == LINES[:k]
            assert path == tmp_path / "cache" / "mori_sglang" / "gsm8k" / "test.jsonl"
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert hits == ["/test.jsonl"]


def test_failed_download_names_the_url_and_data_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler) as probe:
        port = probe.server_address[1]  # nothing listens there once the block ends
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(data, "DATA_URL", f"http://127.0.0.1:{port}/test.jsonl")
    monkeypatch.setattr(data, "DOWNLOAD_ATTEMPTS", 2)
    monkeypatch.setattr(data.time, "sleep", lambda s: None)
    with pytest.raises(data.DataError) as error:
        data.load_questions(None)
    message = str(error.value)
    assert f"could not download http://127.0.0.1:{port}/test.jsonl to {data.default_cache_path()}" in message
    assert "after 2 attempts" in message and "pass --data-path" in message
    assert not data.default_cache_path().exists() and not list(tmp_path.rglob("*.part"))


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache root that is a file (no folder can be made in it): one sentence naming the path and the
    two ways out, without a try at the network."""
    root = tmp_path / "a-file"
    root.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    monkeypatch.setattr(data.requests, "get", lambda *a, **k: pytest.fail("downloaded into an unwritable cache"))
    with pytest.raises(data.DataError) as error:
        data.load_questions(None)
    message = str(error.value)
    assert f"cannot write the download of {data.DATA_URL} to {data.default_cache_path()}" in message
    assert "XDG_CACHE_HOME" in message and "--data-path" in message


def test_a_broken_cached_download_says_how_to_refetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached = data.default_cache_path()
    cached.parent.mkdir(parents=True)
    cached.write_text("<html>a proxy's page</html>\n")
    with pytest.raises(data.DataError, match=r"test.jsonl:1: not JSON .*cached download .*delete it to download again"):
        data.load_questions(None)


def test_an_unreadable_data_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(data.DataError, match=r"cannot be read"):
        data.read_jsonl(tmp_path)  # a folder


def test_data_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(data.DataError, match="no such file; omit --data-path to download"):
        data.load_questions(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("# a comment line\n" + json.dumps(LINES[0]) + "\n{not json\n")
    with pytest.raises(data.DataError, match=r"bad.jsonl:3: not JSON"):
        data.read_jsonl(bad)
    bad.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(data.DataError, match="needs 'question' and 'answer'"):
        data.read_jsonl(bad)
    for record in ({"question": 123, "answer": "#### 5"}, {"question": "q?", "answer": 5}):
        bad.write_text(json.dumps(record) + "\n")
        with pytest.raises(data.DataError, match="'question' and 'answer' are strings"):
            data.read_jsonl(bad)
    bad.write_bytes(b"\xff\xfe" + json.dumps(LINES[0]).encode())
    with pytest.raises(data.DataError, match=r"bad\.jsonl: not UTF-8 text"):
        data.read_jsonl(bad)


@pytest.mark.parametrize(("option", "value"), [("--parallel", "0"), ("--num-questions", "0"), ("--num-shots", "-1")])
def test_out_of_range_options_are_rejected(option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}: {value} is below" in capsys.readouterr().err
