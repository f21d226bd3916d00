#!/usr/bin/env bash
# Train the small hybrid Mamba-Transformer (pattern M-M-M*-M-M-M*-M-: 7 Mamba, 2 attention,
# 7 MLP layers; hidden 1024, GQA 16/8, seq 4096) on the built-in synthetic packed data, on
# every visible GPU (data parallel), under CUDA graphs, next to an eager reference:
#
#   1. the graph capacity comes from the data: tools/capacity_advisor.py packs the same
#      synthetic documents (CPU, seconds) and recommends --cuda-graph-max-packed-seqs;
#   2. a short eager run (EAGER_ITERS iterations) is the reference;
#   3. the same model trains TRAIN_ITERS iterations under layer (or chunk) graphs;
#   4. tools/benchmark.py --from-metrics prints both runs' tokens/s and the speedup.
#
#   bash examples/local/train_hybrid_synthetic.sh
#   CUDA_GRAPH_GRANULARITY=chunk TRAIN_ITERS=100 bash examples/local/train_hybrid_synthetic.sh
#   bash examples/local/train_hybrid_synthetic.sh --dry-run      # print the commands, run nothing
#
# Arguments after the script (after --dry-run, if given) are appended to both training runs.
# Knobs (environment): NGPUS (default: the visible CUDA GPUs), TRAIN_ITERS (200), EAGER_ITERS
# (30), CUDA_GRAPH_GRANULARITY (layer | chunk), CUDA_GRAPH_MAX_PACKED_SEQS (empty: ask the
# capacity advisor), TARGET_FALLBACK_RATE (0.01), CUDA_GRAPH_WARMUP_STEPS (2), LOG_INTERVAL
# (10), SEED (1234), OUT_DIR (runs/hybrid_synthetic), EXTRA_ARGS, TE_PATCHES (auto | 1 | 0,
# examples/common.sh), PYTHON (python3). Without a CUDA GPU it says so and exits 1.
set -euo pipefail
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source "$REPO_DIR/examples/common.sh"   # quote_words, die, te_patches, FORK_NUMERICS
cd "$REPO_DIR"
NAME=$(basename "${BASH_SOURCE[0]}")

DRY_RUN=${DRY_RUN:-0}
if [ "${1:-}" = --dry-run ]; then
  DRY_RUN=1
  shift
fi
CLI_ARGS=("$@")
PYTHON=${PYTHON:-python3}

if [ -z "${NGPUS:-}" ]; then
  if ! NGPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null); then
    die "PYTHON" "$PYTHON" "It cannot import torch: install the project (README.md) or point PYTHON at its interpreter"
  fi
fi
case "$NGPUS" in ''|*[!0-9]*) die "NGPUS" "$NGPUS" "Give a number of GPUs" ;; esac
if [ "$NGPUS" -eq 0 ]; then
  if [ "$DRY_RUN" != 1 ]; then
    echo "$NAME: no CUDA GPU is visible; training needs NVIDIA GPUs." >&2
    echo "On a CPU machine run the tests instead (see README.md)." >&2
    exit 1
  fi
  echo "# no GPU is visible: showing NGPUS=1"
  NGPUS=1
fi

TRAIN_ITERS=${TRAIN_ITERS:-200}
EAGER_ITERS=${EAGER_ITERS:-30}
LOG_INTERVAL=${LOG_INTERVAL:-10}
SEED=${SEED:-1234}
SEQ_LENGTH=4096
VOCAB_SIZE=32000
DOC_LENGTH_MEDIAN=512
GLOBAL_BATCH_SIZE=$((4 * NGPUS))              # four micro-batches of one row per GPU
CUDA_GRAPH_GRANULARITY=${CUDA_GRAPH_GRANULARITY:-layer}
CUDA_GRAPH_MAX_PACKED_SEQS=${CUDA_GRAPH_MAX_PACKED_SEQS:-}
CUDA_GRAPH_WARMUP_STEPS=${CUDA_GRAPH_WARMUP_STEPS:-2}
TARGET_FALLBACK_RATE=${TARGET_FALLBACK_RATE:-0.01}
OUT_DIR=${OUT_DIR:-runs/hybrid_synthetic}
JOB_TAG=${JOB_TAG:-$(date +%Y%m%d-%H%M%S)}
EAGER_METRICS=$OUT_DIR/eager_$JOB_TAG.jsonl
GRAPH_METRICS=$OUT_DIR/${CUDA_GRAPH_GRANULARITY}_graphs_$JOB_TAG.jsonl

case "$CUDA_GRAPH_GRANULARITY" in
  layer|chunk) ;;
  *) die "CUDA_GRAPH_GRANULARITY" "$CUDA_GRAPH_GRANULARITY" "Use layer or chunk" ;;
esac
for knob in TRAIN_ITERS EAGER_ITERS LOG_INTERVAL; do
  value=${!knob}
  case "$value" in ''|*[!0-9]*|0) die "$knob" "$value" "Give a positive number of iterations" ;; esac
done
if [ "$EAGER_ITERS" -le "$LOG_INTERVAL" ] || [ "$TRAIN_ITERS" -le "$LOG_INTERVAL" ]; then
  die "EAGER_ITERS / TRAIN_ITERS" "$EAGER_ITERS / $TRAIN_ITERS" \
      "Both must exceed LOG_INTERVAL ($LOG_INTERVAL): the first interval (compilation, capture) is left out of tokens/s"
