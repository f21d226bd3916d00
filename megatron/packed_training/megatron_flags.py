"""Megatron-LM flags that training scripts carry, beyond the ones this fork's parser defines.

A Megatron launch script passes flags that ask for what this fork always does (megatron-core
models, no linear biases, fp32 gradient reduction, ...). They are accepted and change
nothing (`ALREADY`); the start-up log names them with the reason. Flags for features this
fork does not have are refused with the reason and what to do (`REFUSED`), never silently
ignored. Some Megatron flags are implemented where their features live: --train-samples and
the sample-based LR flags (argument_checks.check_training_length), --hybrid-attention-ratio
and --hybrid-mlp-ratio (argument_checks.check_hybrid), --manual-gc, --exit-duration-in-mins
and --exit-signal-handler (training.py), --cross-entropy-loss-fusion (config.py), the W&B and
TensorBoard flags (metrics.py), --no-save-optim and --no-save-rng (checkpointing.py), --split
(datasets/builder.py); --transformer-impl here (`resolve_transformer_impl`), as the attention
backend this fork picks its layer spec from.

A flag with values is accepted only with those that state this fork's behaviour
(``--ckpt-format torch_dist``, megatron-core's own hybrid stack for ``--spec``); any other is
refused, naming the accepted ones.
"""

import argparse
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union


@dataclass(frozen=True)
class MegatronFlag:
    """One Megatron flag and ``why`` it changes nothing here (`ALREADY`) or is refused, with
    what to do (`REFUSED`). ``nargs``: its values (None: a switch); ``values``: for an
    `ALREADY` flag with values, the ones accepted (each as typed, space-joined); "+" takes a
    list, as Megatron's list flags do (``--recompute-modules core_attn mlp``); ``models``:
    the scripts it is accepted in."""

    flag: str
    why: str
    nargs: Union[int, str, None] = None
    values: Tuple[str, ...] = ()
    models: Tuple[str, ...] = ("gpt", "hybrid")

    @property
    def dest(self) -> str:
        return "megatron_" + self.flag.lstrip("-").replace("-", "_")


# megatron-core's own hybrid stack spec (0.16 and 0.19 names), which this fork's is built on.
HYBRID_STACK_SPECS = ("megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec",
                      "megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec")

