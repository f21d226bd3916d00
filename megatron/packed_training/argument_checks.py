"""The rules behind ``arguments.validate_args``: one function per flag group.

Each function reads a parsed ``argparse.Namespace``, raises
``ValueError("<what> is wrong: <value>. <what to do>.")`` on the first bad value and fills the
derived values of its group in place. They run in the order ``validate_args`` calls them; a
later group may rely on values an earlier one derived (e.g. ``num_layers`` from the hybrid
pattern before the pipeline checks).
"""

import importlib.util
import signal
import warnings

from megatron.core.transformer.enums import CudaGraphModule

# Layer symbols of --hybrid-override-pattern that this fork builds ('E' needs --num-experts,
# '+' --multi-latent-attention).
HYBRID_SYMBOLS = {"M": "Mamba", "*": "attention", "-": "MLP", "E": "MoE",
                  "+": "multi-latent attention"}

FULL_ITERATION = ("It is a CUDA graph implementation, not a module: whole training "
                  "iterations as one graph are --cuda-graph-impl full_iteration; drop it here")

# --cuda-graph-impl values megatron-core has and this fork refuses, with the reason.
REFUSED_GRAPH_IMPLS: dict = {}

# Names of CudaGraphModule this fork rejects, with the reason.
UNSUPPORTED_MODULES = {
    "moe": "MoE layers are captured whole when --cuda-graph-modules is not given (with "
           "drop-and-pad), and in parts with moe_router / moe_preprocess (docs/moe.md); use "
           "one of those",
}

# Partial MoE graphs (megatron-core's names): the router part of each MoE layer is graphed,
# token dispatch and experts run eager (docs/moe.md).
PARTIAL_MOE_MODULES = ("moe_router", "moe_preprocess")

# --moe-token-dispatcher-type values megatron-core has and this fork refuses, with the reason.
REFUSED_DISPATCHERS = {
    "allgather": "The allgather dispatcher reads token counts back to the host (.cpu() / "
                 ".item()) in every MoE layer, on every path; use alltoall",
    "flex": "The flex dispatcher needs DeepEP or HybridEP, which this fork does not build, and "
            "DeepEP reads the token count back to the host in every MoE layer; use alltoall",
}

# Names of the deprecated CudaGraphScope that are no CudaGraphModule, with the reason.
SCOPE_ONLY_NAMES = {
    "full_iteration": FULL_ITERATION,
    "full_iteration_inference": "It is an inference graph scope and this fork trains only; "
                                "drop it",
}

SUPPORTED_MODULES = [name for name in CudaGraphModule.__members__
                     if name not in UNSUPPORTED_MODULES]

_INSTALL_HINT = {
    "transformer_engine": "install Transformer Engine (`pip install .[te]`)",
    "flash_attn": "install flash-attn (`pip install .[flash]`)",
    "wandb": "install wandb (`pip install .[wandb]`)",
}


def fail(what: str, value, todo: str):
    """Raise the one error shape every rule uses."""
    raise ValueError(f"{what} is wrong: {value}. {todo}.")


def is_importable(package: str) -> bool:
    """Whether ``package`` can be imported, without importing it (tests monkeypatch this)."""
    return importlib.util.find_spec(package) is not None


def _require_package(package: str, what: str, value):
    if not is_importable(package):
        fail(what, value, f"It needs {package}, which is not importable: "
                          f"{_INSTALL_HINT[package]}")


def _at_least(args, flag: str, minimum):
    """``flag``'s value (skipped when None) must be >= ``minimum``."""
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if value is not None and value < minimum:
        fail(flag, value, f"Use a value >= {minimum}")


def check_model_name(model: str):
    if model not in ("gpt", "hybrid"):
        fail("model", repr(model), "Use 'gpt' or 'hybrid'")


def check_hybrid(args, model: str):
    """--hybrid-override-pattern: only for hybrid, required there (or built from Megatron's
    --hybrid-attention-ratio / --hybrid-mlp-ratio); infers num_layers."""
    _pattern_from_ratios(args, model)
    pattern = args.hybrid_override_pattern
    if model == "gpt":
        if pattern is not None:
            fail("--hybrid-override-pattern", repr(pattern),
                 "It describes a hybrid Mamba model: run pretrain_mamba.py, or drop the flag")
        return
    if not pattern:
        fail("--hybrid-override-pattern", repr(pattern),
             "A hybrid model needs one character per layer, e.g. 'M-M*M-'")
    allowed = "".join(HYBRID_SYMBOLS)
    for char in pattern:
        if char not in HYBRID_SYMBOLS:
            fail("--hybrid-override-pattern", repr(pattern),
                 f"Character {char!r} is not a layer symbol; use only {allowed!r} "
                 "(M Mamba, * attention, - MLP, E MoE, + multi-latent attention)")
    if args.num_layers is None:
        args.num_layers = len(pattern)
    elif args.num_layers != len(pattern):
        fail("--num-layers", args.num_layers,
             f"--hybrid-override-pattern has {len(pattern)} layers; make them equal or drop "
             "--num-layers")


def _pattern_from_ratios(args, model: str):
    """Megatron's ratio flags: the pattern megatron-core's pattern_from_ratios lays out."""
    attention = getattr(args, "hybrid_attention_ratio", 0.0) or 0.0
    mlp = getattr(args, "hybrid_mlp_ratio", 0.0) or 0.0
    if attention == 0.0 and mlp == 0.0:
        return
    if model != "hybrid":
        fail("--hybrid-attention-ratio" if attention else "--hybrid-mlp-ratio",
             attention or mlp, "It lays out a hybrid Mamba model: run pretrain_mamba.py, or "
                               "drop the flag")
    for flag, ratio in (("--hybrid-attention-ratio", attention), ("--hybrid-mlp-ratio", mlp)):
        if not 0.0 <= ratio <= 1.0:
            fail(flag, ratio, "A fraction of --num-layers: use a value from 0 to 1")
    if attention + mlp > 1.0:
        fail("--hybrid-mlp-ratio", mlp,
             f"With --hybrid-attention-ratio {attention} the two exceed all layers; make "
             "their sum at most 1")
    if args.hybrid_override_pattern is not None:
        fail("--hybrid-attention-ratio", attention,
             "--hybrid-override-pattern already lays out the layers; give one or the other")
    if args.num_layers is None:
        fail("--hybrid-attention-ratio", attention,
             "The ratios are fractions of --num-layers; add --num-layers")
    from megatron.core.models.hybrid.hybrid_layer_allocation import pattern_from_ratios

    args.hybrid_override_pattern = pattern_from_ratios(args.num_layers, attention, mlp)


def check_model(args, model: str):
    """Sizes; fills ffn_hidden_size, num_query_groups, kv_channels, max_position_embeddings."""
    if args.num_layers is None:
        fail("--num-layers", None, "A gpt model needs --num-layers")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--vocab-size", "--make-vocab-size-divisible-by", "--ffn-hidden-size",
                 "--num-query-groups", "--kv-channels", "--max-position-embeddings"):
        _at_least(args, flag, 1)
    heads = args.num_attention_heads
    if args.hidden_size % heads:
        fail("--hidden-size", args.hidden_size,
             f"It must be divisible by --num-attention-heads ({heads})")
    if args.num_query_groups is None:
        args.num_query_groups = heads
    if heads % args.num_query_groups:
        fail("--num-query-groups", args.num_query_groups,
             f"It must divide --num-attention-heads ({heads})")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        fail("--seq-length", args.seq_length,
             f"It exceeds --max-position-embeddings ({args.max_position_embeddings}); raise "
             "that or shorten the sequence")
    if not 0.0 < args.rotary_percent <= 1.0:
        fail("--rotary-percent", args.rotary_percent, "Use a value in (0, 1]")
    if args.squared_relu and args.swiglu:
        fail("--squared-relu", "with --swiglu", "An MLP has one activation: drop one of them")
    _check_cross_entropy_fusion(args)
    if model == "hybrid":
        _check_mamba(args)


def _check_cross_entropy_fusion(args):
    """--cross-entropy-fusion-impl picks the fused kernels, so it needs the fusion on."""
    impl = args.cross_entropy_fusion_impl
    if impl is not None and not args.cross_entropy_loss_fusion:
        fail("--cross-entropy-fusion-impl", impl,
             "It picks the fused cross entropy's kernels: add --cross-entropy-loss-fusion, or "
             "drop it")
    if args.cross_entropy_loss_fusion and impl is None:
        args.cross_entropy_fusion_impl = "native"  # Megatron's default
    if impl == "te":
        _require_package("transformer_engine", "--cross-entropy-fusion-impl", impl)


