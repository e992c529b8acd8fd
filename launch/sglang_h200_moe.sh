#!/usr/bin/env bash
# SGLang serving a Qwen3 / DeepSeek MoE model on NVIDIA H200s through --moe-a2a-backend mori.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE="SGLang NVIDIA H200 MoE recipe"
ABOUT="Start an SGLang server for a Qwen3 MoE (e.g. Qwen3-30B-A3B, Qwen3-235B-A22B-FP8) or DeepSeek
V3/R1 (FP8) model on NVIDIA H200 GPUs with --moe-a2a-backend mori, served by mori-sglang's Triton
kernels (the native MoRI library is ROCm-only): tp/ep/dp = --gpus with dp-attention."
GPUS=8
PORT=30000
MODE=auto
MODE_CHOICES=(auto normal low_latency)
PROVIDER=triton

prepare nvidia 0 "$@"
launch_sglang
