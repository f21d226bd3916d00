#!/usr/bin/env bash
# The model and knobs of examples/slurm/sft_gpt.sbatch, launched on this machine with
# `torchrun --standalone` on every visible GPU (GPUS_PER_NODE to choose fewer).
#
#   bash examples/local/run_gpt.sh
#   TRAIN_ITERS=50 CUDA_GRAPH_IMPL=none bash examples/local/run_gpt.sh
#   bash examples/local/run_gpt.sh --dry-run        # print the launch, run nothing
set -euo pipefail
LAUNCH_MODE=local exec bash "$(dirname "${BASH_SOURCE[0]}")/../slurm/sft_gpt.sbatch" "$@"
