# Launch logic shared by examples/slurm/*.sbatch and examples/local/run_*.sh. Sourced, not run.
#
# The launch lines are Megatron-LM's command line (pretrain_gpt.py / pretrain_mamba.py run
# Megatron-LM's own parser and pretrain(); the fork's flags on top, docs/flags.md).
# The sourcing script sets the model: MODEL_SCRIPT (pretrain_gpt.py | pretrain_mamba.py),
# MODEL_ARGS (a bash array of the model's shape flags), RUN_NAME, then calls
#   launch slurm "$@"    # srun, one task per node (torchrun) or one per GPU (srun)
#   launch local "$@"    # torchrun --standalone on this machine
# Every other knob is an environment variable with a default, below; docs/slurm.md lists them.
# `--dry-run` as the first argument (or DRY_RUN=1) prints the launch and exits 0; any other
# arguments are appended to the training flags (after EXTRA_ARGS, so they win).
# Where the training flags run Transformer Engine with context parallelism (CP > 1, or
# --dynamic-cp-sizes with a size > 1), te_patches/ goes on PYTHONPATH (TE_PATCHES, below).

# What the fork's parser defaulted to, as Megatron-LM's flags (upstream's defaults differ:
# LayerNorm, biases, dropout 0.1, Adam beta2 0.999, linear decay, loss averaged per micro-batch).
# Every training line here carries them, so a run trains the numbers the fork's runs did. The
# model's own choices (position embedding, query groups, FFN width) are in MODEL_ARGS.
FORK_NUMERICS=(
  --normalization RMSNorm --disable-bias-linear --hidden-dropout 0 --attention-dropout 0
  --adam-beta2 0.95 --lr-decay-style cosine --calculate-per-token-loss
)

# Die with the repository's error shape: "<what> is wrong: <value>. <what to do>."
die() {
  echo "$(basename "${0}"): $1 is wrong: $2. $3." >&2
  exit 1
}

# One word per argument, quoted so that a shell reads back exactly the same words.
quote_words() {
  local out="" word
  for word in "$@"; do
    out+="$(printf '%q' "$word") "
  done
  printf '%s' "${out% }"
}

# Wrap a string in single quotes for display (bash -c '...').
single_quote() {
  local s=$1
  printf "'%s'" "${s//\'/\'\\\'\'}"
}

# Status 0 (true) if the training flags run context parallelism, which on packed data runs in
# Transformer Engine: a --context-parallel-size above 1, or a --dynamic-cp-sizes set with a
# size above 1 (the last spelling of a flag wins, as in argparse).
uses_te_context_parallel() {
  local cp=1 sizes="" word expect="" size
  for word in "$@"; do
    case "$expect" in
      cp) cp=$word; expect=""; continue ;;
      sizes)
        case "$word" in
          [0-9]*) sizes+=" $word"; continue ;;
          *) expect="" ;;
        esac ;;
    esac
    case "$word" in
      --context-parallel-size) expect=cp ;;
      --context-parallel-size=*) cp=${word#*=} ;;
      --dynamic-cp-sizes) sizes=""; expect=sizes ;;
      --dynamic-cp-sizes=*) sizes=" ${word#*=}" ;;
    esac
  done
  case "$cp" in ''|*[!0-9]*) cp=1 ;; esac
  if [ "$cp" -gt 1 ]; then return 0; fi
  for size in $sizes; do
    case "$size" in ''|*[!0-9]*) continue ;; esac
    if [ "$size" -gt 1 ]; then return 0; fi
  done
  return 1
}

# TE_PATCHES_ON=1 where te_patches/ (docs/te-patches.md: a sync-free THD context-parallel
# backward for Transformer Engine) belongs on PYTHONPATH for these training flags.
# TE_PATCHES: auto (default: with TE context parallelism), 1 (always) or 0 (never; e.g. with
# a TE release te_patches does not know, which it refuses).
decide_te_patches() {
  TE_PATCHES=${TE_PATCHES:-auto}
  TE_PATCHES_ON=0
  case "$TE_PATCHES" in
    1) TE_PATCHES_ON=1 ;;
    0) ;;
    auto) if uses_te_context_parallel "$@"; then TE_PATCHES_ON=1; fi ;;
    *) die "TE_PATCHES" "$TE_PATCHES" "Use auto, 1 or 0" ;;
  esac
}

# Export (and with an argument "print", echo) PYTHONPATH with te_patches/ first, when on.
apply_te_patches() {
  if [ "$TE_PATCHES_ON" != 1 ]; then return 0; fi
  if [ "${1:-}" = print ]; then
    # Printed for a shell to read back: PYTHONPATH is expanded where the line runs.
    echo "export PYTHONPATH=$(printf '%q' "$REPO_DIR/te_patches")\${PYTHONPATH:+:\$PYTHONPATH}"
    return 0
  fi
  export PYTHONPATH="$REPO_DIR/te_patches${PYTHONPATH:+:$PYTHONPATH}"
}