ALREADY = (
    MegatronFlag("--use-mcore-models", "this fork builds megatron-core models only"),
    MegatronFlag("--disable-bias-linear", "this fork's linear layers have no biases"),
    MegatronFlag("--group-query-attention", "--num-query-groups alone sets the key/value groups"),
    MegatronFlag("--no-create-attention-mask-in-dataloader",
                 "packed micro-batches carry document boundaries, never a mask"),
    MegatronFlag("--no-masked-softmax-fusion",
                 "attention runs in Transformer Engine, flash-attn or PyTorch's varlen kernel, "
                 "never in the masked-softmax fusion"),
    MegatronFlag("--no-bias-dropout-fusion", "the bias-dropout fusion is never used here"),
    MegatronFlag("--no-gradient-accumulation-fusion",
                 "weight gradients are added into main_grad by a separate kernel here"),
    MegatronFlag("--accumulate-allreduce-grads-in-fp32",
                 "gradients are always accumulated and reduced in fp32 here"),
    MegatronFlag("--use-checkpoint-opt_param-scheduler",
                 "--load always restores the learning-rate schedule from the checkpoint"),
    MegatronFlag("--no-async-tensor-model-parallel-allreduce",
                 "Megatron deprecated it; there is nothing to turn off"),
    MegatronFlag("--log-throughput",
                 "the log line always reports throughput, as tokens/s (not TFLOP/s)"),
    MegatronFlag("--ckpt-format", "checkpoints are megatron-core distributed checkpoints",
                 nargs=1, values=("torch_dist",)),
    MegatronFlag("--timing-log-level",
                 "this fork keeps no Megatron timers; the log line times each interval",
                 nargs=1, values=("0",)),
    MegatronFlag("--spec", "pretrain_mamba.py builds megatron-core's hybrid stack, packed",
                 nargs=2, values=HYBRID_STACK_SPECS, models=("hybrid",)),
    MegatronFlag("--attention-softmax-in-fp32",
                 "attention runs in Transformer Engine, flash-attn or PyTorch's varlen kernel, "
                 "which keep the softmax in fp32"),
    MegatronFlag("--no-persist-layer-norm", "apex's persistent LayerNorm is never used here"),
    MegatronFlag("--moe-token-drop-policy",
                 "tokens over an expert's capacity are dropped lowest routing probability "
                 "first, megatron-core's default", nargs=1, values=("probs",)),
    MegatronFlag("--cp-comm-type",
                 "context parallelism passes keys and values around the ring (Transformer "
                 "Engine's p2p exchange)", nargs=1, values=("p2p",)),
    MegatronFlag("--optimizer", "the optimizer is megatron-core's Adam, as Megatron's adam",
                 nargs=1, values=("adam",)),
    MegatronFlag("--empty-unused-memory-level",
                 "the allocator's cache is never emptied between steps here", nargs=1,
                 values=("0",)),
    MegatronFlag("--log-memory-to-tensorboard",
                 "TensorBoard gets the peak allocated memory (mem-max-allocated-bytes) at every "
                 "log line"),
    MegatronFlag("--dataloader-type",
                 "packed rows are read in order and resume at the consumed-samples count",
                 nargs=1, values=("single",)),
    MegatronFlag("--rerun-mode", "this fork has no rerun state machine", nargs=1,
                 values=("disabled",)),
    MegatronFlag("--num-distributed-optimizer-instances",
                 "one distributed optimizer spans the data-parallel group", nargs=1,
                 values=("1",)),
    MegatronFlag("--main-grads-dtype", "main gradients are fp32 here", nargs=1,
                 values=("fp32",)),
    MegatronFlag("--exp-avg-dtype", "Adam's moments are fp32 here", nargs=1, values=("fp32",)),
    MegatronFlag("--exp-avg-sq-dtype", "Adam's moments are fp32 here", nargs=1,
                 values=("fp32",)),
    MegatronFlag("--use-rotary-position-embeddings",
                 "GPT models use RoPE (--position-embedding-type rope, the default)",
                 models=("gpt",)),
    MegatronFlag("--no-position-embedding",
                 "there are no learned absolute position embeddings here (RoPE or none)"),
    MegatronFlag("--auto-detect-ckpt-format",
                 "--load reads megatron-core distributed checkpoints, the only format here"),
    MegatronFlag("--reset-position-ids", "positions restart at 0 in every packed document here"),
    MegatronFlag("--reset-attention-mask",
                 "attention never crosses the boundary of a packed document here"),
)

_NO_RECOMPUTE = "Activation recomputation is not supported here; drop it"
_HF_TOKENIZER = ("This fork tokenizes with --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
                 "DIR, or reads rows tokenized already")
_NO_CKPT_TUNING = "Checkpoint save and load tuning is not supported here; drop it"
_NOT_VERIFIED_IN_GRAPHS = "has not been verified under packed CUDA graphs here; drop it"
_NO_FP8 = "FP8 training is not supported here; drop it (training runs in bf16 or fp16)"
_NO_FSDP = ("FSDP is not supported here; use --use-distributed-optimizer to shard the "
            "optimizer state")
_UNEVEN_PP = ("Uneven pipeline stages are not supported here: every stage holds --num-layers "
              "/ --pipeline-model-parallel-size layers; drop it")

