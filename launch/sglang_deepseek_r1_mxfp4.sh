#!/usr/bin/env bash
# SGLang serving DeepSeek-R1-MXFP4 on 8 GPUs through --moe-a2a-backend mori.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE="SGLang DeepSeek-R1-MXFP4 recipe"
ABOUT="Start an SGLang server for DeepSeek-R1-MXFP4 (e.g. amd/DeepSeek-R1-MXFP4-Preview) with
--moe-a2a-backend mori: tp/ep/dp 8 with dp-attention, --deepep-mode low_latency, and split
dispatch/combine (SGLANG_MORI_SPLIT_DISPATCH_COMBINE=1). The combine dtype is the one knob an
A/B run changes. On ROCm GPUs it also sets SGLANG_USE_AITER=1."
GPUS=8
PORT=30000
MODE=low_latency
MODE_CHOICES=(auto normal low_latency)
PROVIDER=auto

prepare any 1 "$@"
if [[ $GPU_VENDOR == amd ]]; then
    export_env SGLANG_USE_AITER 1
fi
launch_sglang