fi

# The capacity: the advisor packs the synthetic documents the runs will read.
ADVISOR=("$PYTHON" tools/capacity_advisor.py --mock-data --seq-length "$SEQ_LENGTH"
         --vocab-size "$VOCAB_SIZE" --micro-batch-size 1
         --mock-doc-length-median "$DOC_LENGTH_MEDIAN" --seed "$SEED"
         --target-fallback-rate "$TARGET_FALLBACK_RATE" --print-capacity)

# One training run: ITERS, METRICS, then its own flags. Megatron-LM's command line: the
# pattern gives the layers, --group-query-attention makes --num-query-groups count, no
# position embedding and FORK_NUMERICS (common.sh) as the fork trained; --eval-iters 0: no
# evaluation of the synthetic validation split.
training() {
  local iters=$1 metrics=$2
  shift 2
  local extra
  read -r -a extra <<< "${EXTRA_ARGS:-}"   # split on whitespace: values cannot hold spaces
  RUN=(torchrun --standalone --nnodes 1 --nproc-per-node "$NGPUS" pretrain_mamba.py
       --hybrid-layer-pattern "M-M-M*-M-M-M*-M-" --hidden-size 1024
       --num-attention-heads 16 --group-query-attention --num-query-groups 8
       --position-embedding-type none --seq-length "$SEQ_LENGTH"
       --max-position-embeddings "$SEQ_LENGTH" --vocab-size "$VOCAB_SIZE" "${FORK_NUMERICS[@]}"
       --sft --mock-data --mock-doc-length-median "$DOC_LENGTH_MEDIAN" --eval-iters 0
       --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH_SIZE" --train-iters "$iters"
       --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters $((iters < 10 ? iters : 10)) --bf16
       --seed "$SEED" --log-interval "$LOG_INTERVAL" --metrics-file "$metrics"
       "$@" "${extra[@]}" "${CLI_ARGS[@]}")
}

graph_flags() {  # the graph run's flags for capacity $1
  GRAPH_FLAGS=(--cuda-graph-impl local --cuda-graph-granularity "$CUDA_GRAPH_GRANULARITY"
               --cuda-graph-max-packed-seqs "$1" --cuda-graph-warmup-steps "$CUDA_GRAPH_WARMUP_STEPS")
}

SUMMARY=("$PYTHON" tools/benchmark.py --presets hybrid-small --from-metrics
         "eager=$EAGER_METRICS" "$CUDA_GRAPH_GRANULARITY-graphs=$GRAPH_METRICS"
         --warmup "$LOG_INTERVAL" --log-interval "$LOG_INTERVAL" --nproc "$NGPUS"
         --global-batch-size "$GLOBAL_BATCH_SIZE")

training "$EAGER_ITERS" "$EAGER_METRICS"
EAGER_RUN=("${RUN[@]}")
graph_flags "${CUDA_GRAPH_MAX_PACKED_SEQS:-0}"
training "$TRAIN_ITERS" "$GRAPH_METRICS" "${GRAPH_FLAGS[@]}"
decide_te_patches "${RUN[@]}"

if [ "$DRY_RUN" = 1 ]; then
  echo "# ${NAME%.sh} ($NGPUS GPU(s)): dry run, nothing is launched"
  echo "cd $(printf '%q' "$REPO_DIR")"
  launch_environment print
  echo "mkdir -p $(printf '%q' "$OUT_DIR")"
  if [ -n "$CUDA_GRAPH_MAX_PACKED_SEQS" ]; then
    echo "CAPACITY=$(printf '%q' "$CUDA_GRAPH_MAX_PACKED_SEQS")"
  else
    echo "CAPACITY=\$($(quote_words "${ADVISOR[@]}"))"
  fi
  echo "$(quote_words "${EAGER_RUN[@]}")"
  graph_flags CAPACITY_PLACEHOLDER
  training "$TRAIN_ITERS" "$GRAPH_METRICS" "${GRAPH_FLAGS[@]}"
  echo "$(quote_words "${RUN[@]}")" | sed 's/CAPACITY_PLACEHOLDER/"$CAPACITY"/'
  echo "$(quote_words "${SUMMARY[@]}")"
  exit 0
fi

launch_environment
mkdir -p "$OUT_DIR"
if [ -n "$CUDA_GRAPH_MAX_PACKED_SEQS" ]; then
  CAPACITY=$CUDA_GRAPH_MAX_PACKED_SEQS
else
  echo "+ $(quote_words "${ADVISOR[@]}")"
  CAPACITY=$("${ADVISOR[@]}")
  case "$CAPACITY" in ''|*[!0-9]*) die "capacity advisor output" "$CAPACITY" "Run the advisor above by hand" ;; esac
  echo "capacity from the data: --cuda-graph-max-packed-seqs $CAPACITY"
fi

echo "+ $(quote_words "${EAGER_RUN[@]}")"
"${EAGER_RUN[@]}"
graph_flags "$CAPACITY"
training "$TRAIN_ITERS" "$GRAPH_METRICS" "${GRAPH_FLAGS[@]}"
echo "+ $(quote_words "${RUN[@]}")"
"${RUN[@]}"

echo
echo "tokens/s, eager reference vs $CUDA_GRAPH_GRANULARITY graphs (capacity $CAPACITY), first $LOG_INTERVAL iterations left out:"
"${SUMMARY[@]}"
