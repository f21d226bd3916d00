#!/usr/bin/env bash
# The model and knobs of examples/slurm/sft_hybrid.sbatch, launched on this machine with
# `torchrun --standalone` on every visible GPU (GPUS_PER_NODE to choose fewer).
#
#   bash examples/local/run_hybrid.sh
#   NSYS=1 TRAIN_ITERS=20 GPUS_PER_NODE=1 bash examples/local/run_hybrid.sh
#   bash examples/local/run_hybrid.sh --dry-run     # print the launch, run nothing
set -euo pipefail
LAUNCH_MODE=local exec bash "$(dirname "${BASH_SOURCE[0]}")/../slurm/sft_hybrid.sbatch" "$@"
