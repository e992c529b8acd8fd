"""The GSM8K test set: read a local jsonl, or download the public file once and reuse the cached copy."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import requests

DATA_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl"
DOWNLOAD_ATTEMPTS = 3
DOWNLOAD_TIMEOUT_S = 60.0


class DataError(RuntimeError):
    """The data file is missing, malformed or could not be downloaded; the message says which."""


def default_cache_path() -> Path:
    """Where the downloaded test set lives: ``$XDG_CACHE_HOME`` (or ~/.cache)/mori_sglang/gsm8k/."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mori_sglang" / "gsm8k" / "test.jsonl"


def read_jsonl(path: Path) -> list[dict[str, str]]:
    """Every record of a jsonl file; lines starting with '#' are comments (as upstream's reader)."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}); a GSM8K file is jsonl") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
    for number, line in enumerate(lines, 1):
        if line.startswith("#") or not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or "question" not in record or "answer" not in record:
            raise DataError(f"{path}:{number}: a GSM8K record needs 'question' and 'answer'")
        if not isinstance(record["question"], str) or not isinstance(record["answer"], str):
            raise DataError(f"{path}:{number}: a GSM8K record's 'question' and 'answer' are strings")
        records.append(record)
    if not records:
        raise DataError(f"{path}: no records")
    return records


def download(url: str, dest: Path) -> None:
    """Fetch ``url`` into ``dest`` atomically (a partial download never looks like a cached file)."""
    partial = dest.with_name(dest.name + ".part")
    last_error: Exception | None = None
    for attempt in range(DOWNLOAD_ATTEMPTS):
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with requests.get(url, stream=True, timeout=DOWNLOAD_TIMEOUT_S) as response:
                response.raise_for_status()
                with open(partial, "wb") as f:
                    for chunk in response.iter_content(chunk_size=1 << 16):
                        f.write(chunk)
            partial.replace(dest)
            return
        except requests.RequestException as e:  # the network's (an OSError too): worth another try
            last_error = e
            if attempt + 1 < DOWNLOAD_ATTEMPTS:
                time.sleep(2**attempt)
        except OSError as e:  # the cache folder's: another try would fail the same way
            with contextlib.suppress(OSError):  # no half-written file left behind
                partial.unlink()
            raise DataError(
                f"cannot write the download of {url} to {dest} ({e.strerror or e}); point XDG_CACHE_HOME at a "
                "writable folder, or pass --data-path with a local copy of GSM8K's test.jsonl"
            ) from None
    raise DataError(
        f"could not download {url} to {dest} after {DOWNLOAD_ATTEMPTS} attempts ({last_error}); "
        "pass --data-path with a local copy of GSM8K's test.jsonl"
    )


def load_questions(data_path: str | None) -> tuple[list[dict[str, str]], Path]:
    """The records and the file they came from; without a path, the cached public test set."""
    if data_path is not None:
        path = Path(data_path)
        if not path.is_file():
            raise DataError(
                f"--data-path {data_path}: no such file; omit --data-path to download GSM8K's test set once to "
                f"{default_cache_path()}"
            )
        return read_jsonl(path), path
    path = default_cache_path()
    if not path.is_file():
        print(f"Downloading {DATA_URL} to {path}")
        download(DATA_URL, path)
    try:
        return read_jsonl(path), path
    except DataError as e:  # a proxy's page saved as the download, say
        raise DataError(f"{e}; it is the cached download of {DATA_URL}: delete it to download again") from None
