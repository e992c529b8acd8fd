"""A scripted stand-in for an SGLang / vLLM server, for exercising the eval tools without GPUs.

It speaks the endpoints the tools use: ``POST /generate`` (SGLang), ``POST /v1/completions``
(OpenAI-compatible), ``GET /health``, ``GET /model_info`` and ``GET /v1/models``. A ``/generate``
with ``max_new_tokens`` 0 (SGLang's prefix warm-up) gets an empty answer. Answers come from a JSON
script keyed by question text (the last ``Question: ...\\nAnswer:`` block of the prompt)::

    {"answers": {"<question>": {"text": "... 18", "completion_tokens": 9,
                                "failures": ["500", "hang", "drop"], "delay_s": 0.01}},
     "default": {"text": "no idea", "completion_tokens": 2},
     "hang_s": 1.0, "model": "scripted"}

``failures`` lists how the first attempts at that question fail: HTTP 500, a reply held back for
``hang_s`` seconds (longer than the client's timeout), or a connection closed without a reply.
Every request is recorded, and the peak number of requests in flight is tracked.

``python -m eval.scripted_server --script FILE --port N [--expect-env NAME=VALUE ...]`` serves until
SIGTERM; ``--expect-env`` refuses to start unless the environment holds those values, which lets a
test check what a launcher passed to the server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mori_sglang.cli import port

QUESTION_MARK = "Question: "
ANSWER_MARK = "\nAnswer:"


def question_of(prompt: str) -> str | None:
    """The question of the prompt's final block, or None where the prompt does not end in one."""
    start = prompt.rfind(QUESTION_MARK)
    if start < 0 or not prompt.endswith(ANSWER_MARK):
        return None
    return prompt[start + len(QUESTION_MARK) : -len(ANSWER_MARK)]


class ScriptedServer(ThreadingHTTPServer):
    """Serves a script on 127.0.0.1; ``port`` is the bound port (pass 0 to pick a free one)."""

    daemon_threads = True

    def __init__(self, script: dict[str, Any], port: int = 0, host: str = "127.0.0.1") -> None:
        super().__init__((host, port), _Handler)
        self.script = script
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.attempts: Counter[str] = Counter()
        self.in_flight = 0
        self.peak_in_flight = 0
        self.lock = threading.Lock()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet when a client gave up on a held-back reply; report anything else."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def start(self) -> None:
        """Serve on a background thread (for use inside a test process)."""
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Handler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read stdout
        pass

    def _send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send_json(200, {})
        elif self.path == "/model_info":
            self._send_json(200, {"model_path": self.server.script.get("model", "scripted"), "is_generation": True})
        elif self.path == "/v1/models":
            model = self.server.script.get("model", "scripted")
            self._send_json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
        else:
            self._send_json(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError:
            self._send_json(400, {"error": "body is not JSON"})
            return
        if self.path == "/generate":
            prompt = body.get("text")
        elif self.path == "/v1/completions":
            prompt = body.get("prompt")
        else:
            self._send_json(404, {"error": f"no route {self.path}"})
            return
        server = self.server
        with server.lock:
            server.requests.append((self.path, body))
            server.in_flight += 1
            server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
        try:
            self._answer(prompt if isinstance(prompt, str) else "", body)
        finally:
            with server.lock:
                server.in_flight -= 1

    def _answer(self, prompt: str, body: dict[str, Any]) -> None:
        if self.path == "/generate" and body.get("sampling_params", {}).get("max_new_tokens") == 0:
            self._send_json(200, {"text": "", "meta_info": {"completion_tokens": 0, "prompt_tokens": len(prompt)}})
            return
        question = question_of(prompt)
        if question is None:
            self._send_json(400, {"error": "the prompt does not end in a 'Question: ...\\nAnswer:' block"})
            return
        script = self.server.script
        entry = script.get("answers", {}).get(question, script.get("default", {"text": "", "completion_tokens": 0}))
        with self.server.lock:
            attempt = self.server.attempts[question]
            self.server.attempts[question] += 1
        failures = entry.get("failures", [])
        if attempt < len(failures):
            self._fail(failures[attempt])
            return
        time.sleep(entry.get("delay_s", 0.0))
        text, tokens = entry["text"], entry["completion_tokens"]
        if self.path == "/generate":
            self._send_json(200, {"text": text, "meta_info": {"completion_tokens": tokens}})
        else:
            self._send_json(
                200,
                {
                    "object": "text_completion",
                    "model": body.get("model"),
                    "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                    "usage": {"completion_tokens": tokens},
                },
            )

    def _fail(self, kind: str) -> None:
        if kind == "500":
            self._send_json(500, {"error": "scripted failure"})
        elif kind == "hang":
            time.sleep(self.server.script.get("hang_s", 1.0))
            self._send_json(500, {"error": "scripted reply after the client gave up"})
        elif kind == "drop":
            self.close_connection = True
        else:
            raise ValueError(f"unknown scripted failure {kind!r}; use 500, hang or drop")


def _check_env(expected: list[str]) -> None:
    for item in expected:
        name, _, value = item.partition("=")
        if os.environ.get(name) != value:
            sys.exit(f"scripted server: expected {name}={value!r}, found {os.environ.get(name)!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.scripted_server", description=__doc__.splitlines()[0])
    parser.add_argument("--script", required=True, help="JSON script (see the module docstring)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, required=True)
    parser.add_argument("--expect-env", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    _check_env(args.expect_env)
    try:
        with open(args.script, encoding="utf-8") as f:
            script = json.load(f)
    except (OSError, ValueError) as e:
        parser.error(f"--script {args.script}: {e}")
    try:
        server = ScriptedServer(script, args.port, args.host)
    except OSError as e:
        parser.error(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
    with server:
        print(f"scripted server on {args.host}:{server.port}", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main()
