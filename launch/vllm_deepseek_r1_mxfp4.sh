#!/usr/bin/env bash
# vLLM serving DeepSeek-R1-MXFP4 on 8 GPUs through --all2all-backend mori_*.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE="vLLM DeepSeek-R1-MXFP4 recipe"
ABOUT="Start a vLLM server for DeepSeek-R1-MXFP4 (e.g. amd/DeepSeek-R1-MXFP4-Preview): data parallel 8
(vLLM's attention DP) with expert parallelism over all 8 GPUs, --all2all-backend mori_low_latency;
with --mode high_throughput, split dispatch/combine (SGLANG_MORI_SPLIT_DISPATCH_COMBINE=1). On ROCm
GPUs it also sets VLLM_ROCM_USE_AITER=1."
GPUS=8
PORT=8000
MODE=low_latency
MODE_CHOICES=(high_throughput low_latency)
PROVIDER=auto

prepare any 1 "$@"
if [[ $GPU_VENDOR == amd ]]; then
    export_env VLLM_ROCM_USE_AITER 1
fi
launch_vllm
