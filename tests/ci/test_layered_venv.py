"""`.ci/venv.sh`: the framework venvs of tests/run.sh are layered on .venv so that torch and triton are
installed once. A layered venv must see the base's packages, prefer its own where both hold one, and
refuse a base of another Python (whose site-packages it could not use)."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _make_venv(venv: Path, base: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = f'"{venv}"' + (f' "{base}"' if base else "")
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; source "{REPO}/.ci/venv.sh"; make_venv {args}'],
        capture_output=True,
        text=True,
        check=False,
    )


def _site_packages(venv: Path) -> Path:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def _module(site: Path, name: str, origin: str) -> None:
    (site / f"{name}.py").write_text(f"ORIGIN = {origin!r}\n")


def _origin(venv: Path, name: str) -> str:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", f"import {name}; print({name}.ORIGIN)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("base") / "venv"
    python3 = shutil.which("python3")  # the Python make_venv builds venvs with
    assert python3, "make_venv needs python3 on PATH"
    subprocess.run([python3, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv


def test_a_layered_venv_sees_the_base_and_prefers_its_own(base: Path, tmp_path: Path) -> None:
    shared, overridden = f"shared_{uuid.uuid4().hex[:8]}", f"overridden_{uuid.uuid4().hex[:8]}"
    _module(_site_packages(base), shared, "base")
    _module(_site_packages(base), overridden, "base")
    child = tmp_path / "child"
    made = _make_venv(child, base)
    assert made.returncode == 0, made.stderr
    _module(_site_packages(child), overridden, "child")
    assert _origin(child, shared) == "base"
    assert _origin(child, overridden) == "child"
    again = _make_venv(child, base)  # re-running (tests/run.sh on a second run) keeps one layer
    assert again.returncode == 0, again.stderr
    layers = list(_site_packages(child).glob("*.pth"))
    assert [p.read_text().strip() for p in layers if "base" in p.name] == [str(_site_packages(base))]


def test_without_a_base_the_venv_stands_alone(tmp_path: Path) -> None:
    alone = tmp_path / "alone"
    made = _make_venv(alone)
    assert made.returncode == 0, made.stderr
    assert not [p for p in _site_packages(alone).glob("*.pth") if "base" in p.name]


def test_a_base_that_is_not_a_venv_is_refused(tmp_path: Path) -> None:
    made = _make_venv(tmp_path / "child", tmp_path / "missing")
    assert made.returncode != 0
    assert "has no bin/python" in made.stderr


def test_a_base_of_another_python_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    (other / "bin").mkdir(parents=True)
    python = other / "bin" / "python"
    python.write_text("#!/bin/sh\necho '(2, 7)'\n")  # answers the version probe as a Python 2.7 would
    python.chmod(0o755)
    made = _make_venv(tmp_path / "child", other)
    assert made.returncode != 0
    assert "different Pythons" in made.stderr