# The launch environment: Megatron's CUDA/NCCL settings and te_patches when on. With an
# argument "print", echo it as shell lines instead of setting it.
launch_environment() {
  if [ "${1:-}" = print ]; then
    echo "export CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0"
    apply_te_patches print
    return 0
  fi
  export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron: keep TP/PP communication in issue order
  export NCCL_NVLS_ENABLE=0              # NVLink SHARP (multicast) off
  apply_te_patches
}

# GPUs of this machine (0 without nvidia-smi); local launches only.
visible_gpus() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

# The first host of the allocation: `scontrol show hostnames` inside Slurm, else localhost
# (a dry run on a laptop or in CI never calls scontrol).
first_host() {
  if [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1
  else
    echo localhost
  fi
}

# Every knob with its default. MODE is slurm or local.
set_defaults() {
  local mode=$1
  if [ "$mode" = local ]; then
    NNODES=1
    GPUS_PER_NODE=${GPUS_PER_NODE:-$(visible_gpus)}
    if [ "$GPUS_PER_NODE" -eq 0 ]; then
      [ "$DRY_RUN" = 1 ] || die "GPUS_PER_NODE" 0 "No CUDA GPU is visible; training needs NVIDIA GPUs"
      echo "# no GPU is visible: showing GPUS_PER_NODE=1"
      GPUS_PER_NODE=1
    fi
  else
    NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
    GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  fi
  LAUNCHER=${LAUNCHER:-torchrun}
  CONTAINER_IMAGE=${CONTAINER_IMAGE:-}          # empty: run in the host environment
  CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-$REPO_DIR:$REPO_DIR}
  MASTER_PORT=${MASTER_PORT:-29500}

  DATA_PATH=${DATA_PATH:-}                      # empty: --mock-data
  VALID_DATA_PATH=${VALID_DATA_PATH:-}
  VOCAB_SIZE=${VOCAB_SIZE:-32000}
  SAVE_DIR=${SAVE_DIR:-$REPO_DIR/runs/$RUN_NAME}
  LOAD_DIR=${LOAD_DIR:-}                        # empty: train from scratch
  LOG_DIR=${LOG_DIR:-$SAVE_DIR/logs}
  JOB_TAG=${JOB_TAG:-${SLURM_JOB_ID:-$(date +%Y%m%d-%H%M%S)}}
  LOG_FILE=${LOG_FILE:-$LOG_DIR/${RUN_NAME}_$JOB_TAG.log}
  METRICS_FILE=${METRICS_FILE:-$LOG_DIR/metrics_$JOB_TAG.jsonl}

  SEQ_LENGTH=${SEQ_LENGTH:-4096}
  MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
  TRAIN_ITERS=${TRAIN_ITERS:-500}
  SAVE_INTERVAL=${SAVE_INTERVAL:-$TRAIN_ITERS}  # default: one checkpoint, at the end
  LR=${LR:-3e-4}
  MIN_LR=${MIN_LR:-3e-5}
  LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$((TRAIN_ITERS < 10 ? TRAIN_ITERS : 10))}
  LOG_INTERVAL=${LOG_INTERVAL:-10}
  EVAL_INTERVAL=${EVAL_INTERVAL:-100}           # used only with VALID_DATA_PATH
  EVAL_ITERS=${EVAL_ITERS:-10}                  # used only with VALID_DATA_PATH (else 0)
  SEED=${SEED:-1234}
  TP=${TP:-1}
  PP=${PP:-1}
  CP=${CP:-1}                                   # --context-parallel-size (needs TE)

  # none: eager; transformer_engine: TE graphs (PP=1); full_iteration: one graph per iteration
  CUDA_GRAPH_IMPL=${CUDA_GRAPH_IMPL:-local}
  CUDA_GRAPH_MAX_PACKED_SEQS=${CUDA_GRAPH_MAX_PACKED_SEQS:-64}
  CUDA_GRAPH_WARMUP_STEPS=${CUDA_GRAPH_WARMUP_STEPS:-3}
  # --cuda-graph-modules; empty: the whole layer (CUDA_GRAPH_SCOPE: its older name)
  CUDA_GRAPH_MODULES=${CUDA_GRAPH_MODULES:-${CUDA_GRAPH_SCOPE:-}}
  CUDA_GRAPH_GRANULARITY=${CUDA_GRAPH_GRANULARITY:-layer}  # chunk: one graph per pipeline chunk

  NSYS=${NSYS:-0}
  NSYS_OUTPUT=${NSYS_OUTPUT:-$LOG_DIR/nsys/${RUN_NAME}_${JOB_TAG}_%h_%p}
  PROFILE_STEP_START=${PROFILE_STEP_START:-10}
  PROFILE_STEP_END=${PROFILE_STEP_END:-12}
  EXTRA_ARGS=${EXTRA_ARGS:-}

  local world=$((NNODES * GPUS_PER_NODE)) model_parallel=$((TP * PP * CP))
  if [ "$model_parallel" -lt 1 ] || [ $((world % model_parallel)) -ne 0 ]; then
    if [ "$CP" = 1 ]; then
      die "TP x PP" "$TP x $PP" "It must divide NNODES x GPUS_PER_NODE = $world"
    fi
    die "TP x PP x CP" "$TP x $PP x $CP" "It must divide NNODES x GPUS_PER_NODE = $world"
  fi
  DATA_PARALLEL=$((world / model_parallel))
  # Four micro-batches per iteration by default (gradient accumulation).
  GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$((MICRO_BATCH_SIZE * DATA_PARALLEL * 4))}
  case "$LAUNCHER" in
    srun|torchrun) ;;
    *) die "LAUNCHER" "$LAUNCHER" "Use srun or torchrun" ;;
  esac
  case "$NSYS" in
    0|1) ;;
    *) die "NSYS" "$NSYS" "Use 0 or 1" ;;
  esac
}