def _check_mamba(args):
    """The divisibility MambaMixer asserts (expand = 2), reported before the model is built."""
    for flag in ("--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups",
                 "--mamba-num-heads"):
        _at_least(args, flag, 1)
    inner = 2 * args.hidden_size
    if args.mamba_num_heads is None and inner % args.mamba_head_dim:
        fail("--mamba-head-dim", args.mamba_head_dim,
             f"It must divide the Mamba inner width 2 * hidden size = {inner}, or set "
             "--mamba-num-heads")
    heads = _mamba_heads(args)
    if heads % args.mamba_num_groups:
        fail("--mamba-num-groups", args.mamba_num_groups,
             f"It must divide the Mamba head count ({heads})")


def _mamba_heads(args) -> int:
    """--mamba-num-heads, or MambaMixer's default: inner width 2 * hidden over the head dim."""
    return args.mamba_num_heads or 2 * args.hidden_size // args.mamba_head_dim


def _require_te_attention(args, flag: str, value):
    """CP attention on packed (THD) data runs in Transformer Engine."""
    _require_package("transformer_engine", flag, value)
    if args.attention_backend not in ("te", "auto"):
        fail(flag, value, f"Packed context parallelism runs only on Transformer Engine "
                          f"attention, not --attention-backend {args.attention_backend}; use te "
                          f"or auto")


def _check_mamba_cp(args, flag: str, cp: int):
    """What megatron-core's MambaContextParallel asserts: every CP rank gets whole heads,
    and the B/C groups split over (or repeat across) the CP ranks evenly."""
    tp = args.tensor_model_parallel_size
    heads, groups = _mamba_heads(args) // tp, args.mamba_num_groups // tp
    if heads % cp:
        fail(flag, cp, f"Mamba context parallelism splits each TP rank's {heads} heads over the "
                       f"CP ranks; use a CP size that divides {heads}")
    if (cp % groups) if groups < cp else (groups % cp):
        fail(flag, cp, f"Mamba context parallelism needs the CP size and each TP rank's "
                       f"{groups} groups (--mamba-num-groups / TP) to divide one another")


