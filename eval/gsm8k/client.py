"""HTTP clients for SGLang's ``/generate`` and the OpenAI-compatible ``/v1/completions`` (vLLM, SGLang).

Both send the sampling parameters SGLang's benchmark sends (greedy, 512 new tokens, its three stop
strings), so the two APIs produce comparable numbers. Transient failures (connection errors, timeouts,
HTTP 5xx / 429) are retried a bounded number of times; anything else fails the question at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import requests

from eval.gsm8k.prompt import MAX_NEW_TOKENS, STOP, TEMPERATURE

# The values SGLang's frontend sends explicitly; a server would otherwise fill them from the
# model's generation_config.json, and runs stop being comparable across servers.
# SGLang's frontend: the model info it reads when it connects (``/get_model_info``, now deprecated in
# favour of this name), and the shortest shared prefix it warms up (``cache_program``: over 64 chars).
MODEL_INFO_PATH = "/model_info"
WARM_UP_MIN_PREFIX_CHARS = 64
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


class RequestFailed(RuntimeError):
    """A request failed for good: a non-retryable reply, a malformed body or retries exhausted."""

    def __init__(self, message: str, attempts: int = 1) -> None:
        super().__init__(message)
        self.attempts = attempts


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` further attempts after the first, each bounded by ``timeout_s``, waits doubling."""

    retries: int = 3
    timeout_s: float = 600.0
    backoff_s: float = 1.0


@dataclass(frozen=True)
class Completion:
    text: str
    completion_tokens: int
    attempts: int

    def __post_init__(self) -> None:
        """A reply whose text is not a string (null, a list) or whose token count is negative is
        malformed: the backends turn these errors into a failed question."""
        if not isinstance(self.text, str):
            raise TypeError(f"completion text is {type(self.text).__name__}, not a string")
        if self.completion_tokens < 0:
            raise ValueError(f"completion_tokens {self.completion_tokens} < 0")


def _is_retryable_status(status: int) -> bool:
    return status >= 500 or status == 429


class Client:
    """One server; safe to call from many threads (each thread keeps its own connection pool)."""

    def __init__(self, base_url: str, policy: RetryPolicy) -> None:
        self.base_url = base_url.rstrip("/")
        self.policy = policy
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def request_json(self, method: str, path: str, payload: dict[str, Any] | None = None) -> tuple[Any, int]:
        """The decoded JSON reply and the number of attempts it took."""
        url = self.base_url + path
        last_error = ""
        for attempt in range(1, self.policy.retries + 2):
            try:
                response = self._session().request(method, url, json=payload, timeout=self.policy.timeout_s)
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
                last_error = f"{type(e).__name__}: {e}"
            else:
                if response.ok:
                    try:
                        return response.json(), attempt
                    except ValueError:
                        detail = f"reply is not JSON: {response.text[:200]!r}"
                        raise RequestFailed(f"{method} {url}: {detail}", attempt) from None
                last_error = f"HTTP {response.status_code}: {response.text[:200]!r}"
                if not _is_retryable_status(response.status_code):
                    raise RequestFailed(f"{method} {url}: {last_error}", attempt)
            if attempt <= self.policy.retries:
                time.sleep(self.policy.backoff_s * 2 ** (attempt - 1))
        attempts = self.policy.retries + 1
        raise RequestFailed(f"{method} {url}: {attempts} attempts failed, last: {last_error}", attempts)


class SGLangBackend:
    """SGLang's native ``/generate``: the requests its frontend (``sgl.gen`` in ``run_batch``) sends.

    Like the frontend, it asks the server for its model info first (an unreachable server fails here,
    before any question), and ``warm_up`` sends the shared few-shot prefix once with no new tokens so
    that the server caches it before the questions arrive.
    """

    model = None  # /generate serves the one loaded model

    def __init__(self, client: Client) -> None:
        self.client = client
        self.client.request_json("GET", MODEL_INFO_PATH)

    def warm_up(self, prefix: str) -> None:
        """The frontend's prefix caching: ``max_new_tokens`` 0, only for prefixes past its threshold."""
        if len(prefix) > WARM_UP_MIN_PREFIX_CHARS:
            self.client.request_json("POST", "/generate", {"text": prefix, "sampling_params": {"max_new_tokens": 0}})

    def complete(self, prompt: str) -> Completion:
        payload = {
            "text": prompt,
            "sampling_params": {
                "max_new_tokens": MAX_NEW_TOKENS,
                "stop": list(STOP),
                "temperature": TEMPERATURE,
                **NEUTRAL_SAMPLING,
                "skip_special_tokens": True,
                "spaces_between_special_tokens": True,
            },
        }
        body, attempts = self.client.request_json("POST", "/generate", payload)
        try:
            return Completion(body["text"], int(body["meta_info"]["completion_tokens"]), attempts)
        except (KeyError, TypeError, ValueError):
            detail = f"/generate reply lacks a string text or a count meta_info.completion_tokens: {body!r:.200}"
            raise RequestFailed(detail, attempts) from None


class OpenAIBackend:
    """OpenAI-compatible ``/v1/completions`` (vLLM, or SGLang's OpenAI API) with the same parameters."""

    def __init__(self, client: Client, model: str | None) -> None:
        self.client = client
        self.model = model or self._served_model()

    def warm_up(self, prefix: str) -> None:
        """Nothing: SGLang's frontend caches no prefix through the OpenAI API (and vLLM refuses max_tokens 0)."""

    def _served_model(self) -> str:
        body, _ = self.client.request_json("GET", "/v1/models")
        try:
            return body["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise RequestFailed(f"/v1/models lists no model: {body!r:.200}; pass --model") from None

    def complete(self, prompt: str) -> Completion:
        payload = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": MAX_NEW_TOKENS,
            "stop": list(STOP),
            "temperature": TEMPERATURE,
            **NEUTRAL_SAMPLING,
        }
        body, attempts = self.client.request_json("POST", "/v1/completions", payload)
        try:
            return Completion(body["choices"][0]["text"], int(body["usage"]["completion_tokens"]), attempts)
        except (KeyError, IndexError, TypeError, ValueError):
            detail = f"/v1/completions reply lacks a string choices[0].text or a count usage: {body!r:.200}"
            raise RequestFailed(detail, attempts) from None


Backend = SGLangBackend | OpenAIBackend


def make_backend(kind: str, base_url: str, policy: RetryPolicy, model: str | None = None) -> Backend:
    client = Client(base_url, policy)
    if kind == "sglang":
        return SGLangBackend(client)
    if kind == "openai":
        return OpenAIBackend(client, model)
    raise ValueError(f"unknown backend {kind!r}; use sglang or openai")
