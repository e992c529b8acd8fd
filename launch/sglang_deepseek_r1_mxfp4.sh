#!/usr/bin/env bash
# SGLang serving DeepSeek-R1-MXFP4 on 8 AMD GPUs through --moe-a2a-backend mori.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE="SGLang DeepSeek-R1-MXFP4 recipe"
ABOUT="Start an SGLang server for DeepSeek-R1-MXFP4 (e.g. amd/DeepSeek-R1-MXFP4-Preview) on AMD GPUs
with --moe-a2a-backend mori and SGLANG_USE_AITER=1 (SGLang runs the MoE layers of a Quark MXFP4
checkpoint on AITER only): tp/ep/dp 8 with dp-attention, --deepep-mode low_latency; with --mode
normal or auto, split dispatch/combine (SGLANG_MORI_SPLIT_DISPATCH_COMBINE=1). The combine dtype is
the one knob an A/B run changes."
GPUS=8
PORT=30000
MODE=low_latency
MODE_CHOICES=(auto normal low_latency)
PROVIDER=auto

prepare amd 1 "$@"
export_env SGLANG_USE_AITER 1
launch_sglang
