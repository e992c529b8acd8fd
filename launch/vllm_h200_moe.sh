#!/usr/bin/env bash
# vLLM serving a Qwen3 / DeepSeek MoE model on NVIDIA H200s through --all2all-backend mori_*.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE="vLLM NVIDIA H200 MoE recipe"
ABOUT="Start a vLLM server for a Qwen3 MoE or DeepSeek V3/R1 (FP8) model on NVIDIA H200 GPUs: data parallel
--gpus with expert parallelism over all of them and --all2all-backend mori_<mode>, served by
mori-sglang's Triton kernels (the native MoRI library is ROCm-only)."
GPUS=8
PORT=8000
MODE=high_throughput
MODE_CHOICES=(high_throughput low_latency)
PROVIDER=triton

prepare nvidia 0 "$@"
launch_vllm