# PY_ARGS: the training flags (model shape from the caller, then data, training, graphs).
build_python_args() {
  PY_ARGS=("${MODEL_ARGS[@]}" --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
           --vocab-size "$VOCAB_SIZE" "${FORK_NUMERICS[@]}")
  if [ -n "$DATA_PATH" ]; then
    read -r -a data_blend <<< "$DATA_PATH"  # a path, or a blend "0.3 A 0.7 B"
    PY_ARGS+=(--data-path "${data_blend[@]}")
  else
    PY_ARGS+=(--mock-data)
  fi
  if [ -n "$VALID_DATA_PATH" ]; then
    read -r -a valid_blend <<< "$VALID_DATA_PATH"
    PY_ARGS+=(--valid-data-path "${valid_blend[@]}" --eval-interval "$EVAL_INTERVAL"
              --eval-iters "$EVAL_ITERS")
  else
    # No validation: every --data-path document trains (said explicitly: Megatron-LM's own
    # --split default is 969,30,1) and nothing evaluates (mock data has a split of its own).
    if [ -n "$DATA_PATH" ]; then PY_ARGS+=(--split 100,0,0); fi
    PY_ARGS+=(--eval-iters 0)
  fi
  PY_ARGS+=(
    --sft --bf16 --seed "$SEED"
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR"
    --lr-warmup-iters "$LR_WARMUP_ITERS"
    --save "$SAVE_DIR/checkpoints" --save-interval "$SAVE_INTERVAL"
    --log-interval "$LOG_INTERVAL" --metrics-file "$METRICS_FILE"
    --tensorboard-dir "$LOG_DIR/tensorboard"
  )
  if [ "$CP" != 1 ]; then PY_ARGS+=(--context-parallel-size "$CP"); fi
  if [ -n "$LOAD_DIR" ]; then PY_ARGS+=(--load "$LOAD_DIR"); fi
  if [ "$CUDA_GRAPH_IMPL" != none ]; then
    PY_ARGS+=(--cuda-graph-impl "$CUDA_GRAPH_IMPL"
              --cuda-graph-max-packed-seqs "$CUDA_GRAPH_MAX_PACKED_SEQS"
              --cuda-graph-warmup-steps "$CUDA_GRAPH_WARMUP_STEPS"
              --cuda-graph-granularity "$CUDA_GRAPH_GRANULARITY")
    if [ -n "$CUDA_GRAPH_MODULES" ]; then
      local modules
      read -r -a modules <<< "$CUDA_GRAPH_MODULES"
      PY_ARGS+=(--cuda-graph-modules "${modules[@]}")
    fi
    if [ "$CUDA_GRAPH_IMPL" = full_iteration ]; then
      # DDP's NaN check reads gradient norms on the host: not inside an iteration graph.
      PY_ARGS+=(--no-check-for-nan-in-loss-and-grad)
    fi
  fi
  if [ "$NSYS" = 1 ]; then
    # --profile: Megatron-LM's loop brackets iterations [start, end) with
    # cudaProfilerStart/Stop (every rank unless --profile-ranks names some), the range that
    # nsys --capture-range=cudaProfilerApi records. The fork also runs torch.profiler there for
    # `gpu busy (ms)` (megatron/packed_training/profiling.py); under nsys the two CUPTI clients
    # may refuse each other, so that number is not to be trusted (docs/slurm.md, nsys).
    PY_ARGS+=(--profile --profile-step-start "$PROFILE_STEP_START"
              --profile-step-end "$PROFILE_STEP_END")
  fi
  local extra
  read -r -a extra <<< "$EXTRA_ARGS"   # split on whitespace: values cannot hold spaces
  PY_ARGS+=("${extra[@]}" "${CLI_ARGS[@]}")
}

