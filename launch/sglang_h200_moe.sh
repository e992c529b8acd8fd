#!/usr/bin/env bash
# SGLang serving a Qwen3 / DeepSeek MoE model on NVIDIA H200s through --moe-a2a-backend mori.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RECIPE="SGLang NVIDIA H200 MoE recipe"
ABOUT="Start an SGLang server for a Qwen3 MoE (e.g. Qwen3-30B-A3B, Qwen3-235B-A22B-FP8) or DeepSeek
V3/R1 (FP8) model on NVIDIA H200 GPUs with --moe-a2a-backend mori, served by mori-sglang's Triton
kernels (the native MoRI library is ROCm-only): tp/ep/dp = --gpus with dp-attention. The experts run
on SGLang's Triton MoE runner (--moe-runner-backend triton; bf16 or block-128 fp8 experts, the fp8
dispatch payload taken as it arrives), bounded by SGLANG_MORI_RECV_BOUND=1 to the rows received."
GPUS=8
PORT=30000
MODE=auto
MODE_CHOICES=(auto normal low_latency)
PROVIDER=triton

prepare nvidia 0 "$@"
# The received-row bound SGLang proves from the DP batch sizes: decode batches sort and multiply
# what arrived, not the whole receive buffer.
export_env SGLANG_MORI_RECV_BOUND 1
launch_sglang --moe-runner-backend triton
