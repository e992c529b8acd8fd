#!/usr/bin/env bash
# Sets up everything on a fresh machine (torch 2.13, Triton's interpreter, stock SGLang and vLLM) and
# runs the whole test suite. Suites are folders of tests/: each framework's integration tests run in a
# venv of their own, next to the real package, layered on .venv for torch and triton; everything else runs
# in .venv. All three take about 3.4 GB of disk where the package index serves torch's CPU build (a CUDA
# build adds its GPU libraries); pip keeps no cache of what it downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
echo "tests/run.sh: $(df -h --output=avail . | tail -1 | tr -d ' ') of disk free here; a fresh run needs about 3.4 GB"
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$(mktemp -d)}"

python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0 triton==3.7.1
.venv/bin/pip install -q -e '.[test]'
.venv/bin/ruff check .
# MoRI's wheel (MIT), read by tests/providers/test_mori_api.py: it does not install here, it is only parsed.
export MORI_WHEEL_DIR="${MORI_WHEEL_DIR:-$XDG_CACHE_HOME/mori-sglang/amd-mori}"
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.10 \
    --platform manylinux_2_35_x86_64 amd-mori==1.2.4 -d "$MORI_WHEEL_DIR" ||
    echo "amd-mori 1.2.4 not downloaded: tests/providers/test_mori_api.py will be skipped" >&2
.venv/bin/python -m pytest -q tests --ignore=tests/integrations

bash .ci/install-sglang.sh .venv-sglang .venv
.venv-sglang/bin/python -m pytest -q tests/integrations/sglang

bash .ci/install-vllm.sh .venv-vllm .venv
.venv-vllm/bin/python -m pytest -q tests/integrations/vllm
