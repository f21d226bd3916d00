#!/usr/bin/env bash
# Train the small hybrid Mamba-Transformer on the built-in synthetic packed data, on every
# GPU of this machine (data parallel). Exits non-zero, saying why, where no GPU is visible.
#
#   bash examples/local/train_hybrid_synthetic.sh            # 200 iterations
#   TRAIN_ITERS=50 EXTRA_ARGS="--cuda-graph-impl local --cuda-graph-max-packed-seqs 64" bash ...
set -euo pipefail
cd "$(dirname "$0")/../.."

NGPUS=$(python3 -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$NGPUS" -eq 0 ]; then
  echo "train_hybrid_synthetic.sh: no CUDA GPU is visible; training needs NVIDIA GPUs." >&2
  echo "On a CPU machine run the tests instead (see README.md)." >&2
  exit 1
fi

TRAIN_ITERS=${TRAIN_ITERS:-200}
OUT_DIR=${OUT_DIR:-runs/hybrid_synthetic}
mkdir -p "$OUT_DIR"
export CUDA_DEVICE_MAX_CONNECTIONS=1

set -x
torchrun --nproc-per-node "$NGPUS" pretrain_mamba.py \
  --sft --mock-data --mock-doc-length-median 512 \
  --hybrid-override-pattern "M-M-M*-M-M-M*-M-" --hidden-size 1024 \
  --num-attention-heads 16 --num-query-groups 8 --seq-length 4096 \
  --micro-batch-size 1 --global-batch-size $((4 * NGPUS)) --train-iters "$TRAIN_ITERS" \
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 10 --bf16 --seed 1234 \
  --log-interval 10 --metrics-file "$OUT_DIR/metrics.jsonl" \
  --tensorboard-dir "$OUT_DIR/tensorboard" ${EXTRA_ARGS:-}
