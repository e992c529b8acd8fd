"""The combine-dtype A/B runner, end to end: real server processes on 127.0.0.1 (scripted answers),
started per dtype with that dtype's environment, health-waited, evaluated and stopped as a group."""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest

from eval.ab.__main__ import main, parse_dtypes
from eval.ab.server import log_tail, render_command
from eval.ab.table import Row, markdown_table, payload_bytes_per_token
from eval.gsm8k.data import read_jsonl
from eval.gsm8k.prompt import get_answer_value
from eval.scripted_server import ScriptedServer
from tests.helpers import GSM8K_TEST_JSONL

REPO = Path(__file__).resolve().parents[2]
TEST_JSONL = GSM8K_TEST_JSONL
LINES = read_jsonl(TEST_JSONL)
DTYPES = ("bf16", "fp8", "fp8_direct_cast")


def test_payload_bytes_per_token(rng: random.Random) -> None:
    assert [payload_bytes_per_token(d, 7168) for d in DTYPES] == [14336, 7392, 7168]
    hidden = 128 * rng.randrange(1, 64)
    assert [payload_bytes_per_token(d, hidden) for d in DTYPES] == [2 * hidden, hidden + hidden // 32, hidden]


def test_markdown_table() -> None:
    rows = [Row("bf16", 0.951), Row("fp8", 0.94801), Row("fp8_direct_cast", None, "server exited")]
    assert markdown_table(rows, 7168) == (
        "| combine dtype | gsm8k | vs bf16 | payload B/token |\n"
        "| --- | --- | --- | --- |\n"
        "| bf16 | 0.951 | — | 14336 |\n"
        "| fp8 | 0.948 | -0.003 | 7392 |\n"
        "| fp8_direct_cast | failed | n/a | 7168 |"
    )
    assert markdown_table([Row("fp8", 0.9), Row("bf16", 0.85)], 2048).splitlines()[2:] == [
        "| fp8 | 0.900 | +0.050 | 2112 |",
        "| bf16 | 0.850 | — | 4096 |",
    ]
    assert markdown_table([Row("fp8", 0.5)], 128).splitlines()[2] == "| fp8 | 0.500 | n/a | 132 |"


def test_render_command() -> None:
    template = "launch/x.sh --model '/models/My Model' --combine-dtype {combine_dtype} --port {port} --seed {seed}"
    assert render_command(template, combine_dtype="fp8", host="h", port=31000, seed=1) == [
        "launch/x.sh",
        "--model",
        "/models/My Model",
        "--combine-dtype",
        "fp8",
        "--port",
        "31000",
        "--seed",
        "1",
    ]
    with pytest.raises(ValueError, match=r"unknown placeholder 'gpus' .*use combine_dtype, host, port, seed"):
        render_command("x --gpus {gpus}", combine_dtype="fp8", host="h", port=1, seed=1)
    for empty in ("", "   "):
        with pytest.raises(ValueError, match="the launch command is empty"):
            render_command(empty, combine_dtype="fp8", host="h", port=1, seed=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ab(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "eval.ab", "--data-path", str(TEST_JSONL), "--no-progress", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a parent that is not ours to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ab_runs_each_dtype_on_its_own_server(rng: random.Random, tmp_path: Path) -> None:
    n, hidden, port = rng.randrange(10, 25), 128 * rng.randrange(8, 64), free_port()
    labels = [get_answer_value(line["answer"]) for line in LINES[:n]]
    accuracy = {}
    for dtype in DTYPES:  # each dtype's server gets a different set of questions right
        right = rng.sample(range(n), rng.randrange(0, n + 1))
        answers = {
            line["question"]: {
                "text": f" The answer is {labels[i] if i in right else labels[i] + 1}.",
                "completion_tokens": rng.randrange(1, 100),
                "failures": ["500"] if rng.random() < 0.1 else [],
            }
            for i, line in enumerate(LINES[:n])
        }
        (tmp_path / f"{dtype}.json").write_text(json.dumps({"answers": answers}))
        accuracy[dtype] = len(right) / n
    # The server refuses to start unless the runner set SGLANG_MORI_COMBINE_DTYPE; it leaves a child
    # process behind (as a server's workers would) that stopping the process group must take down.
    launch = (
        f"bash -c 'sleep 300 & echo $! > {tmp_path}/{{combine_dtype}}.child; "
        f"exec {sys.executable} -m eval.scripted_server --port {{port}} --script {tmp_path}/{{combine_dtype}}.json "
        f"--expect-env SGLANG_MORI_COMBINE_DTYPE={{combine_dtype}}'"
    )
    out = tmp_path / "out"
    backend = rng.choice(["sglang", "openai"])
    result = run_ab(
        "--launch",
        launch,
        "--port",
        str(port),
        "--hidden",
        str(hidden),
        "--backend",
        backend,
        "--num-questions",
        str(n),
        "--parallel",
        "4",
        "--retry-wait",
        "0.01",
        "--output-dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr

    shown = {d: Decimal(f"{a:.3f}") for d, a in accuracy.items()}
    bf16, fp8, cast = shown["bf16"], shown["fp8"], shown["fp8_direct_cast"]
    table = [
        "| combine dtype | gsm8k | vs bf16 | payload B/token |",
        "| --- | --- | --- | --- |",
        f"| bf16 | {bf16} | — | {2 * hidden} |",
        f"| fp8 | {fp8} | {fp8 - bf16:+.3f} | {hidden + hidden // 32} |",
        f"| fp8_direct_cast | {cast} | {cast - bf16:+.3f} | {hidden} |",
    ]
    assert result.stdout.rstrip().splitlines()[-5:] == table
    assert f"GSM8K, seed 1, {n} questions, 5 shots, hidden {hidden}" in result.stdout
    for dtype in DTYPES:
        assert f"combine dtype {dtype}:\nAccuracy: {accuracy[dtype]:.3f}\n" in result.stdout
        summary = json.loads((out / dtype / "summary.json").read_text())
        assert summary["accuracy"] == pytest.approx(accuracy[dtype]) and summary["backend"] == backend
        assert (out / dtype / "server.log").read_text().startswith(f"scripted server on 127.0.0.1:{port}")
        child = int((tmp_path / f"{dtype}.child").read_text())
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), f"{dtype}: the server's child process outlived the run"
    assert (out / "table.md").read_text().splitlines()[2:] == table
    rows = json.loads((out / "ab_summary.json").read_text())["rows"]
    assert [(r["combine_dtype"], r["error"]) for r in rows] == [(d, None) for d in DTYPES]


def test_ab_reports_a_server_that_never_comes_up(rng: random.Random, tmp_path: Path) -> None:
    n, port = rng.randrange(3, 8), free_port()
    answers = {
        line["question"]: {"text": f" {get_answer_value(line['answer'])}", "completion_tokens": 1} for line in LINES[:n]
    }
    (tmp_path / "bf16.json").write_text(json.dumps({"answers": answers}))  # no script for fp8: that server exits
    launch = f"{sys.executable} -m eval.scripted_server --port {{port}} --script {tmp_path}/{{combine_dtype}}.json"
    result = run_ab(
        "--launch",
        launch,
        "--port",
        str(port),
        "--combine-dtypes",
        "fp8,bf16",
        "--num-questions",
        str(n),
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert result.returncode == 1
    lines = result.stdout.rstrip().splitlines()
    assert lines[-4:] == [
        "| fp8 | failed | n/a | 7392 |",
        "| bf16 | 1.000 | — | 14336 |",
        "",
        "- fp8: server exited with code 2 before it was healthy:",
    ]
    assert "No such file or directory" in result.stderr


def test_ab_refuses_a_port_already_served(tmp_path: Path) -> None:
    with ScriptedServer({}) as squatter:
        squatter.start()
        result = run_ab(
            "--launch",
            "false",
            "--port",
            str(squatter.port),
            "--combine-dtypes",
            "bf16",
            "--num-questions",
            "2",
            "--output-dir",
            str(tmp_path),
        )
        squatter.shutdown()
    assert result.returncode == 1
    assert f"- bf16: port {squatter.port} is already in use; stop that server first" in result.stdout
    assert squatter.requests == []


def test_unknown_combine_dtype_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--launch", "true", "--combine-dtypes", "bf16,fp4"])
    assert exit_info.value.code == 2
    assert "argument --combine-dtypes: 'fp4': use a comma list of bf16, fp8, fp8_direct_cast" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--launch", ""], "error: --launch: the launch command is empty"),
        (["--launch", "true", "--combine-dtypes", "fp8,fp8_blockwise"], "'fp8_blockwise' names fp8 a second time"),
    ],
)
def test_bad_command_lines_are_usage_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_data_and_output_problems_stop_ab_before_any_server(tmp_path: Path) -> None:
    """A record without an integer answer, or an output folder that is a file: refused before the
    first server starts (the launch command would leave a marker file)."""
    marker = tmp_path / "started"
    nonum = tmp_path / "nonum.jsonl"
    nonum.write_text(json.dumps({"question": "q?", "answer": "no number"}) + "\n")
    result = run_ab("--launch", f"touch {marker}", "--data-path", str(nonum), "--num-questions", "1",
                    "--combine-dtypes", "bf16", "--output-dir", str(tmp_path / "out"))  # fmt: skip
    assert result.returncode == 2 and "records [0] have no integer answer" in result.stderr
    taken = tmp_path / "afile"
    taken.write_text("")
    result = run_ab("--launch", f"touch {marker}", "--combine-dtypes", "bf16", "--output-dir", str(taken))
    assert result.returncode == 2 and f"argument --output-dir: {taken} is a file" in result.stderr
    assert not marker.exists()


def test_an_empty_server_log_is_said_to_be_empty(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("")
    assert log_tail(log) == f"(the server wrote nothing to {log})"
    log.write_text("a\nb\n")
    assert log_tail(log, lines=1) == "b"


def test_scripted_server_on_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text("{}")
    with ScriptedServer({}) as squatter:
        result = subprocess.run(
            [sys.executable, "-m", "eval.scripted_server", "--script", str(script), "--port", str(squatter.port)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{squatter.port}" in result.stderr


def test_combine_dtypes_take_the_env_names_and_long_aliases() -> None:
    assert parse_dtypes("fp8_blockwise, bf16,FP8_DIRECT_CAST") == ["fp8", "bf16", "fp8_direct_cast"]
    with pytest.raises(argparse.ArgumentTypeError, match="'fp8_blockwise_native': use a comma list"):
        parse_dtypes("fp8_blockwise_native")  # no SGLANG_MORI_COMBINE_DTYPE value selects it