REFUSED = (
    MegatronFlag("--use-flash-attn",
                 "Megatron's older switch for flash attention; use --attention-backend flash "
                 "(flash-attn) or te (Transformer Engine, which picks its fastest kernel)"),
    MegatronFlag("--no-rope-fusion",
                 "RoPE here is a gather at packed positions or Transformer Engine's fused "
                 "kernel, the forms that need no host sync; drop it"),
    MegatronFlag("--moe-shared-expert-overlap",
                 f"Running shared experts on a side stream during the token exchange "
                 f"{_NOT_VERIFIED_IN_GRAPHS}"),
    MegatronFlag("--moe-router-fusion",
                 f"Transformer Engine's fused router {_NOT_VERIFIED_IN_GRAPHS}"),
    MegatronFlag("--moe-per-layer-logging",
                 "Per-layer MoE losses are not logged here; the log line has each loss summed "
                 "over the MoE layers. Drop it"),
    MegatronFlag("--moe-layer-recompute", _NO_RECOMPUTE),
    MegatronFlag("--moe-enable-deepep",
                 "DeepEP (the flex dispatcher) is not built here; use "
                 "--moe-token-dispatcher-type alltoall"),
    MegatronFlag("--moe-flex-dispatcher-backend",
                 "The flex dispatcher (DeepEP, HybridEP) is not built here; use "
                 "--moe-token-dispatcher-type alltoall", nargs=1),
    MegatronFlag("--mtp-num-layers",
                 "Multi-token prediction is not supported here; drop it", nargs=1),
    MegatronFlag("--fp8-format", _NO_FP8, nargs=1),
    MegatronFlag("--fp8-recipe", _NO_FP8, nargs=1),
    MegatronFlag("--log-timers-to-tensorboard",
                 "This fork keeps no Megatron timers; TensorBoard gets the iteration time. "
                 "Drop it"),
    MegatronFlag("--decoder-first-pipeline-num-layers", _UNEVEN_PP, nargs=1),
    MegatronFlag("--decoder-last-pipeline-num-layers", _UNEVEN_PP, nargs=1),
    MegatronFlag("--account-for-embedding-in-pipeline-split", _UNEVEN_PP),
    MegatronFlag("--account-for-loss-in-pipeline-split", _UNEVEN_PP),
    MegatronFlag("--enable-cuda-graph",
                 "Megatron's older switch; use --cuda-graph-impl local (or full_iteration, "
                 "docs/cuda-graphs.md)"),
    MegatronFlag("--external-cuda-graph",
                 "Megatron's older switch; use --cuda-graph-impl transformer_engine"),
    MegatronFlag("--async-save",
                 "Asynchronous checkpoint saving is not supported here; drop it"),
    MegatronFlag("--override-opt_param-scheduler",
                 "--load restores the learning-rate schedule from the checkpoint here; drop it "
                 "(or start from the weights alone with --finetune)"),
    MegatronFlag("--use-persistent-ckpt-worker", _NO_CKPT_TUNING),
    MegatronFlag("--ckpt-fully-parallel-load", _NO_CKPT_TUNING),
    MegatronFlag("--ckpt-assume-constant-structure", _NO_CKPT_TUNING),
    MegatronFlag("--dist-ckpt-strictness", _NO_CKPT_TUNING, nargs=1),
    MegatronFlag("--data-cache-path",
                 "This fork packs rows in memory from --data-path and keeps no index cache; "
                 "drop it", nargs=1),
    MegatronFlag("--tensorboard-log-interval",
                 "TensorBoard is written at every log line here (--log-interval); drop it",
                 nargs=1),
    MegatronFlag("--timing-log-option",
                 "This fork keeps no Megatron timers; drop it", nargs=1),
    MegatronFlag("--log-progress", "Not implemented here; drop it"),
    MegatronFlag("--log-straggler", "Not implemented here; drop it"),
    MegatronFlag("--check-weight-hash-across-dp-replicas-interval",
                 "Not implemented here; drop it", nargs=1),
    MegatronFlag("--use-precision-aware-optimizer",
                 "The optimizer keeps fp32 main weights, gradients and moments here; drop it"),
    MegatronFlag("--first-last-layers-bf16", _NO_FP8),
    MegatronFlag("--mtp-loss-scaling-factor",
                 "Multi-token prediction is not supported here; drop it", nargs=1),
    MegatronFlag("--moe-input-jitter-eps",
                 "Router input jitter is not supported here; drop it", nargs=1),
    MegatronFlag("--moe-use-legacy-grouped-gemm",
                 "Only Transformer Engine's grouped GEMM (--moe-grouped-gemm) is built here; "
                 "drop it"),
    MegatronFlag("--cache-mla-latents",
                 "It is an inference option and this fork trains; drop it"),
    MegatronFlag("--rope-scaling",
                 "Llama-3-style RoPE scaling is not supported here; drop it (MLA models take "
                 "yarn: --rope-type yarn)"),
    MegatronFlag("--rotary-seq-len-interpolation-factor",
                 "RoPE position interpolation is not supported here; drop it", nargs=1),
    MegatronFlag("--init-method-xavier-uniform",
                 "Weights are initialised from a normal law (--init-method-std) here; drop it"),
    MegatronFlag("--apply-residual-connection-post-layernorm",
                 "Layers are pre-norm here; drop it"),
    MegatronFlag("--fp32-residual-connection",
                 "The residual stream keeps the training dtype here; drop it"),
    MegatronFlag("--legacy-tokenizer", _HF_TOKENIZER),
    MegatronFlag("--padded-vocab-size",
                 "The vocabulary is padded by --make-vocab-size-divisible-by here; drop it",
                 nargs=1),
    MegatronFlag("--is-hybrid-model",
                 "Hybrid models are built by pretrain_mamba.py with --hybrid-override-pattern; "
                 "run that script"),
    MegatronFlag("--use-checkpoint-args",
                 "The model's shape comes from the command line here, not from the "
                 "checkpoint; drop it and pass the shape flags"),
    MegatronFlag("--overlap-grad-reduce",
                 "Overlapping the gradient reduction with the backward is not supported here: "
                 "gradients are reduced after the backward (inside the graph with "
                 "--cuda-graph-impl full_iteration); drop the flag"),
    MegatronFlag("--overlap-param-gather",
                 "Overlapping the parameter all-gather with the forward is not supported here; "
                 "drop the flag (--use-distributed-optimizer still shards the optimizer)"),
    MegatronFlag("--recompute-granularity",
                 "Activation recomputation is not supported here; drop it (lower "
                 "--micro-batch-size or raise parallelism to save memory)",
                 nargs=1),
    MegatronFlag("--recompute-method", _NO_RECOMPUTE, nargs=1),
    MegatronFlag("--recompute-num-layers", _NO_RECOMPUTE, nargs=1),
    MegatronFlag("--recompute-modules", _NO_RECOMPUTE, nargs="+"),
    MegatronFlag("--use-torch-fsdp2", _NO_FSDP),
    MegatronFlag("--vocab-file", _HF_TOKENIZER, nargs=1),
    MegatronFlag("--merge-file", _HF_TOKENIZER, nargs=1),
    MegatronFlag("--log-params-norm", "Not implemented here; drop it"),
    MegatronFlag("--apply-layernorm-1p",
                 "Zero-centred norm weights are not supported here; drop it"),
    MegatronFlag("--moe-permute-fusion",
                 "Transformer Engine's fused token permutation has not been verified under "
                 "packed CUDA graphs here; drop it"),
    MegatronFlag("--use-megatron-fsdp", _NO_FSDP),
    MegatronFlag("--data-parallel-sharding-strategy", _NO_FSDP, nargs=1),
    MegatronFlag("--eod-mask-loss",
                 "The loss mask comes from the data here (a row's loss_mask with --sft, every "
                 "real token without); drop it and give end-of-document tokens loss mask 0 in "
                 "the data"),
    MegatronFlag("--sft-tokenizer-prompt-format",
                 "Conversations are rendered with the tokenizer's own chat template here "
                 "(tools/preprocess_sft.py, --tokenizer-model); drop it", nargs=1),
    MegatronFlag("--no-mmap-bin-files",
                 "This fork reads JSONL rows (docs/data-format.md), not indexed .bin/.idx "
                 "files; drop it"),
    MegatronFlag("--ddp-bucket-size", f"Gradient bucket tuning {_NOT_VERIFIED_IN_GRAPHS}",
                 nargs=1),
    MegatronFlag("--ddp-average-in-collective",
                 f"Averaging inside the gradient collective {_NOT_VERIFIED_IN_GRAPHS}"),
    MegatronFlag("--grad-reduce-in-bf16",
                 f"Gradients are reduced in fp32 here; bf16 reduction {_NOT_VERIFIED_IN_GRAPHS}"),
    MegatronFlag("--train-data-path",
                 "Training data is one JSONL file here; give it with --data-path", nargs="+"),
    MegatronFlag("--test-data-path", "There is no test split here; drop it", nargs="+"),
    MegatronFlag("--heterogeneous-layers-config-path",
                 "Per-layer heterogeneous shapes are not supported here; drop it", nargs=1),
)


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """The group of `ALREADY` and `REFUSED` flags (values are checked by `check`)."""
    g = parser.add_argument_group(
        "megatron compatibility",
        "Megatron-LM flags of existing scripts: accepted where this fork already behaves so "
        "(no effect), refused with the reason otherwise (docs/flags.md).")
    for entry in ALREADY:
        accepted = " or ".join(entry.values)
        _add(g, entry, f"Accepted with {accepted} only, no effect: {entry.why}." if accepted
             else f"Accepted, no effect: {entry.why}.")
    for entry in REFUSED:
        _add(g, entry, f"Refused. {entry.why}.")
    g.add_argument("--transformer-impl", choices=sorted(TRANSFORMER_IMPL_BACKENDS), default=None,
                   help="Megatron's layer implementation, as an attention backend: "
                        "transformer_engine is --attention-backend te, local is torch or "
                        "flash (auto becomes torch).")


