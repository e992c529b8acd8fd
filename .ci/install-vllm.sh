#!/usr/bin/env bash
# Build (or refresh) a virtual environment in which vLLM 0.33.0 imports on a CPU-only machine, for the
# tests/integrations/vllm suites, with this checkout installed so vLLM finds its plugin entry point.
#
#   .ci/install-vllm.sh VENV_DIR [BASE_VENV]
#
# vLLM's wheel pins a CUDA torch and GPU-only packages; its MoE and all2all modules import without
# them. So torch comes alone (the CPU build where the index offers one), then vLLM and the packages its
# import chain needs are installed with --no-deps at the pinned versions below. Re-running it is cheap:
# pip finds every pin satisfied. Needs python3 >= 3.10 and PyPI.
#
# With BASE_VENV (a venv holding torch 2.13.0, triton 3.7.1 and pytest, as tests/run.sh's .venv does)
# VENV_DIR is layered on it (.ci/venv.sh) and holds only what vLLM adds, about 1.2 GB instead of 2.8 GB.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 VENV_DIR [BASE_VENV]" >&2
    exit 2
fi
VENV=$1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=venv.sh
source "$REPO/.ci/venv.sh"

make_venv "$VENV" "${2:-}"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" torch==2.13.0 pytest

# vLLM 0.33.0 and what `import vllm.distributed.device_communicators.all2all` and
# `vllm.model_executor.layers.fused_moe.modular_kernel` need, nothing more (numpy is not among
# torch's dependencies).
"${PIP[@]}" --no-deps -r /dev/stdin <<'PINS'
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
apache-tvm-ffi==0.1.11
attrs==26.1.0
cachetools==8.0.2
cbor2==6.3.0
certifi==2026.10.19.post1
cloudpickle==3.1.3
einops==0.8.2
fastapi==0.136.3
frozenlist==1.8.0
h11==0.16.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
llguidance==1.7.6
msgspec==0.23.0
multidict==7.2.1
numpy==2.4.6
openai==3.57.0
openai-harmony==0.0.8
opentelemetry-api==1.45.2
packaging==26.4
partial-json-parser==0.2.1.1.post7
pillow==13.0.0
prometheus_client==0.26.0
propcache==0.5.4
psutil==7.2.2
py-cpuinfo==9.0.0
pybase64==1.5.1
pydantic==2.14.4
pydantic_core==2.50.5
PyYAML==6.0.4
pyzmq==27.3.0
regex==2026.11.19
requests==2.34.2
safetensors==0.8.0
sniffio==1.3.1
starlette==1.10.0
tokenizers==0.23.2
tqdm==4.70.1
transformers==5.19.0
triton==3.7.1
truststore==0.10.5
typing-inspection==0.4.5
urllib3==2.8.0
uvloop==0.23.0
vllm==0.33.0
xgrammar==0.2.8
yarl==1.25.1
PINS

# This checkout, editable, so the vllm.general_plugins entry point is registered.
"${PIP[@]}" --no-deps -e "$REPO"

"$VENV/bin/python" - <<'CHECK'
from importlib.metadata import entry_points

import vllm.distributed.device_communicators.all2all  # noqa: F401
import vllm.model_executor.layers.fused_moe.modular_kernel  # noqa: F401

names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
assert "mori_sglang" in names, f"mori_sglang is not among vLLM's general plugins: {sorted(names)}"
print("vLLM 0.33.0 imports on CPU; the mori_sglang plugin is registered")
CHECK