# NSYS_PREFIX: the nsys wrapper, or nothing.
build_nsys_prefix() {
  NSYS_PREFIX=()
  if [ "$NSYS" = 1 ]; then
    # Records only the --profile iterations; --cuda-graph-trace=node shows each kernel of a
    # replayed graph instead of one opaque graph launch. %h / %p: one report per host / process.
    NSYS_PREFIX=(nsys profile --trace=cuda,nvtx,osrt --cuda-graph-trace=node
                 --capture-range=cudaProfilerApi --capture-range-end=stop
                 --force-overwrite=true -o "$NSYS_OUTPUT")
  fi
}

# LAUNCH (array) and LAUNCH_TEXT (its shell rendering) for MODE slurm or local.
build_launch() {
  local mode=$1 script=$MODEL_SCRIPT
  build_python_args
  build_nsys_prefix
  if [ "$mode" = local ]; then
    LAUNCH=("${NSYS_PREFIX[@]}" torchrun --standalone --nnodes 1
            --nproc-per-node "$GPUS_PER_NODE" "$script" "${PY_ARGS[@]}")
    LAUNCH_TEXT=$(quote_words "${LAUNCH[@]}")
    return
  fi
  MASTER_ADDR=${MASTER_ADDR:-$(first_host)}
  # --ntasks is explicit: inside sbatch, srun would otherwise read the job's SLURM_NTASKS.
  local srun_args=(--nodes="$NNODES" --kill-on-bad-exit=1)
  local task_cmd
  if [ "$LAUNCHER" = torchrun ]; then
    # One task per node; torchrun starts GPUS_PER_NODE ranks. $SLURM_NODEID is expanded by
    # each task's own shell.
    srun_args+=(--ntasks="$NNODES" --ntasks-per-node=1)
    task_cmd="$(quote_words "${NSYS_PREFIX[@]}" torchrun --nnodes "$NNODES" \
                  --nproc-per-node "$GPUS_PER_NODE") --node-rank \$SLURM_NODEID"
    task_cmd+=" $(quote_words --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
                  "$script" "${PY_ARGS[@]}")"
  else
    # One task per GPU; the torchrun environment comes from each task's SLURM_* variables.
    srun_args+=(--ntasks=$((NNODES * GPUS_PER_NODE)) --ntasks-per-node="$GPUS_PER_NODE")
    task_cmd="RANK=\$SLURM_PROCID LOCAL_RANK=\$SLURM_LOCALID WORLD_SIZE=\$SLURM_NTASKS"
    task_cmd+=" MASTER_ADDR=$(printf '%q' "$MASTER_ADDR") MASTER_PORT=$(printf '%q' "$MASTER_PORT")"
    task_cmd+=" exec $(quote_words "${NSYS_PREFIX[@]}" python "$script" "${PY_ARGS[@]}")"
  fi
  if [ -n "$CONTAINER_IMAGE" ]; then
    srun_args+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS"
                --container-workdir="$REPO_DIR")
  fi
  LAUNCH=(srun "${srun_args[@]}" bash -c "$task_cmd")
  LAUNCH_TEXT="$(quote_words srun "${srun_args[@]}") bash -c $(single_quote "$task_cmd")"
}

# Entry point: launch MODE [--dry-run] [training flags...]
launch() {
  local mode=$1
  shift
  DRY_RUN=${DRY_RUN:-0}
  if [ "${1:-}" = --dry-run ]; then
    DRY_RUN=1
    shift
  fi
  CLI_ARGS=("$@")
  set_defaults "$mode"
  build_launch "$mode"
  decide_te_patches "${PY_ARGS[@]}"
  if [ "$DRY_RUN" = 1 ]; then
    echo "# $RUN_NAME ($mode, $NNODES node(s) x $GPUS_PER_NODE GPU(s)): dry run, nothing is launched"
    echo "cd $(printf '%q' "$REPO_DIR")"
    launch_environment print
    echo "$LAUNCH_TEXT 2>&1 | tee -a $(printf '%q' "$LOG_FILE")"
    exit 0
  fi
  launch_environment
  if [ "$mode" = slurm ] && [ -z "${SLURM_JOB_ID:-}" ]; then
    die "SLURM_JOB_ID" "unset" "Submit with sbatch, or print the launch with --dry-run"
  fi
  mkdir -p "$LOG_DIR" "$SAVE_DIR"
  if [ "$NSYS" = 1 ]; then mkdir -p "$(dirname "$NSYS_OUTPUT")"; fi
  cd "$REPO_DIR"
  echo "+ $LAUNCH_TEXT" | tee -a "$LOG_FILE"
  "${LAUNCH[@]}" 2>&1 | tee -a "$LOG_FILE"
}
