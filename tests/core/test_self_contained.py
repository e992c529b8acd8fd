"""The project carries what it needs: no file refers to a path outside the repository, and the data the
tests read ships in tests/data with its license."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A relative path climbing out of the checkout to a sibling folder (as a string or as a pathlib join
# above the repository), or a machine's absolute work path.
SHARED = '"shared"'
OUTSIDE = re.compile("|".join([r"\.\./shared", "/" + "work/", r"(parents\[\d\]|\.parent)\s*/\s*" + SHARED]))


def tracked_files() -> list[Path]:
    try:
        listing = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout (git ls-files) to list the project's files")
    return [REPO / name for name in listing.splitlines()]


def test_no_file_refers_to_a_path_outside_the_repository() -> None:
    offenders = []
    for path in tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        offenders += [f"{path.relative_to(REPO)}:{m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert offenders == []


def test_the_gsm8k_fixture_ships_with_its_license() -> None:
    data = REPO / "tests" / "data" / "gsm8k"
    assert "MIT License" in (data / "LICENSE").read_text() and "OpenAI" in (data / "LICENSE").read_text()
    assert len((data / "test.jsonl").read_text().splitlines()) >= 60
