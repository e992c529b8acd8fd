"""Start a server from a command template, wait until it answers, and stop its whole process group.

Launch scripts exec the server, which in turn forks workers (one per GPU); only killing the process
group leaves no orphan holding GPU memory or the port for the next run.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import requests

HEALTH_PATHS = {"sglang": "/health", "openai": "/v1/models"}
PLACEHOLDERS = ("combine_dtype", "host", "port", "seed")
HEALTH_POLL_S = 0.25
STOP_GRACE_S = 30.0


class ServerError(RuntimeError):
    """The server did not come up (exited, or no healthy reply in time); the message says which."""


def render_command(template: str, **values: object) -> list[str]:
    """Fill ``{combine_dtype}``, ``{host}``, ``{port}``, ``{seed}`` and split the command like a shell."""
    try:
        command = shlex.split(template.format_map({name: values[name] for name in PLACEHOLDERS}))
    except KeyError as e:
        raise ValueError(f"unknown placeholder {e} in the launch command; use {', '.join(PLACEHOLDERS)}") from None
    if not command:
        raise ValueError("the launch command is empty; give the server's command line")
    return command


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def log_tail(path: Path, lines: int = 20) -> str:
    """The log's last lines, or a sentence saying it is empty (a failure note never ends in a bare colon)."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:]) or f"(the server wrote nothing to {path})"


class ManagedServer:
    """A server process in its own session; ``with`` stops the group however the block ends."""

    def __init__(self, command: list[str], env: Mapping[str, str], log_path: Path) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self, url: str, timeout_s: float) -> float:
        """Seconds until ``url`` answered 200; ServerError if the process exits or time runs out."""
        start = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"server exited with code {code} before it was healthy:\n{log_tail(self.log_path)}")
            try:
                if requests.get(url, timeout=5.0).status_code == 200:
                    return time.monotonic() - start
            except requests.RequestException:
                pass
            if time.monotonic() - start > timeout_s:
                raise ServerError(f"{url} not healthy after {timeout_s:.0f} s:\n{log_tail(self.log_path)}")
            time.sleep(HEALTH_POLL_S)

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL whatever is left after a grace period (workers outliving the leader)."""
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=wait_s)
