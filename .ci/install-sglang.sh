#!/usr/bin/env bash
# Install stock SGLang 0.5.23 and mori-sglang into a virtual environment, enough to run the SGLang plugin
# tests (tests/integrations/sglang: the plugin, and SGLang's own MoE layer on its Triton runner in
# Triton's interpreter) on a CPU-only machine.
#
#   .ci/install-sglang.sh VENV [BASE_VENV]
#
# With BASE_VENV (a venv holding torch 2.13.0, triton 3.7.1 and pytest, as tests/run.sh's .venv does) VENV
# is layered on it (.ci/venv.sh) and holds only what SGLang adds, about 0.5 GB instead of 2.2 GB.
#
# SGLang's own metadata pins a CUDA stack (torch 2.14.1, flashinfer, deep_ep, ...) that neither installs
# nor is needed on CPU. So: torch 2.13.0 and pytest with their dependencies, then the measured set of
# packages that lets SGLang's MoE dispatcher modules, plugin loader, MoE factory and launch-time
# argument resolution import, all with --no-deps, then mori-sglang itself (editable, --no-deps) so its
# entry point in the group sglang.srt.plugins is registered. The tests call
# tests/integrations/sglang/cpu_import.py before importing SGLang (torchvision stand-in, temporary
# SGLANG_CACHE_DIR); the final check here does the same.
#
# Idempotent: a stamp in the venv records the hash of this script, .ci/venv.sh and BASE_VENV's path; a
# re-run with all three unchanged and a venv that still imports everything returns at once.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 VENV [BASE_VENV]" >&2
    exit 2
fi
venv=$1
base=${2:-}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=venv.sh
source "$repo/.ci/venv.sh"
stamp="$venv/.mori-sglang-sglang-install"
script_hash=$(cat "${BASH_SOURCE[0]}" "$repo/.ci/venv.sh" <(echo "$base") | sha256sum | cut -d' ' -f1)

check() {
    PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" - <<'EOF'
from tests.integrations.sglang.cpu_import import prepare_sglang_cpu_import

prepare_sglang_cpu_import()
from importlib.metadata import entry_points

import sglang.srt.arg_groups.moe_hook  # noqa: F401  launch-time resolution
import sglang.srt.layers.moe.fused_moe_triton.layer  # noqa: F401  the MoE dispatcher factory
import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe  # noqa: F401  the Triton experts
import sglang.srt.layers.moe.token_dispatcher.moriep  # noqa: F401
import sglang.srt.plugins  # noqa: F401

names = [ep.name for ep in entry_points(group="sglang.srt.plugins")]
assert "mori_sglang" in names, f"mori_sglang is not registered in sglang.srt.plugins: {names}"
EOF
}

if [[ -f $stamp && $(cat "$stamp") == "$script_hash" ]] && check 2>/dev/null; then
    echo "SGLang test environment in $venv is up to date"
    exit 0
fi

make_venv "$venv" "$base"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check --quiet)

"${pip[@]}" torch==2.13.0 pytest

pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
cat >"$pins" <<'EOF'
sglang==0.5.23
triton==3.7.1
torchvision==0.28.0
transformers==5.19.0
tokenizers==0.23.2
safetensors==0.8.0
huggingface_hub==2.4.0
httpx2==2.16.2
httpcore2==2.16.2
truststore==0.10.5
h11==0.16.0
apache-tvm-ffi==0.1.11
compressed-tensors==0.18.0
sentencepiece==0.2.1
gguf==0.19.0
einops==0.8.2
loguru==0.7.3
dill==0.4.1
orjson==3.13.0
psutil==7.2.2
pybase64==1.5.1
requests==2.34.2
urllib3==2.8.0
idna==3.20
certifi==2026.10.19.post1
packaging==26.4
pillow==13.0.0
starlette==1.10.0
anyio==4.16.0
msgspec==0.23.0
pydantic==2.14.4
pydantic_core==2.50.5
typing-inspection==0.4.5
annotated-types==0.8.0
pyzmq==27.3.0
tqdm==4.70.1
ipython==9.18.1
traitlets==5.16.1
Pygments==2.21.0
aiohttp==3.14.5
multidict==7.2.1
attrs==26.1.0
yarl==1.25.1
propcache==0.5.4
aiohappyeyeballs==2.7.1
aiosignal==1.4.0
frozenlist==1.8.0
regex==2026.11.19
PyYAML==6.0.4
numpy==2.4.6
openai==2.8.0
httpx==0.29.0
httpcore==1.0.9
sniffio==1.3.1
distro==1.9.0
jiter==0.19.0
partial-json-parser==0.2.1.1.post7
EOF
"${pip[@]}" --no-deps -r "$pins"
"${pip[@]}" --no-deps -e "$repo"

check
echo "$script_hash" >"$stamp"
echo "SGLang test environment ready in $venv"