def _add(group, entry: MegatronFlag, text: str) -> None:
    if entry.nargs is None:
        group.add_argument(entry.flag, dest=entry.dest, action="store_true", help=text)
    else:
        group.add_argument(entry.flag, dest=entry.dest, default=None, nargs=entry.nargs,
                           help=text)


def _as_typed(value) -> Optional[str]:
    """A given flag's value as typed (a switch: "True"); None when not given."""
    if value is None or value is False:
        return None
    return "True" if value is True else " ".join(map(str, value))


# --transformer-impl: the --attention-backend values of each implementation (the first one
# replaces auto). This fork picks its layer spec from the attention backend.
TRANSFORMER_IMPL_BACKENDS = {"transformer_engine": ("te",), "local": ("torch", "flash")}


def resolve_transformer_impl(args: argparse.Namespace) -> None:
    """Set ``attention_backend`` from Megatron's --transformer-impl (auto takes the
    implementation's first backend); refuse a backend of the other implementation."""
    from megatron.packed_training.argument_checks import fail

    impl = getattr(args, "transformer_impl", None)
    if impl is None:
        return
    backends = TRANSFORMER_IMPL_BACKENDS[impl]
    if args.attention_backend == "auto":
        args.attention_backend = backends[0]
    elif args.attention_backend not in backends:
        fail("--transformer-impl", impl,
             f"It asks for the {' or '.join(backends)} attention backend, and "
             f"--attention-backend is {args.attention_backend}; drop one of the two flags")


def check(args: argparse.Namespace, model: str) -> List[str]:
    """Refuse what `REFUSED` names and an `ALREADY` flag with another value or in another
    script (ValueError, in the `argument_checks.fail` shape); return the given `ALREADY`
    flags, each with its reason, for the start-up log."""
    from megatron.packed_training.argument_checks import fail

    for entry in REFUSED:
        typed = _as_typed(getattr(args, entry.dest, None))
        if typed is not None:
            fail(entry.flag, typed, entry.why)
    given = []
    for entry in ALREADY:
        typed = _as_typed(getattr(args, entry.dest, None))
        if typed is None:
            continue
        if model not in entry.models:
            fail(entry.flag, typed, f"It is for {' and '.join(entry.models)} models; run "
                                    "pretrain_mamba.py, or drop the flag")
        if entry.values and typed not in entry.values:
            accepted = " or ".join(entry.values)
            fail(entry.flag, typed, f"This fork runs as {entry.flag} {accepted}: {entry.why}; "
                                    f"use that or drop the flag")
        given.append(f"{entry.flag} ({entry.why})")
    resolve_transformer_impl(args)
    return given