def check_parallelism(args, model: str, world_size: int):
    """TP/PP/VPP/CP/SP; fills data_parallel_size and virtual_pipeline_model_parallel_size."""
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size", "--virtual-pipeline-model-parallel-size",
                 "--num-layers-per-virtual-pipeline-stage"):
        _at_least(args, flag, 1)
    tp = args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    if world_size < 1 or world_size % (tp * pp * cp):
        fail("world size", world_size,
             f"It must be a multiple of tensor x pipeline x context parallel sizes "
             f"({tp} x {pp} x {cp} = {tp * pp * cp}); change the sizes or the number of ranks")
    args.data_parallel_size = world_size // (tp * pp * cp)
    if args.num_attention_heads % tp:
        fail("--num-attention-heads", args.num_attention_heads,
             f"It must be divisible by --tensor-model-parallel-size ({tp})")
    if args.num_query_groups % tp:
        fail("--num-query-groups", args.num_query_groups,
             f"It must be divisible by --tensor-model-parallel-size ({tp})")
    if model == "hybrid" and args.mamba_num_groups % tp:
        fail("--mamba-num-groups", args.mamba_num_groups,
             f"It must be divisible by --tensor-model-parallel-size ({tp})")
    if args.num_layers % pp:
        what = "--num-layers" if model == "gpt" else "--hybrid-override-pattern length"
        fail(what, args.num_layers,
             f"It must be divisible by --pipeline-model-parallel-size ({pp})")
    _check_virtual_pipeline(args, model)
    if args.sequence_parallel:
        if tp == 1:
            fail("--sequence-parallel", True,
                 "It needs --tensor-model-parallel-size > 1; drop it or raise TP")
        _require_package("transformer_engine", "--sequence-parallel", True)
        if (args.seq_length // cp) % tp:
            fail("--seq-length", args.seq_length,
                 f"With --sequence-parallel each rank's {args.seq_length // cp} tokens must "
                 f"split evenly over {tp} TP ranks")
    if cp > 1:
        if model == "hybrid":
            _check_mamba_cp(args, "--context-parallel-size", cp)
        _require_te_attention(args, "--context-parallel-size", cp)
        if args.seq_length % (2 * cp):
            fail("--seq-length", args.seq_length,
                 f"With --context-parallel-size {cp} it must be a multiple of 2 * cp = "
                 f"{2 * cp}")


def _check_virtual_pipeline(args, model: str):
    vpp = args.virtual_pipeline_model_parallel_size
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if vpp is None and per_stage is None:
        return
    flag = ("--virtual-pipeline-model-parallel-size" if vpp is not None
            else "--num-layers-per-virtual-pipeline-stage")
    if vpp is not None and per_stage is not None:
        fail(flag, vpp, "It and --num-layers-per-virtual-pipeline-stage are mutually "
                        "exclusive; give one")
    if model == "hybrid":
        fail(flag, vpp if vpp is not None else per_stage,
             "hybrid models split into interleaved stages only with '|' stage marks in the "
             "pattern, which this fork does not build yet; drop it")
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        fail(flag, vpp if vpp is not None else per_stage,
             "Interleaving needs --pipeline-model-parallel-size > 1")
    if per_stage is not None:
        layers_per_rank = args.num_layers // pp
        if layers_per_rank % per_stage:
            fail(flag, per_stage, f"It must divide the {layers_per_rank} layers of each "
                                  "pipeline rank")
        vpp = args.virtual_pipeline_model_parallel_size = layers_per_rank // per_stage
    if vpp < 2:
        fail(flag, vpp if per_stage is None else per_stage,
             f"It gives {vpp} model chunk per pipeline rank; interleaving needs at least 2, "
             "or drop the flag")
    if args.num_layers % (pp * vpp):
        fail("--num-layers", args.num_layers,
             f"It must be divisible by pipeline x virtual pipeline size ({pp} x {vpp})")


def check_training(args):
    """Precision and batch sizes; fills global_batch_size and num_microbatches."""
    if args.fp16:
        if args.bf16:
            fail("--fp16", True, "--bf16 and --fp16 are mutually exclusive; use --bf16")
        fail("--fp16", True, "This fork trains in bf16 or fp32 only; use --bf16")
    _at_least(args, "--micro-batch-size", 1)
    _at_least(args, "--global-batch-size", 1)
    _at_least(args, "--train-iters", 1)
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        fail("--global-batch-size", args.global_batch_size,
             f"It must be a multiple of micro batch x data parallel size "
             f"({args.micro_batch_size} x {args.data_parallel_size} = {per_step})")
    args.num_microbatches = args.global_batch_size // per_step
    if args.rampup_batch_size is not None:
        _check_rampup(args, per_step)
    _at_least(args, "--manual-gc-interval", 0)
    if args.manual_gc_interval and not args.manual_gc:
        fail("--manual-gc-interval", args.manual_gc_interval,
             "It sets how often --manual-gc collects; add --manual-gc or drop it")


def check_training_length(args):
    """--train-iters, or Megatron's --train-samples with --lr-warmup-samples and
    --lr-decay-samples, turned into iterations (``samples // global batch``, as Megatron
    does without a batch-size ramp-up). Runs after check_training (global_batch_size)."""
    samples = {flag: getattr(args, flag[2:].replace("-", "_"), None)
               for flag in ("--train-samples", "--lr-warmup-samples", "--lr-decay-samples")}
    if samples["--train-samples"] is None:
        if args.train_iters is None:
            fail("--train-iters", None, "Give the training length: --train-iters N, or "
                                        "--train-samples N")
        for flag in ("--lr-warmup-samples", "--lr-decay-samples"):
            if samples[flag] is not None:
                fail(flag, samples[flag], "Sample-based schedules go with --train-samples; "
                                          "with --train-iters use the -iters flag")
        return
    if args.train_iters is not None:
        fail("--train-samples", samples["--train-samples"],
             f"--train-iters ({args.train_iters}) gives the length already; give one of them")
    if args.rampup_batch_size is not None:
        fail("--train-samples", samples["--train-samples"],
             "With --rampup-batch-size the iterations per sample change along the run; give "
             "--train-iters")
    gbs = args.global_batch_size
    for flag, twin, default in (("--lr-warmup-samples", "lr_warmup_iters", 0),
                                ("--lr-decay-samples", "lr_decay_iters", None)):
        if samples[flag] is not None and getattr(args, twin) != default:
            fail(flag, samples[flag], f"--{twin.replace('_', '-')} is given too; give one")
    _at_least(args, "--train-samples", gbs)
    _at_least(args, "--lr-warmup-samples", 0)
    _at_least(args, "--lr-decay-samples", gbs)
    args.train_iters = samples["--train-samples"] // gbs
    if samples["--lr-warmup-samples"] is not None:
        args.lr_warmup_iters = samples["--lr-warmup-samples"] // gbs
    if samples["--lr-decay-samples"] is not None:
        args.lr_decay_iters = samples["--lr-decay-samples"] // gbs


def check_optimizer_graph(args):
    """--optimizer-cuda-graph: refuse what megatron-core's optimizer step reads on the host
    (docs/cuda-graphs.md, "Optimizer graph"). Runs before check_training, so that --fp16 gets
    this reason."""
    if not getattr(args, "optimizer_cuda_graph", False):
        return
    graph = "Not with --optimizer-cuda-graph:"
    if args.fp16:
        fail("--fp16", True, f"{graph} fp16 needs a loss scaler, whose found-inf flag the "
                             "optimizer step reads on the host to skip an update; use --bf16")
    if args.log_num_zeros_in_grad:
        fail("--log-num-zeros-in-grad", True,
             f"{graph} the optimizer step reads the count of zero gradients on the host; drop "
             "one of the two flags")
    if getattr(args, "num_experts", None) is not None:
        fail("--num-experts", args.num_experts,
             f"{graph} megatron-core steps the expert parameters with a second optimizer and "
             "merges the two on the host (their gradient norms without "
             "--use-distributed-optimizer, their step counts at every checkpoint); drop "
             "--optimizer-cuda-graph for MoE models")


def _as_typed(values) -> str:
    """A list-valued flag as the user typed it (``16 64 256``), for error messages."""
    return " ".join(map(str, values))


def _check_rampup(args, per_step):
    start, increment, samples = args.rampup_batch_size
    shown, gbs = _as_typed(args.rampup_batch_size), args.global_batch_size
    if min(start, increment, samples) < 1:
        fail("--rampup-batch-size", shown,
             "Give three positive integers: start batch, increment, ramp-up samples")
    if start >= gbs or (gbs - start) % increment:
        fail("--rampup-batch-size", shown,
             f"START must be below --global-batch-size ({gbs}) and reach it in whole "
             "INCREMENT steps")
    if start % per_step or increment % per_step:
        fail("--rampup-batch-size", shown,
             f"START and INCREMENT must be multiples of micro batch x data parallel size "
             f"({per_step}), so every step is whole micro-batches")
    pp = args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size and ((start // per_step) % pp
                                                      or (increment // per_step) % pp):
        fail("--rampup-batch-size", shown,
             f"The interleaved schedule needs micro-batch counts that are multiples of the "
             f"pipeline size ({pp}); make START and INCREMENT multiples of {per_step * pp}")


def check_learning_rate(args):
    """Schedule lengths and bounds; fills lr_decay_iters."""
    _at_least(args, "--lr-warmup-iters", 0)
    _at_least(args, "--lr-decay-iters", 1)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters > args.lr_decay_iters:
        fail("--lr-warmup-iters", args.lr_warmup_iters,
             f"It must not exceed --lr-decay-iters ({args.lr_decay_iters})")
    if args.lr < args.min_lr:
        fail("--lr", args.lr, f"It must be >= --min-lr ({args.min_lr})")
    fraction = args.lr_warmup_fraction
    if fraction is not None:
        if not 0.0 <= fraction <= 1.0:
            fail("--lr-warmup-fraction", fraction, "Use a fraction of the decay length in [0, 1]")
        if args.lr_warmup_iters:
            fail("--lr-warmup-fraction", fraction,
                 "It sets the warm-up length, and so does --lr-warmup-iters (or "
                 "--lr-warmup-samples); give one of them")
    if not 0.0 <= args.lr_warmup_init <= args.lr:
        fail("--lr-warmup-init", args.lr_warmup_init, f"Use a rate in [0, --lr ({args.lr})]")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None:
        fail("--lr-wsd-decay-iters", None, "--lr-decay-style WSD needs it")


def check_checkpointing(args):
    _at_least(args, "--save-interval", 1)
    if args.save_interval is not None and args.save is None:
        fail("--save-interval", args.save_interval, "It needs --save <dir>")
    for flag in ("--no-save-optim", "--no-save-rng"):
        if _value(args, flag) and args.save is None:
            fail(flag, True, "It shapes the checkpoints of --save <dir>: add --save, or drop it")


# Signals a process cannot catch, so no handler could see them.
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def _check_exit_signal(args):
    """--exit-signal names a signal this process can catch, and only with the handler on;
    it is stored by its full name (``SIGUSR1``), SIGTERM by default."""
    if args.exit_signal is None:
        args.exit_signal = "SIGTERM" if args.exit_signal_handler else None
        return
    if not args.exit_signal_handler:
        fail("--exit-signal", args.exit_signal, "It has no effect without "
                                                "--exit-signal-handler; add that flag or drop it")
    name = args.exit_signal.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    if name not in signal.Signals.__members__ or name in _UNCATCHABLE:
        fail("--exit-signal", args.exit_signal, "Name a signal this process can catch, e.g. "
                                                "SIGTERM, SIGUSR1 or SIGUSR2")
    args.exit_signal = name


def _check_wandb(args):
    """W&B flags as Megatron reads them: an empty --wandb-project (the default) is off, and a
    project needs a run name. A name or directory without a project would be ignored: refused."""
    if not args.wandb_project:
        for flag in ("--wandb-exp-name", "--wandb-save-dir"):
            if _value(args, flag):
                fail(flag, _value(args, flag), "It applies to W&B logging, which is off without "
                                               "--wandb-project: add the project, or drop it")
        return
    if not args.wandb_exp_name:
        fail("--wandb-project", args.wandb_project,
             "A W&B run needs a name: add --wandb-exp-name NAME")
    _require_package("wandb", "--wandb-project", args.wandb_project)


def check_logging(args):
    _at_least(args, "--log-interval", 1)
    _at_least(args, "--eval-interval", 0)
    if args.exit_interval is not None:
        _at_least(args, "--exit-interval", 1)
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        fail("--exit-duration-in-mins", args.exit_duration_in_mins, "Use a positive number of "
                                                                    "minutes")
    _check_exit_signal(args)
    _check_wandb(args)
    if args.tensorboard_queue_size is not None:
        _at_least(args, "--tensorboard-queue-size", 1)
        if not args.tensorboard_dir:
            fail("--tensorboard-queue-size", args.tensorboard_queue_size,
                 "It sizes the TensorBoard writer's queue: add --tensorboard-dir, or drop it")
    if args.profile:
        _at_least(args, "--profile-step-start", 1)
        if args.profile_step_end <= args.profile_step_start:
            fail("--profile-step-end", args.profile_step_end,
                 f"It must exceed --profile-step-start ({args.profile_step_start})")
    elif args.profile_trace_dir is not None:
        fail("--profile-trace-dir", args.profile_trace_dir, "It needs --profile")
    if args.eval_interval > 0 and args.eval_iters < 1:
        fail("--eval-iters", args.eval_iters,
             "Evaluation (--eval-interval > 0) needs at least 1; or set --eval-interval 0")


DEFAULT_VOCAB_SIZE = 32000
"""--vocab-size without a tokenizer."""


def check_tokenizer(args):
    """--tokenizer-type / --tokenizer-model and chat data files; fills vocab_size: the
    tokenizer's size (as Megatron-LM: padded_vocab_size rounds it up), else 32000."""
    from megatron.packed_training.datasets.chat import chat_line
    from megatron.packed_training.tokenizer import TOKENIZER_TYPES, load_tokenizer

    kind, path = getattr(args, "tokenizer_type", None), getattr(args, "tokenizer_model", None)
    if kind is None and path is not None:
        fail("--tokenizer-model", path, f"It needs --tokenizer-type {TOKENIZER_TYPES[0]}")
    if kind is not None:
        if kind not in TOKENIZER_TYPES:
            fail("--tokenizer-type", kind,
                 f"This fork builds {', '.join(TOKENIZER_TYPES)} only (a local tokenizer folder "
                 "or tokenizer.json); for another tokenizer pre-tokenize the data and pass "
                 "--vocab-size")
        if path is None:
            fail("--tokenizer-type", kind,
                 "It needs --tokenizer-model <local tokenizer folder or tokenizer.json>")
        size = load_tokenizer(kind, path).vocab_size  # missing or unloadable path: ValueError
        if args.vocab_size is not None and args.vocab_size != size:
            fail("--vocab-size", args.vocab_size,
                 f"--tokenizer-model {path} has {size} tokens and sets the vocabulary size "
                 f"(padded by --make-vocab-size-divisible-by as usual); drop --vocab-size or "
                 f"set it to {size}")
        args.vocab_size = size
    elif args.vocab_size is None:
        args.vocab_size = DEFAULT_VOCAB_SIZE
    for flag in ("--data-path", "--valid-data-path"):
        data = getattr(args, flag[2:].replace("-", "_"), None)
        line = chat_line(data) if data else None
        if line is None:
            continue
        if kind is None:
            fail(flag, data, f"Line {line} is a chat conversation (\"messages\"); add "
                             f"--tokenizer-type {TOKENIZER_TYPES[0]} --tokenizer-model <tokenizer "
                             "folder> to render it, or pre-tokenize the file with "
                             "tools/preprocess_sft.py")
        if not args.sft:
            fail(flag, data, "It holds chat conversations, whose loss is on assistant tokens "
                             "only; add --sft")


def check_data(args):
    if (args.data_path is None) == (not args.mock_data):
        given = "both" if args.mock_data else "neither"
        fail("--data-path / --mock-data", f"{given} given",
             "Give exactly one: --data-path <file.jsonl> or --mock-data")
    _at_least(args, "--mock-doc-length-median", 1)
    _at_least(args, "--mock-doc-length-sigma", 0)
    _at_least(args, "--num-workers", 0)
    _check_long_documents(args)
    _check_split(args)


def _check_split(args):
    """--split shares one --data-path between training and validation (datasets/builder.py);
    Megatron's mock-data scripts carry it too, where it changes nothing."""
    if args.split is None:
        return
    from megatron.packed_training.datasets.builder import split_shares

    try:
        shares, problem = split_shares(args.split), None
    except ValueError as error:
        shares, problem = None, str(error)
    if shares is None:
        fail("--split", args.split, problem)
    if args.mock_data:
        args.megatron_flags_without_effect.append(
            "--split (with --mock-data, validation rows are drawn from their own seed)")
        return
    if args.valid_data_path:
        fail("--split", args.split, f"Validation documents come from --valid-data-path "
                                    f"{args.valid_data_path} or from a --split of --data-path, "
                                    "not both: drop one")
    if shares[0] == 0:
        fail("--split", args.split, "The training share is 0: give it a positive share")


def _check_long_documents(args):
    """--long-document-policy (default split; --reject-long-documents is the older spelling
    of reject): fills it. --max-truncated-token-fraction: in [0, 1], given only with truncate,
    the one policy that drops tokens (None stands for 0.05,
    packing.DEFAULT_MAX_TRUNCATED_TOKEN_FRACTION)."""
    policy = getattr(args, "long_document_policy", None)
    if getattr(args, "reject_long_documents", False):
        if policy not in (None, "reject"):
            fail("--reject-long-documents", True,
                 f"It is the older spelling of --long-document-policy reject and contradicts "
                 f"--long-document-policy {policy}; give only one")
        policy = "reject"
    args.long_document_policy = policy or "split"
    fraction = getattr(args, "max_truncated_token_fraction", None)
    if fraction is None:  # left None (so validating twice passes): the packer's default applies
        return
    if not 0.0 <= fraction <= 1.0:  # NaN fails too
        fail("--max-truncated-token-fraction", fraction,
             "Use a fraction in [0, 1], e.g. 0.05 (stop when truncation drops over 5% of the "
             "tokens)")
    if args.long_document_policy != "truncate":
        fail("--max-truncated-token-fraction", fraction,
             f"It limits what truncation drops, and --long-document-policy "
             f"{args.long_document_policy} drops nothing; drop the flag or add "
             f"--long-document-policy truncate")


def check_attention(args):
    if getattr(args, "te_rng_tracker", False):
        _require_package("transformer_engine", "--te-rng-tracker", True)
    if args.attention_backend == "te":
        _require_package("transformer_engine", "--attention-backend", "te")
    elif args.attention_backend == "flash":
        _require_package("flash_attn", "--attention-backend", "flash")


def cuda_graph_modules_given(modules, scope, flag="--cuda-graph-modules",
                             alias="--cuda-graph-scope"):
    """(values, spelling) of ``flag`` or of its deprecated ``alias``, which warns once."""
    if scope is None:
        return modules, flag
    if modules is not None:
        fail(f"{flag} / {alias}", "both given",
             f"{alias} is the deprecated spelling of {flag}; give only {flag}")
    warnings.warn(f"{alias} is deprecated; use {flag} (same names) instead.", FutureWarning,
                  stacklevel=3)
    return scope, alias


def normalise_cuda_graph_modules(values, flag="--cuda-graph-modules") -> list[str]:
    """``["attn,mlp"]`` or ``["attn", "mlp"]`` -> ``["attn", "mlp"]``; checks every name."""
    names = []
    for value in values:
        for name in (part.strip() for part in value.split(",")):
            if not name:
                continue
            if name in SCOPE_ONLY_NAMES:
                fail(flag, repr(name), SCOPE_ONLY_NAMES[name])
            if name not in CudaGraphModule.__members__:
                fail(flag, repr(name),
                     f"Valid CudaGraphModule names are {', '.join(CudaGraphModule.__members__)} "
                     f"(this fork supports {', '.join(SUPPORTED_MODULES)}); omit the flag to "
                     "capture whole layers")
            if name in UNSUPPORTED_MODULES:
                fail(flag, repr(name), UNSUPPORTED_MODULES[name])
            if name not in names:
                names.append(name)
    return names


def _check_capacity_ladder(args, ladder, impl, capacity):
    shown = _as_typed(ladder)
    if impl == "none":
        fail("--cuda-graph-capacity-ladder", shown,
             "It would be silently ignored without graphs; add --cuda-graph-impl local")
    if any(n < 1 for n in ladder) or any(a >= b for a, b in zip(ladder, ladder[1:])):
        fail("--cuda-graph-capacity-ladder", shown,
             "Give positive capacities in strictly ascending order, e.g. 16 64 256")
    if ladder[-1] >= capacity:
        fail("--cuda-graph-capacity-ladder", shown,
             f"Every rung must be below --cuda-graph-max-packed-seqs ({capacity}), which is "
             "the top rung already")
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:  # the library API checks it later
        fail("--cuda-graph-capacity-ladder", shown,
             "With pipeline parallelism megatron-core replays graph runners by turn, not by "
             "shape, so one micro-batch cannot pick its capacity; drop the ladder or use "
             "--pipeline-model-parallel-size 1")


def partial_moe_modules(args) -> list[str]:
    """The partial MoE graph modules (moe_router, moe_preprocess) in args.cuda_graph_modules."""
    return [name for name in args.cuda_graph_modules if name in PARTIAL_MOE_MODULES]


def _check_partial_moe_modules(args, flag):
    """moe_router / moe_preprocess as megatron-core pairs them: the local implementation
    captures both whenever either is named (TransformerConfig does the same), and
    transformer_engine's preprocess graph extends the router graph."""
    partial = partial_moe_modules(args)
    if not partial:
        return
    if args.cuda_graph_impl == "local":
        args.cuda_graph_modules += [name for name in PARTIAL_MOE_MODULES if name not in partial]
    elif args.cuda_graph_impl == "transformer_engine" and "moe_router" not in partial:
        fail(flag, "moe_preprocess",
             "megatron-core captures the dispatcher's preprocess in the router's graph; add "
             "moe_router")


def _check_te_graphs(args, flag):
    """What --cuda-graph-impl transformer_engine builds: whole-layer graphs, PP = 1."""
    impl = "--cuda-graph-impl transformer_engine"
    # TE's graphs register TE's RNG states and assert TE's tracker (megatron-core forces
    # --te-rng-tracker with graphs too).
    args.te_rng_tracker = True
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:
        fail("--pipeline-model-parallel-size", args.pipeline_model_parallel_size,
             f"{impl} captures packed layers for PP = 1 only; with pipeline parallelism use "
             "--cuda-graph-impl local (layer or chunk granularity)")
    if args.cuda_graph_modules:
        _check_te_partial_moe_graphs(args, flag, impl)
    if args.cuda_graph_capacity_ladder:
        fail("--cuda-graph-capacity-ladder", _as_typed(args.cuda_graph_capacity_ladder),
             f"{impl} captures one capacity; drop the ladder or use --cuda-graph-impl local")
    for flag in ("--hidden-dropout", "--attention-dropout"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value:
            fail(flag, value, f"dropout inside {impl} graphs is not verified in this fork; "
                              "set it to 0 or use --cuda-graph-impl local")


def _check_te_partial_moe_graphs(args, flag, impl):
    """TE graphs take modules only for partial MoE graphs: moe_router [moe_preprocess], with
    attn and mamba to graph those layers (parts) too."""
    modules = args.cuda_graph_modules
    others = [name for name in modules if name not in (*PARTIAL_MOE_MODULES, "attn", "mamba")]
    if not partial_moe_modules(args) or others:
        fail(flag, " ".join(modules),
             f"{impl} captures whole layers on packed data, or with moe_router the router part "
             f"of MoE layers (attn and mamba may come along); drop {flag} or use moe_router")
    if "moe_preprocess" in modules and getattr(args, "dynamic_cp_sizes", None):
        fail(flag, " ".join(modules),
             "Under dynamic CP each graph bank holds another token count, and the eager part "
             "of an MoE layer reads shapes its preprocess graph set at capture (the last "
             "bank's); drop moe_preprocess or --dynamic-cp-sizes")


def _check_full_iteration(args, flag):
    """What --cuda-graph-impl full_iteration builds: one graph per training iteration (PP = 1),
    local layer or chunk graphs (--cuda-graph-granularity) for the iterations it misses."""
    impl = "--cuda-graph-impl full_iteration"
    if args.cuda_graph_modules:
        fail(flag, " ".join(args.cuda_graph_modules),
             f"{impl} captures whole iterations, and whole layers or chunks for the iterations "
             f"it misses; drop {flag}")
    if args.cuda_graph_capacity_ladder:
        fail("--cuda-graph-capacity-ladder", _as_typed(args.cuda_graph_capacity_ladder),
             f"{impl} captures one capacity, --cuda-graph-max-packed-seqs; drop the ladder or "
             "use --cuda-graph-impl local")
    if args.cuda_graph_warmup_steps < 1:
        fail("--cuda-graph-warmup-steps", args.cuda_graph_warmup_steps,
             f"{impl} needs an eager iteration before its capture: NCCL communicators, cuBLAS "
             "workspaces and kernel autotuning are set up on first use, which no capture "
             "allows; use 1 or more")
    pp = getattr(args, "pipeline_model_parallel_size", 1)  # the library API checks it later
    if pp > 1:
        fail("--pipeline-model-parallel-size", pp,
             f"{impl} is for PP = 1: megatron-core 0.19.2's batched pipeline send/receive calls "
             "torch.cuda.synchronize() after every exchange (p2p_communication.py, "
             "batch_p2p_sync), which no capture allows; use --cuda-graph-impl local (layer or "
             "chunk graphs) with pipeline parallelism")
    if getattr(args, "context_parallel_size", 1) > 1 or getattr(args, "dynamic_cp_sizes", None):
        fail("--context-parallel-size", getattr(args, "context_parallel_size", 1),
             f"context parallelism inside {impl} graphs is not verified in this fork (dynamic CP "
             "picks a CP group per micro-batch, which one graph per iteration cannot); use "
             "--cuda-graph-impl local or transformer_engine")
    if getattr(args, "num_experts", None) is not None:
        fail("--num-experts", args.num_experts,
             f"MoE inside {impl} graphs is not supported: the aux-loss scale and the capacity "
             "overflow rerun keep host state per micro-batch; use --cuda-graph-impl local")
    if getattr(args, "check_for_nan_in_loss_and_grad", False):
        fail("--no-check-for-nan-in-loss-and-grad", "not given",
             "DDP's NaN check (on by default) reads every gradient bucket's norm on the host, "
             f"which {impl} cannot capture; add --no-check-for-nan-in-loss-and-grad")
    if getattr(args, "cuda_graph_check_interval", 0):
        fail("--cuda-graph-check-interval", args.cuda_graph_check_interval,
             f"The health check replays one micro-batch's graph and {impl} has one graph per "
             "iteration; drop the flag or use --cuda-graph-impl local")


def check_cuda_graphs(args):
    """Graph flags; fills cuda_graph_modules as a list of CudaGraphModule names ([] = whole
    layer) and drops the deprecated cuda_graph_scope."""
    impl = args.cuda_graph_impl
    if impl in REFUSED_GRAPH_IMPLS:
        fail("--cuda-graph-impl", impl, REFUSED_GRAPH_IMPLS[impl])
    capacity = args.cuda_graph_max_packed_seqs
    if capacity < 0:
        fail("--cuda-graph-max-packed-seqs", capacity,
             "Use 0 (graphs off) or a positive document capacity")
    _at_least(args, "--cuda-graph-warmup-steps", 0)
    modules, flag = cuda_graph_modules_given(args.cuda_graph_modules,
                                             vars(args).pop("cuda_graph_scope", None))
    if impl == "none":
        if capacity > 0:
            fail("--cuda-graph-max-packed-seqs", capacity,
                 "It would be silently ignored without graphs; add --cuda-graph-impl local")
        if modules:  # None (flag absent) or [] (already normalised) are fine
            fail(flag, " ".join(modules),
                 "It would be silently ignored without graphs; add --cuda-graph-impl local")
    else:
        if capacity == 0:
            fail("--cuda-graph-max-packed-seqs", capacity,
                 f"--cuda-graph-impl {impl} on packed THD data needs a fixed document capacity "
                 "per micro-batch, e.g. `--cuda-graph-max-packed-seqs 64`; choose it with "
                 "tools/capacity_advisor.py")
        if impl == "transformer_engine":
            _require_package("transformer_engine", "--cuda-graph-impl", impl)
    ladder = args.cuda_graph_capacity_ladder
    if ladder:
        _check_capacity_ladder(args, ladder, impl, capacity)
    args.cuda_graph_capacity_ladder = list(ladder or [])
    if args.cuda_graph_granularity == "chunk" and impl not in ("local", "full_iteration"):
        fail("--cuda-graph-granularity", "chunk",
             f"Chunk graphs are built by the local implementation, not --cuda-graph-impl {impl}; "
             "add --cuda-graph-impl local")
    args.cuda_graph_modules = normalise_cuda_graph_modules(modules or [], flag)
    _check_partial_moe_modules(args, flag)
    if impl == "transformer_engine":
        _check_te_graphs(args, flag)
    if impl == "full_iteration":
        _check_full_iteration(args, flag)
    backend = getattr(args, "attention_backend", None)  # the library API checks it later
    if impl != "none" and (backend == "te" or (
            backend == "auto" and is_importable("transformer_engine"))):
        # TE attention asserts TE's RNG tracker while any CUDA graph is being captured.
        args.te_rng_tracker = True
    if (impl == "local" and args.cuda_graph_granularity == "layer"
            and getattr(args, "rampup_batch_size", None)
            and getattr(args, "pipeline_model_parallel_size", 1) > 1):
        fail("--rampup-batch-size", _as_typed(args.rampup_batch_size),
             "With pipeline parallelism layer graphs replay megatron-core's runners by turn, "
             "as many as the capture iteration's micro-batches, and the ramp-up changes that "
             "count; use --cuda-graph-granularity chunk or drop the ramp-up")
    if args.cuda_graph_granularity == "chunk":
        if args.cuda_graph_modules:
            fail(flag, " ".join(args.cuda_graph_modules),
                 f"Chunk graphs capture the whole model chunk; drop {flag} or use "
                 "--cuda-graph-granularity layer")
        if args.cuda_graph_capacity_ladder:
            fail("--cuda-graph-capacity-ladder", _as_typed(args.cuda_graph_capacity_ladder),
                 "The ladder is built for layer graphs; drop it or use "
                 "--cuda-graph-granularity layer")
    if args.model == "gpt" and "mamba" in args.cuda_graph_modules:
        fail(flag, "mamba",
             "A gpt model has no Mamba layers; use attn and/or mlp")


# MoE flags and their defaults: any other value needs MoE layers (--num-experts).
_MOE_FLAG_DEFAULTS = {
    "--moe-router-topk": 2,
    "--moe-layer-freq": 1,
    "--moe-ffn-hidden-size": None,
    "--moe-shared-expert-intermediate-size": None,
    "--moe-router-load-balancing-type": "aux_loss",
    "--moe-aux-loss-coeff": 0.0,
    "--moe-z-loss-coeff": None,
    "--moe-router-score-function": "softmax",
    "--moe-router-pre-softmax": False,
    "--moe-router-enable-expert-bias": False,
    "--moe-router-bias-update-rate": 1e-3,
    "--moe-router-topk-scaling-factor": None,
    "--moe-router-num-groups": None,
    "--moe-router-group-topk": None,
    "--moe-router-dtype": None,
    "--moe-token-dispatcher-type": "alltoall",
    "--moe-expert-capacity-factor": None,
    "--moe-pad-expert-input-to-capacity": False,
    "--moe-capacity-overflow": "drop",
    "--moe-router-load-file": None,
    "--moe-grouped-gemm": False,
    "--expert-model-parallel-size": 1,
    "--expert-tensor-parallel-size": None,
}

DROPLESS_SYNCS = ("Dropless alltoall reads the per-expert token counts back to the host in "
                  "every MoE layer, and a capacity without padding sizes its output from the "
                  "routing map; whole-layer graphs need drop-and-pad: add "
                  "--moe-expert-capacity-factor <f> --moe-pad-expert-input-to-capacity, or "
                  "graph MoE layers in part (--cuda-graph-modules moe_router: dispatch and "
                  "experts run eager), or run without graphs")


def _value(args, flag: str):
    return getattr(args, flag[2:].replace("-", "_"), _MOE_FLAG_DEFAULTS.get(flag))


def _uses_te_backend(args) -> bool:
    backend = getattr(args, "attention_backend", "auto")
    return backend == "te" or (backend == "auto" and is_importable("transformer_engine"))


def check_moe(args, model: str):
    """MoE flags (Megatron's names); fills moe_ffn_hidden_size. Runs after the graph checks.

    Refused: what megatron-core cannot run here, and what this fork cannot graph, each with
    the reason (docs/moe.md)."""
    experts = getattr(args, "num_experts", None)
    pattern = args.hybrid_override_pattern or ""
    args.moe_layer_freq = _moe_layer_freq(args.moe_layer_freq)
    if experts is None:
        if model == "hybrid" and "E" in pattern:
            fail("--hybrid-override-pattern", repr(pattern),
                 "Its 'E' layers are MoE layers; add --num-experts")
        if partial_moe_modules(args):
            fail("--cuda-graph-modules", " ".join(partial_moe_modules(args)),
                 "It captures parts of MoE layers and the model has none; add --num-experts "
                 "or drop it")
        for flag, default in _MOE_FLAG_DEFAULTS.items():
            if _value(args, flag) != default:
                fail(flag, _value(args, flag),
                     "It configures MoE layers; add --num-experts or drop the flag")
        args.moe_ffn_hidden_size = None
        return
    if model == "hybrid" and "E" not in pattern:
        fail("--num-experts", experts,
             f"--hybrid-override-pattern {pattern!r} has no 'E' (MoE) layer; add one or drop "
             "--num-experts")
    _at_least(args, "--num-experts", 1)
    topk = args.moe_router_topk
    if not 1 <= topk <= experts:
        fail("--moe-router-topk", topk, f"Use a value in [1, --num-experts ({experts})]")
    if (topk == 1 and args.moe_router_score_function == "softmax"
            and not args.moe_router_pre_softmax):
        fail("--moe-router-topk", 1,
             "Top-1 softmax routing needs --moe-router-pre-softmax: a softmax over the one "
             "chosen expert is always 1 and gives the router no gradient (megatron-core "
             "refuses it); add it, or use --moe-router-score-function sigmoid")
    _at_least(args, "--moe-ffn-hidden-size", 1)
    _at_least(args, "--moe-shared-expert-intermediate-size", 1)
    _at_least(args, "--moe-aux-loss-coeff", 0.0)
    _at_least(args, "--moe-z-loss-coeff", 0.0)
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    _check_expert_bias(args)
    _check_moe_layer_freq(args, model)
    _check_group_limited_routing(args, experts)
    if args.moe_router_load_balancing_type == "none" and args.moe_aux_loss_coeff > 0:
        fail("--moe-aux-loss-coeff", args.moe_aux_loss_coeff,
             "--moe-router-load-balancing-type none has no load-balancing loss to weigh; drop "
             "the coefficient or choose aux_loss or seq_aux_loss")
    dispatcher = args.moe_token_dispatcher_type
    if dispatcher in REFUSED_DISPATCHERS:
        fail("--moe-token-dispatcher-type", dispatcher, REFUSED_DISPATCHERS[dispatcher])
    factor = args.moe_expert_capacity_factor
    if factor is not None and not factor > 0:  # megatron-core reads a negative one as None
        fail("--moe-expert-capacity-factor", factor,
             "Use a positive factor, e.g. 1.25, or drop the flag for dropless routing")
    if args.moe_pad_expert_input_to_capacity:
        if factor is None:
            fail("--moe-pad-expert-input-to-capacity", True,
                 "It pads every expert to its capacity; add --moe-expert-capacity-factor")
        if factor * topk > experts:
            fail("--moe-expert-capacity-factor", factor,
                 f"With --moe-pad-expert-input-to-capacity, capacity factor x top-k "
                 f"({factor} x {topk}) above --num-experts ({experts}) gives each expert a "
                 f"capacity above the micro-batch's token count, which megatron-core's "
                 f"drop-and-pad permutation does not size for; use a factor <= "
                 f"{experts / topk:g}")
    if args.moe_capacity_overflow == "rerun":
        _check_overflow_rerun(args)
    elif args.moe_router_load_file:
        fail("--moe-router-load-file", args.moe_router_load_file,
             "The loads are measured by --moe-capacity-overflow rerun; add it or drop the flag")
    if args.moe_grouped_gemm:
        _require_package("transformer_engine", "--moe-grouped-gemm", True)
        if not _uses_te_backend(args):
            fail("--moe-grouped-gemm", True,
                 f"Grouped GEMM experts come with the Transformer Engine layer spec, not "
                 f"--attention-backend {args.attention_backend}; use te or auto, or drop it "
                 "(SequentialMLP experts)")
    _check_expert_parallel(args, experts)
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        fail("--tensor-model-parallel-size", args.tensor_model_parallel_size,
             "MoE layers with tensor parallelism need --sequence-parallel (megatron-core "
             "refuses the combination in training)")
    _check_moe_graphs(args, model)


_LAYER_FREQ_FORMAT = ("Give N (every N-th layer is MoE, the first included) or one 0/1 per "
                      "layer as a list expression of lists, ints, + and *, e.g. [0]*1+[1]*26")


def _moe_layer_freq(value):
    """--moe-layer-freq as an int or a list of ints (Megatron's two forms). A list is
    evaluated from its literal syntax only: lists, ints, + and * (no names, no calls)."""
    if not isinstance(value, str):
        return value
    import ast

    def evaluate(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [evaluate(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = evaluate(node.left), evaluate(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(ast.dump(node))

    try:
        result = evaluate(ast.parse(value.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        fail("--moe-layer-freq", repr(value), _LAYER_FREQ_FORMAT)
    if not isinstance(result, (int, list)):
        fail("--moe-layer-freq", repr(value), _LAYER_FREQ_FORMAT)
    return result


def _check_moe_layer_freq(args, model: str):
    freq = args.moe_layer_freq
    if freq == 1:
        return
    if model == "hybrid":
        fail("--moe-layer-freq", freq,
             "A hybrid model's MoE layers are the 'E' layers of --hybrid-override-pattern; "
             "drop the flag")
    if isinstance(freq, int):
        if freq < 1:
            fail("--moe-layer-freq", freq, "Use N >= 1: every N-th layer is MoE")
        return
    if len(freq) != args.num_layers or not all(type(v) is int and v in (0, 1) for v in freq):
        fail("--moe-layer-freq", freq,
             f"Give one 0 (dense) or 1 (MoE) per layer: {args.num_layers} for --num-layers "
             f"{args.num_layers}")
    if 1 not in freq:
        fail("--moe-layer-freq", freq,
             "It makes no layer MoE; drop --num-experts and the MoE flags for a dense model")


def _check_group_limited_routing(args, experts: int):
    groups, chosen = args.moe_router_num_groups, args.moe_router_group_topk
    topk = args.moe_router_topk
    if groups is None and chosen is None:
        return
    if groups is None or chosen is None:
        given = "--moe-router-num-groups" if groups is not None else "--moe-router-group-topk"
        fail(given, groups if groups is not None else chosen,
             "Group-limited routing needs both --moe-router-num-groups and "
             "--moe-router-group-topk; add the other or drop it")
    if groups < 1 or experts % groups:
        fail("--moe-router-num-groups", groups,
             f"Use a divisor of --num-experts ({experts}): the groups are equal")
    if not 1 <= chosen <= groups:
        fail("--moe-router-group-topk", chosen,
             f"Use a value in [1, --moe-router-num-groups ({groups})]")
    if topk % chosen or topk // chosen > experts // groups:
        fail("--moe-router-group-topk", chosen,
             f"megatron-core scores a group by its best --moe-router-topk / group-topk experts: "
             f"it must divide --moe-router-topk ({topk}) into at most the {experts // groups} "
             f"experts of a group")


def _check_expert_bias(args):
    """Aux-loss-free balancing and the top-k weight scale."""
    factor = args.moe_router_topk_scaling_factor
    if factor is not None and not factor > 0:
        fail("--moe-router-topk-scaling-factor", factor,
             "It multiplies the routed experts' weights; use a positive factor, e.g. 2.5, "
             "or drop it")
    if not args.moe_router_enable_expert_bias:
        if args.moe_router_bias_update_rate != 1e-3:
            fail("--moe-router-bias-update-rate", args.moe_router_bias_update_rate,
                 "It moves the expert bias; add --moe-router-enable-expert-bias or drop it")
        return
    if args.moe_router_score_function != "sigmoid":
        fail("--moe-router-enable-expert-bias", True,
             f"Aux-loss-free balancing biases sigmoid scores (megatron-core refuses "
             f"{args.moe_router_score_function}); add --moe-router-score-function sigmoid")
    if not args.moe_router_bias_update_rate > 0:
        fail("--moe-router-bias-update-rate", args.moe_router_bias_update_rate,
             "Use a positive rate, e.g. 1e-3 (megatron-core's default)")


def _check_overflow_rerun(args):
    """--moe-capacity-overflow rerun: the dropless mode of graphed MoE layers."""
    if partial_moe_modules(args):
        fail("--moe-capacity-overflow", "rerun",
             "Partial MoE graphs (--cuda-graph-modules moe_router) run token dispatch and "
             "experts eager, so they run dropless directly, and a dropless rerun would change "
             "dispatcher state that megatron-core's router graph expects to stay the same; "
             "drop the flag and --moe-expert-capacity-factor")
    if args.cuda_graph_impl == "none":
        fail("--moe-capacity-overflow", "rerun",
             "It reruns micro-batches whose MoE layers overflowed their graphs' drop-and-pad "
             "capacity; without CUDA graphs MoE layers run dropless directly: drop the flag "
             "and --moe-expert-capacity-factor, or add --cuda-graph-impl")
    if not (args.moe_expert_capacity_factor and args.moe_pad_expert_input_to_capacity):
        fail("--moe-capacity-overflow", "rerun",
             "It reruns micro-batches that overflowed the drop-and-pad capacity, which needs "
             "one: add --moe-expert-capacity-factor <f> --moe-pad-expert-input-to-capacity "
             "(tools/capacity_advisor.py --moe-router-loads suggests f)")


def _check_expert_parallel(args, experts: int):
    """Fills expert_tensor_parallel_size (Megatron's default: the tensor-parallel size)."""
    _at_least(args, "--expert-model-parallel-size", 1)
    ep = args.expert_model_parallel_size
    if experts % ep:
        fail("--expert-model-parallel-size", ep,
             f"It must divide --num-experts ({experts}): every rank holds the same number of "
             "experts")
    tp = args.tensor_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    _at_least(args, "--expert-tensor-parallel-size", 1)
    etp = args.expert_tensor_parallel_size
    # megatron-core lays the expert groups (expert TP x EP x expert DP) over the same ranks as
    # the dense ones (TP x CP x DP) within each pipeline stage.
    if tp % etp:
        fail("--expert-tensor-parallel-size", etp,
             f"It must divide --tensor-model-parallel-size ({tp}); 1 folds the attention's "
             "tensor-parallel ranks into expert parallelism")
    ranks = tp * args.context_parallel_size * args.data_parallel_size
    if ranks % (etp * ep):
        fail("--expert-model-parallel-size" if etp == tp else "--expert-tensor-parallel-size",
             ep if etp == tp else etp,
             f"Expert tensor x expert parallel ranks ({etp} x {ep}) are taken from the tensor "
             f"x context x data parallel ranks of a pipeline stage ({tp} x "
             f"{args.context_parallel_size} x {args.data_parallel_size} = {ranks}); use sizes "
             f"whose product divides {ranks}")
    if ep > 1 and getattr(args, "dynamic_cp_sizes", None):
        fail("--expert-model-parallel-size", ep,
             "Under dynamic CP ranks hold different token counts, so expert capacities differ "
             "between the ranks of one expert-parallel all-to-all; use 1 or drop "
             "--dynamic-cp-sizes")


def _check_moe_graphs(args, model: str):
    if args.cuda_graph_impl == "none":
        return
    factor = args.moe_expert_capacity_factor
    drop_and_pad = factor and args.moe_pad_expert_input_to_capacity
    partial = partial_moe_modules(args)
    if not partial and not drop_and_pad:
        fail("--cuda-graph-impl", args.cuda_graph_impl, DROPLESS_SYNCS)
    if "moe_preprocess" in partial and factor and not drop_and_pad:
        local = " (the local implementation always graphs it with moe_router)" if (
            args.cuda_graph_impl == "local") else ""
        fail("--moe-expert-capacity-factor", factor,
             f"With moe_preprocess in the graph{local}, a capacity without "
             "--moe-pad-expert-input-to-capacity sizes the permuted tokens from the routing "
             "map's sum, a host read inside the graph (megatron-core refuses it too); add "
             "--moe-pad-expert-input-to-capacity, or drop the factor for dropless MoE")
    if "mlp" in args.cuda_graph_modules:
        layers = ("the layers --moe-layer-freq names (every layer by default)" if model == "gpt"
                  else "the 'E' layers")
        fail("--cuda-graph-modules", "mlp",
             f"With --num-experts the MLPs of {layers} are MoE layers, which mlp graphs do not "
             "capture; megatron-core refuses mlp graphs when every layer is MoE (it counts "
             "hybrid '-' layers as MoE too), and this fork does not graph the dense MLPs of a "
             "mixed model apart: drop mlp or capture whole layers")


def check_dynamic_cp(args):
    """--dynamic-cp-sizes and --dynamic-cp-max-packed-seqs; fills dynamic_cp_tokens_per_rank
    (0 without dynamic CP) and dynamic_cp_max_packed_seqs (one capacity per size)."""
    from megatron.packed_graphs.dynamic_cp import check_cp_sizes

    sizes, capacities = args.dynamic_cp_sizes, args.dynamic_cp_max_packed_seqs
    args.dynamic_cp_tokens_per_rank = 0
    if not sizes:
        if capacities:
            fail("--dynamic-cp-max-packed-seqs", _as_typed(capacities),
                 "It sizes the graph banks of dynamic CP; add --dynamic-cp-sizes or drop it")
        return
    flag, shown = "--dynamic-cp-sizes", _as_typed(sizes)
    ranks = args.data_parallel_size * args.context_parallel_size  # derived by check_parallelism
    check_cp_sizes(sizes, ranks, what=flag)
    if ranks & (ranks - 1):
        fail(flag, shown, f"Dynamic CP places micro-batches on power-of-two blocks of the "
                          f"{ranks} data-parallel ranks; use a power-of-two rank count")
    refusals = [
        (args.context_parallel_size > 1, "--context-parallel-size", args.context_parallel_size,
         "Dynamic CP picks each micro-batch's CP group from the data-parallel ranks; use "
         "--context-parallel-size 1"),
        (args.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size",
         args.pipeline_model_parallel_size,
         "Ranks run different numbers of micro-batches under dynamic CP, which pipeline "
         "stages cannot; use --pipeline-model-parallel-size 1"),
        (args.micro_batch_size != 1, "--micro-batch-size", args.micro_batch_size,
         "Under dynamic CP a micro-batch is one packed stream; use --micro-batch-size 1"),
        (bool(args.rampup_batch_size), "--rampup-batch-size", _as_typed(args.rampup_batch_size or []),
         "Dynamic CP reads whole global batches; drop the ramp-up"),
        (not args.calculate_per_token_loss, "--no-calculate-per-token-loss", True,
         "Ranks run different numbers of micro-batches under dynamic CP, so only the "
         "per-token loss weighs them right; drop the flag"),
        (args.cuda_graph_impl == "local", "--cuda-graph-impl", "local",
         "Graph banks per CP size are built on --cuda-graph-impl transformer_engine; use it "
         "or none"),
    ]
    for refused, what, value, todo in refusals:
        if refused:
            fail(what, value, todo)
    if sizes[-1] > 1:
        _require_te_attention(args, flag, shown)
        if args.model == "hybrid":
            for size in sizes[1:]:
                _check_mamba_cp(args, flag, size)
    largest = sizes[-1]
    if args.seq_length % (2 * largest * largest):
        fail("--seq-length", args.seq_length,
             f"With --dynamic-cp-sizes up to {largest} every rank holds --seq-length / {largest} "
             f"positions, a multiple of 2 x {largest}: use a multiple of {2 * largest * largest}")
    args.dynamic_cp_tokens_per_rank = args.seq_length // largest
    if capacities is None:
        capacities = [args.cuda_graph_max_packed_seqs] * len(sizes)
    elif args.cuda_graph_impl == "none":
        fail("--dynamic-cp-max-packed-seqs", _as_typed(capacities),
             "It would be silently ignored without graphs; add --cuda-graph-impl "
             "transformer_engine")
    elif len(capacities) != len(sizes) or min(capacities) < 1:
        fail("--dynamic-cp-max-packed-seqs", _as_typed(capacities),
             f"Give one positive capacity per --dynamic-cp-sizes entry ({len(sizes)})")
    args.dynamic_cp_max_packed_seqs = list(capacities)


# MLA flags and their defaults: any other value needs --multi-latent-attention.
_MLA_FLAG_DEFAULTS = {
    "--q-lora-rank": None,
    "--kv-lora-rank": 32,
    "--qk-head-dim": 128,
    "--qk-pos-emb-head-dim": 64,
    "--v-head-dim": 128,
    "--rope-type": None,
    "--rotary-scaling-factor": 1.0,
    "--original-max-position-embeddings": 4096,
    "--beta-fast": 32.0,
    "--beta-slow": 1.0,
    "--mscale": 1.0,
    "--mscale-all-dim": 0.0,
    "--mla-pad-v": "always",
}

MLA_NEEDS_TE = ("Multi-latent attention on packed (THD) data runs only on Transformer Engine "
                "attention: megatron-core's TE-free MLA core attention takes no packed "
                "sequences")


def _mla_value(args, flag: str):
    return getattr(args, flag[2:].replace("-", "_"), _MLA_FLAG_DEFAULTS[flag])


def check_mla(args, model: str):
    """--multi-latent-attention and its flags (Megatron's names). Runs after the attention
    and parallelism checks. Refused, with the reason: what packed MLA cannot run (no TE
    attention, unfused RoPE) and flags that would be ignored (docs/mla.md)."""
    enabled = getattr(args, "multi_latent_attention", False)
    pattern = args.hybrid_override_pattern or ""
    if not enabled:
        args.multi_latent_attention = False
        if model == "hybrid" and "+" in pattern:
            fail("--hybrid-override-pattern", repr(pattern),
                 "Its '+' layers are multi-latent attention layers; add "
                 "--multi-latent-attention")
        for flag, default in _MLA_FLAG_DEFAULTS.items():
            if _mla_value(args, flag) != default:
                fail(flag, _mla_value(args, flag),
                     "It configures multi-latent attention; add --multi-latent-attention or "
                     "drop the flag")
        return
    if model == "hybrid":
        if "+" not in pattern:
            fail("--multi-latent-attention", True,
                 f"--hybrid-override-pattern {pattern!r} has no '+' (MLA) layer; add one or "
                 "drop --multi-latent-attention")
        if "*" in pattern:
            fail("--hybrid-override-pattern", repr(pattern),
                 "megatron-core builds one attention kind per hybrid model; use '+' (MLA) or "
                 "'*' (standard attention) layers, not both")
    _require_package("transformer_engine", "--multi-latent-attention", True)
    if not _uses_te_backend(args):
        fail("--attention-backend", args.attention_backend, f"{MLA_NEEDS_TE}; use te or auto")
    if not is_importable("triton"):
        fail("--multi-latent-attention", True,
             "Its fused yarn RoPE is a Triton kernel and triton is not importable; install "
             "PyTorch's CUDA build, which ships it")
    for flag in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                 "--v-head-dim", "--original-max-position-embeddings"):
        _at_least(args, flag, 1)
    if args.qk_pos_emb_head_dim % 4:
        fail("--qk-pos-emb-head-dim", args.qk_pos_emb_head_dim,
             "The fused MLA RoPE kernel rotates channel pairs in two halves; use a multiple "
             "of 4, e.g. 64")
    if args.rope_type == "rope":
        fail("--rope-type", "rope",
             "Packed MLA runs megatron-core's fused yarn RoPE, the only MLA RoPE that reads "
             "no cu_seqlens back to the host (the unfused THD RoPE calls .tolist()); use "
             "yarn (with --rotary-scaling-factor 1 it rotates like plain RoPE)")
    if args.rotary_percent != 1.0:
        fail("--rotary-percent", args.rotary_percent,
             "MLA rotates all --qk-pos-emb-head-dim channels and ignores it; drop the flag")
    if args.num_query_groups != args.num_attention_heads:
        fail("--num-query-groups", args.num_query_groups,
             "MLA gives every head its own key and value from the latent and has no "
             "key/value groups; drop the flag")
    for flag in ("--rotary-scaling-factor", "--beta-fast", "--beta-slow"):
        if not _mla_value(args, flag) > 0:
            fail(flag, _mla_value(args, flag), "Use a positive value")
    _at_least(args, "--mscale", 0.0)
    _at_least(args, "--mscale-all-dim", 0.0)
    query_head = args.qk_head_dim + args.qk_pos_emb_head_dim
    if _mla_value(args, "--mla-pad-v") == "never" and query_head == args.v_head_dim:
        fail("--mla-pad-v", "never",
             f"V already has the query head size ({query_head} = --qk-head-dim + "
             "--qk-pos-emb-head-dim = --v-head-dim), so nothing is padded; drop the flag")


def check_graph_health_check(args):
    """--cuda-graph-check-interval, -tolerance and -action (docs/cuda-graphs.md, "Graph health
    check"). Runs after the parallelism, graph and dynamic-CP checks."""
    from megatron.packed_graphs.health_check import HealthCheckConfig

    interval = args.cuda_graph_check_interval
    defaults = HealthCheckConfig()
    # The value rules (interval >= 0, positive finite tolerance, a known action).
    HealthCheckConfig(interval, args.cuda_graph_check_tolerance, args.cuda_graph_check_action)
    if interval == 0:
        for flag, value, default in (
                ("--cuda-graph-check-tolerance", args.cuda_graph_check_tolerance,
                 defaults.tolerance),
                ("--cuda-graph-check-action", args.cuda_graph_check_action, defaults.action)):
            if value != default:
                fail(flag, value, "It configures the graph health check, which is off; add "
                                  "--cuda-graph-check-interval N or drop the flag")
        return
    flag = "--cuda-graph-check-interval"
    if args.cuda_graph_impl == "none":
        fail(flag, interval, "The check compares CUDA graph replays with eager runs and would "
                             "be silently ignored without graphs; add --cuda-graph-impl local "
                             "with a capacity, or drop the flag")
    if args.pipeline_model_parallel_size > 1:
        fail(flag, interval, "The check runs one micro-batch outside the pipeline schedule, "
                             "which with pipeline parallelism would take a graph runner's turn "
                             "on every stage; use --pipeline-model-parallel-size 1 or drop the "
                             "flag")
    if args.dynamic_cp_sizes:
        fail(flag, interval, "Each rank checks its first graphed micro-batch, and under dynamic "
                             "CP the ranks of one CP group need not pick the same one; drop the "
                             "flag or --dynamic-cp-sizes")
