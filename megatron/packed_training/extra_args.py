"""The fork's own flags, added to Megatron-LM's parser, and their rules.

Megatron-LM's parser (the wheel's ``megatron.training.arguments``) owns every Megatron flag,
its default and its checks. This module adds what only the fork has (`add_packed_args`, the
``extra_args_provider`` of ``pretrain_gpt.py`` / ``pretrain_mamba.py``) and checks the run as
a whole for what packed CUDA graphs need (`validate_packed_args`, one function per feature).
Every rule raises ``ValueError("<what> is wrong: <value>. <what to do>.")``.

Two upstream flags change hands after parsing (`hand_graph_flags_to_the_runtime`):
``--cuda-graph-impl`` and ``--optimizer-cuda-graph`` are the graph runtime's. Megatron-LM's loop
builds graphs of its own when it sees them, so it is shown ``local`` (graph-safe RNG, and
megatron-core's local graph managers in the layers) or ``none``, and False; the user's values
stay in ``args.packed_graph_impl`` and ``args.packed_optimizer_graph``.

Every flag: docs/flags.md.
"""

import argparse
import importlib.util
import math

from megatron.core.transformer.enums import CudaGraphModule

GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
TE_ATTENTION = ("flash", "fused", "unfused")  # Megatron's TE attention backends
PARTIAL_MOE_MODULES = (CudaGraphModule.moe_router.name, CudaGraphModule.moe_preprocess.name)


def fail(what: str, value, todo: str):
    """Raise the one error shape every rule uses."""
    raise ValueError(f"{what} is wrong: {value}. {todo}.")


def is_importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def add_packed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the fork's flags. Returns ``parser``."""
    g = parser.add_argument_group("packed cuda graphs", "docs/flags.md, 'Graph flags'")
    g.add_argument("--cuda-graph-max-packed-seqs", type=int, nargs="?", const=50, default=0,
                   help="Graph capacity: packed documents per micro-batch (bare flag: 50; 0: "
                        "off). Choose it with tools/capacity_advisor.py.")
    g.add_argument("--cuda-graph-capacity-ladder", type=int, nargs="+", default=None,
                   metavar="N", help="Smaller capacities below --cuda-graph-max-packed-seqs, "
                                     "ascending; each micro-batch takes the smallest that fits.")
    g.add_argument("--cuda-graph-granularity", choices=["layer", "chunk"], default="layer",
                   help="layer: graphs per layer; chunk: one graph pair per pipeline model "
                        "chunk and in-flight micro-batch (local impl).")
    g.add_argument("--cuda-graph-check-interval", type=int, default=0, metavar="N",
                   help="Every N training iterations replay one graphed micro-batch, run it "
                        "eager too and compare loss and gradient norm (0: off).")
    g.add_argument("--cuda-graph-check-tolerance", type=float, default=0.01,
                   help="Largest relative difference the health check accepts.")
    g.add_argument("--cuda-graph-check-action", choices=["warn", "disable"], default="warn",
                   help="On a health-check divergence: warn, or turn graphs off.")
    g.add_argument("--dynamic-cp-sizes", type=int, nargs="+", default=None,
                   help="Dynamic context parallelism: the CP sizes a micro-batch may get.")
    g.add_argument("--dynamic-cp-max-packed-seqs", type=int, nargs="+", default=None,
                   help="Graph capacity per dynamic CP size.")
    g = parser.add_argument_group("packed data", "docs/data-format.md")
    g.add_argument("--long-document-policy", choices=["truncate", "split", "reject"],
                   default="split",
                   help="A document longer than a row: split into row-sized pieces (default), "
                        "truncate to --seq-length + 1 tokens, or reject naming file:line.")
    g.add_argument("--max-truncated-token-fraction", type=float, default=None,
                   help="With truncate: stop before training when truncation drops more than "
                        "this fraction of a file's tokens (default 0.05).")
    g.add_argument("--mock-doc-length-median", type=float, default=512,
                   help="--mock-data: median document length in tokens.")
    g.add_argument("--mock-doc-length-sigma", type=float, default=1.0,
                   help="--mock-data: log-normal sigma of document lengths.")
    g.add_argument("--moe-capacity-overflow", choices=["drop", "rerun"], default="drop",
                   help="A micro-batch that overflows the expert capacity: drop tokens "
                        "(Megatron's behaviour) or rerun it eager and dropless.")
    g.add_argument("--moe-router-load-file", default=None,
                   help="With rerun: write the measured router loads (for "
                        "tools/capacity_advisor.py).")
    from megatron.packed_training.moe_dropless_args import add_moe_dropless_args

    add_moe_dropless_args(g)
    g.add_argument("--mla-pad-v", choices=["always", "never"], default="always",
                   help="Packed MLA: pad V to the query head size (always) or not (never).")
    g.add_argument("--metrics-file", default=None,
                   help="JSON-lines file: one record per training iteration and evaluation.")
    g.add_argument("--profile-trace-dir", default=None,
                   help="With --profile: Chrome traces of the profiled iterations here.")
    return parser


def hand_graph_flags_to_the_runtime(args) -> None:
    """Keep the user's graph flags for the runtime and show Megatron-LM's loop none of its own
    graph wrappers' triggers (module doc). Called before Megatron-LM's ``validate_args`` and
    again after it: where those checks turned a deprecated spelling (--enable-cuda-graph,
    --external-cuda-graph, --cuda-graph-modules full_iteration) into an implementation, the
    second call takes that one."""
    def shown(impl: str) -> str:
        return "none" if impl == "none" else "local"

    if not hasattr(args, "packed_graph_impl"):
        args.packed_graph_impl = args.cuda_graph_impl
        args.packed_optimizer_graph = args.optimizer_cuda_graph
    elif args.cuda_graph_impl != shown(args.packed_graph_impl):
        args.packed_graph_impl = args.cuda_graph_impl
    args.cuda_graph_impl = shown(args.packed_graph_impl)
    args.optimizer_cuda_graph = False


def prepare_upstream_args(args, model: str) -> None:
    """What Megatron-LM's ``validate_args`` needs from a fork launch line, before it runs.

    ``--attention-backend local`` is the fork's TE-free attention, which upstream pairs with
    ``--spec local``; the fork's data paths are one file each."""
    args.model = model
    if args.attention_backend.name == "local" and args.spec is None:
        args.spec = ["local"]
    for flag in ("--data-path", "--valid-data-path"):
        name = flag[2:].replace("-", "_")
        paths = getattr(args, name)
        if isinstance(paths, list):
            if len(paths) > 1:
                fail(flag, " ".join(paths), "This fork reads one packed JSONL file per split "
                                            "(no blends); give one path")
            setattr(args, name, paths[0] if paths else None)
    if args.rampup_batch_size and args.step_batch_size_schedule is None:
        # megatron-core 0.19 ignores --rampup-batch-size (deprecated there for
        # --step-batch-size-schedule); here it keeps its meaning, given as that schedule.
        args.step_batch_size_schedule = rampup_schedule(
            args.rampup_batch_size, args.global_batch_size, args.seq_length)
        args._is_global_batch_size_explicitly_specified = False  # the schedule's last step


def rampup_schedule(rampup, global_batch_size, seq_length: int) -> str:
    """``--rampup-batch-size START INCREMENT SAMPLES`` as megatron-core's step schedule
    (``"THRESHOLD:BATCH ..."``; Megatron-LM reads the thresholds as tokens, samples x
    --seq-length): INCREMENT more samples per batch every SAMPLES / ((GBS - START) /
    INCREMENT) consumed samples, from START to GBS."""
    start, increment, samples = (int(x) for x in rampup)
    shown = " ".join(str(x) for x in rampup)
    if global_batch_size is None:
        fail("--rampup-batch-size", shown, "It ramps up to --global-batch-size: give that too")
    if not (0 < start <= global_batch_size and increment > 0 and samples >= 0
            and (global_batch_size - start) % increment == 0):
        fail("--rampup-batch-size", shown,
             f"Give START INCREMENT SAMPLES with 0 < START <= --global-batch-size "
             f"({global_batch_size}), INCREMENT > 0 dividing {global_batch_size} - START")
    steps = (global_batch_size - start) // increment
    per_step = samples / steps if steps else 0
    # Fewer ramp-up samples than steps: several increments land at one threshold, and the
    # batch jumps to the last of them (megatron-core wants strictly increasing thresholds).
    batch_at = {math.ceil(k * per_step) * seq_length: start + k * increment
                for k in range(steps + 1)}
    return " ".join(f"{threshold}:{batch}" for threshold, batch in batch_at.items())


def validate_packed_args(args, model: str) -> argparse.Namespace:
    """The fork's rules, after Megatron-LM's ``validate_args``. Fills derived values in place
    (``packed_graph_impl``, ``packed_cuda_graph_modules`` as names, ``num_microbatches``,
    ``te_rng_tracker``, ``packed_notes``). Returns args."""
    hand_graph_flags_to_the_runtime(args)
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size
                                                       * args.data_parallel_size)
    args.packed_notes = []  # start-up log lines: what the fork set for this launch line
    if args.gradient_accumulation_fusion and not is_importable("fused_weight_gradient_mlp_cuda"):
        # megatron-core's output layer fuses it with apex's kernel only; Megatron-LM stops at
        # model build without it.
        args.gradient_accumulation_fusion = False
        args.packed_notes.append("gradient accumulation fusion off: apex's "
                                 "fused_weight_gradient_mlp_cuda is not importable")
    if not (is_importable("transformer_engine") or is_importable("apex")):
        args.packed_notes.append("neither Transformer Engine nor apex is importable: "
                                 "megatron-core uses torch's Adam, norms and multi-tensor ops")
    # --profile (without --use-pytorch-profiler): the fork's profiler opens the nsys range
    # itself and measures each profiled iteration's GPU-busy time (profiling.py); Megatron-LM's
    # own nsys path would hold torch's autograd profiler (emit_nvtx) at the same time.
    args.packed_profile = bool(args.profile and not args.use_pytorch_profiler)
    if args.packed_profile:
        args.profile = False
    if not uses_te_attention(args):
        # TE kernels, and megatron-core checks for TE when the config is built: the TE-free
        # path applies RoPE by gather and has torch norms.
        args.apply_rope_fusion = False
        args.no_persist_layer_norm = True
    check_attention(args)
    check_mamba(args, model)
    check_tokenizer(args)
    check_dynamic_cp(args)
    check_graphs(args, model)
    if not is_importable("transformer_engine"):
        # Megatron-LM turns TE's RNG tracker on for any graphs while --transformer-impl is
        # its default transformer_engine; without TE the graph-safe megatron-core tracker is used.
        args.te_rng_tracker = False
    check_health_check(args)
    check_optimizer_graph(args)
    check_moe_graphs(args)
    check_mla(args, model)
    check_long_documents(args)
    return args


def uses_te_attention(args) -> bool:
    name = args.attention_backend.name
    return name in TE_ATTENTION or (name == "auto" and is_importable("transformer_engine"))


def check_attention(args) -> None:
    """``--attention-backend``: flash / fused / unfused are TE's, local the TE-free path."""
    name = args.attention_backend.name
    if args.multi_latent_attention and not uses_te_attention(args):
        fail("--attention-backend", name, "Packed multi-latent attention runs only on "
                                          "Transformer Engine attention; install TE and use "
                                          "auto, flash or fused")
    if name in TE_ATTENTION and not is_importable("transformer_engine"):
        fail("--attention-backend", name, "It is a Transformer Engine backend and TE is not "
                                          "importable: install it (`pip install .[te]`), or use "
                                          "local (PyTorch varlen attention)")


def check_mamba(args, model: str) -> None:
    """The widths MambaMixer asserts (inner width 2 x hidden), before the model is built."""
    if model != "hybrid":
        return
    inner = 2 * args.hidden_size
    if args.mamba_num_heads is None and inner % args.mamba_head_dim:
        fail("--mamba-head-dim", args.mamba_head_dim,
             f"It must divide the Mamba inner width 2 x --hidden-size = {inner}, or set "
             "--mamba-num-heads")
    heads = _mamba_heads(args)
    if heads % args.mamba_num_groups:
        fail("--mamba-num-groups", args.mamba_num_groups,
             f"It must divide the Mamba head count ({heads})")


def check_tokenizer(args) -> None:
    """``--tokenizer-type HuggingFaceTokenizer``: a local tokenizer whose size is the vocabulary
    (as Megatron-LM pads it); chat data (``messages`` JSONL) needs it and ``--sft``."""
    from megatron.packed_training.datasets.chat import chat_line
    from megatron.packed_training.tokenizer import TOKENIZER_TYPES, load_tokenizer

    if args.tokenizer_type in TOKENIZER_TYPES:
        if args.tokenizer_model is None:
            fail("--tokenizer-type", args.tokenizer_type,
                 "It needs --tokenizer-model <local tokenizer folder or tokenizer.json>")
        size = load_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size
        if args.vocab_size is not None and args.vocab_size != size:
            fail("--vocab-size", args.vocab_size,
                 f"--tokenizer-model {args.tokenizer_model} has {size} tokens and sets the "
                 f"vocabulary size; drop --vocab-size or set it to {size}")
        args.vocab_size = size
    for flag in ("--data-path", "--valid-data-path"):
        path = getattr(args, flag[2:].replace("-", "_"))
        line = chat_line(path) if path else None
        if line is not None and not args.sft:
            fail(flag, path, f"Line {line} is a chat conversation, whose loss is on assistant "
                             "tokens only; add --sft")


def check_dynamic_cp(args) -> None:
    """--dynamic-cp-sizes / --dynamic-cp-max-packed-seqs: a CP size per micro-batch from the
    set, so ranks run different numbers of micro-batches (docs/context-parallel.md). Fills
    ``dynamic_cp_tokens_per_rank`` (0 without dynamic CP), ``dynamic_cp_max_packed_seqs`` (a
    capacity per size) and ``dynamic_cp_groups`` (a size above 1: megatron-core's hybrid
    DP x CP groups are built at start-up, core_patches.build_hybrid_cp_groups_at_start_up)."""
    from megatron.packed_graphs.dynamic_cp import check_cp_sizes

    sizes, capacities = args.dynamic_cp_sizes, args.dynamic_cp_max_packed_seqs
    args.dynamic_cp_tokens_per_rank, args.dynamic_cp_groups = 0, False
    if not sizes:
        if capacities:
            fail("--dynamic-cp-max-packed-seqs", _shown(capacities),
                 "It sizes the graph banks of dynamic CP; add --dynamic-cp-sizes or drop it")
        return
    impl = args.packed_graph_impl
    uneven = "Ranks run different numbers of micro-batches under dynamic CP"
    ramp = "--rampup-batch-size" if args.rampup_batch_size else "--step-batch-size-schedule"
    modules = [getattr(m, "name", str(m)) for m in args.cuda_graph_modules or []]
    for refused, flag, value, todo in (
            (args.context_parallel_size > 1, "--context-parallel-size", args.context_parallel_size,
             "Dynamic CP picks each micro-batch's CP group from the data-parallel ranks; use 1"),
            (args.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size",
             args.pipeline_model_parallel_size, f"{uneven}, which pipeline stages cannot; use 1"),
            (args.expert_model_parallel_size > 1, "--expert-model-parallel-size",
             args.expert_model_parallel_size, "Ranks hold different token counts under dynamic "
             "CP, so expert capacities would differ within one expert-parallel all-to-all; use 1"),
            (args.micro_batch_size != 1, "--micro-batch-size", args.micro_batch_size,
             "Under dynamic CP a micro-batch is one packed stream; use 1"),
            (bool(args.rampup_batch_size or args.step_batch_size_schedule), ramp,
             _shown(getattr(args, ramp[2:].replace("-", "_"))),
             "Dynamic CP places whole global batches of one size; drop it"),
            (args.decrease_batch_size_if_needed, "--decrease-batch-size-if-needed", True,
             "Dynamic CP places whole global batches of one size; drop it"),
            (not args.calculate_per_token_loss, "--calculate-per-token-loss", "not given",
             f"{uneven}, so only the per-token loss weighs them right; add it"),
            (impl in ("local", "full_iteration"), "--cuda-graph-impl", impl,
             "Dynamic CP graphs are banks of TE layer graphs, one per CP size; use "
             "transformer_engine, or none"),
            (args.cuda_graph_check_interval > 0, "--cuda-graph-check-interval",
             args.cuda_graph_check_interval, "Each rank checks its first graphed micro-batch, "
             "and the ranks of a dynamic CP group need not pick the same one; drop it"),
            ("moe_preprocess" in modules, "--cuda-graph-modules", " ".join(modules),
             "Under dynamic CP each graph bank holds another token count, and the eager part "
             "of an MoE layer reads shapes its preprocess graph set at capture (the last "
             "bank's); drop moe_preprocess")):
        if refused:
            fail(flag, value, f"{todo}, or drop --dynamic-cp-sizes")
    ranks = args.data_parallel_size
    sizes = list(check_cp_sizes(sizes, ranks, what="--dynamic-cp-sizes"))
    shown, largest = _shown(sizes), sizes[-1]
    if ranks & (ranks - 1):
        fail("--dynamic-cp-sizes", shown, f"Dynamic CP places micro-batches on power-of-two "
                                          f"blocks of the {ranks} data-parallel ranks; use a "
                                          "power-of-two rank count")
    if largest > 1 and not uses_te_attention(args):
        fail("--attention-backend", args.attention_backend.name,
             f"CP sizes above 1 (--dynamic-cp-sizes {shown}) run Transformer Engine's "
             "context-parallel attention; install TE and use auto, flash, fused or unfused")
    if args.model == "hybrid":
        for size in (size for size in sizes if size > 1):
            _check_mamba_cp(args, size)
    if args.seq_length % (2 * largest * largest):
        fail("--seq-length", args.seq_length,
             f"With --dynamic-cp-sizes up to {largest} every rank holds --seq-length / {largest} "
             f"positions, a multiple of 2 x {largest}: use a multiple of {2 * largest ** 2}")
    if capacities and impl == "none":
        fail("--dynamic-cp-max-packed-seqs", _shown(capacities),
             "It would be ignored without graphs; add --cuda-graph-impl transformer_engine")
    if capacities and (len(capacities) != len(sizes) or min(capacities) < 1):
        fail("--dynamic-cp-max-packed-seqs", _shown(capacities),
             f"Give one positive capacity per --dynamic-cp-sizes entry ({len(sizes)})")
    args.dynamic_cp_sizes = sizes
    args.dynamic_cp_max_packed_seqs = list(capacities or [args.cuda_graph_max_packed_seqs]
                                           * len(sizes))
    args.dynamic_cp_tokens_per_rank = args.seq_length // largest
    args.dynamic_cp_groups = largest > 1


def _check_mamba_cp(args, size: int) -> None:
    """What megatron-core's MambaContextParallel asserts for a micro-batch's CP group, built
    when the first micro-batch of that size runs: whole heads per CP rank, and the CP size
    and the B/C groups per TP rank dividing one another."""
    tp = args.tensor_model_parallel_size
    heads, groups = _mamba_heads(args) // tp, max(args.mamba_num_groups // tp, 1)
    if heads % size or max(size, groups) % min(size, groups):
        fail("--dynamic-cp-sizes", _shown(args.dynamic_cp_sizes),
             f"Mamba context parallelism needs each CP size to divide the {heads} Mamba heads "
             f"per TP rank, and to divide or be divided by the {groups} groups per TP rank "
             f"(--mamba-num-groups / TP); {size} does not")


def _mamba_heads(args) -> int:
    return args.mamba_num_heads or 2 * args.hidden_size // args.mamba_head_dim


def _shown(values) -> str:
    """A list-valued flag as typed (``1 2 4``), for error messages."""
    return " ".join(map(str, values)) if isinstance(values, (list, tuple)) else str(values)


def check_graphs(args, model: str) -> None:
    """Graph implementation, capacity, granularity and modules."""
    impl, capacity = args.packed_graph_impl, args.cuda_graph_max_packed_seqs
    if capacity < 0:
        fail("--cuda-graph-max-packed-seqs", capacity, "Use 0 (graphs off) or a positive "
                                                       "document capacity")
    # Upstream parses --cuda-graph-modules into CudaGraphModule members; the runtime reads names.
    modules = [m.name if isinstance(m, CudaGraphModule) else str(m)
               for m in (args.cuda_graph_modules or [])]
    args.packed_cuda_graph_modules = modules
    if impl == "none":
        for flag, value in (("--cuda-graph-max-packed-seqs", capacity),
                            ("--cuda-graph-capacity-ladder", args.cuda_graph_capacity_ladder)):
            if value:
                fail(flag, _shown(value), "It would be ignored without graphs; add "
                                          "--cuda-graph-impl local")
        return
    if capacity == 0:
        fail("--cuda-graph-max-packed-seqs", 0,
             f"--cuda-graph-impl {impl} on packed data needs a document capacity per "
             "micro-batch, e.g. --cuda-graph-max-packed-seqs 64; tools/capacity_advisor.py "
             "picks one from your data")
    ladder = args.cuda_graph_capacity_ladder or []
    if ladder and (any(n < 1 for n in ladder) or list(ladder) != sorted(set(ladder))
                   or ladder[-1] >= capacity):
        fail("--cuda-graph-capacity-ladder", " ".join(map(str, ladder)),
             f"Give positive capacities in ascending order, all below "
             f"--cuda-graph-max-packed-seqs ({capacity})")
    if ladder and (impl != "local" or args.pipeline_model_parallel_size > 1):
        fail("--cuda-graph-capacity-ladder", " ".join(map(str, ladder)),
             "A ladder needs --cuda-graph-impl local at pipeline-parallel size 1 (other "
             "implementations capture one capacity)")
    args.cuda_graph_capacity_ladder = list(ladder)
    if args.cuda_graph_granularity == "chunk" and impl not in ("local", "full_iteration"):
        fail("--cuda-graph-granularity", "chunk",
             f"Chunk graphs are built by the local implementation, not {impl}; add "
             "--cuda-graph-impl local")
    if args.cuda_graph_granularity == "chunk" and modules:
        fail("--cuda-graph-modules", " ".join(modules), "Chunk graphs capture whole chunks; "
                                                        "drop --cuda-graph-modules")
    if model == "gpt" and "mamba" in modules:
        fail("--cuda-graph-modules", "mamba", "A GPT model has no Mamba layers")
    if impl == "transformer_engine":
        if not is_importable("transformer_engine"):
            fail("--cuda-graph-impl", impl, "Transformer Engine is not importable; install it "
                                            "or use --cuda-graph-impl local")
        if args.pipeline_model_parallel_size > 1:
            fail("--pipeline-model-parallel-size", args.pipeline_model_parallel_size,
                 "TE graphs of packed layers are captured for PP = 1; use --cuda-graph-impl "
                 "local (layer or chunk graphs) with pipeline parallelism")
    if impl == "full_iteration":
        _check_full_iteration(args)
    if impl in ("transformer_engine", "full_iteration") or uses_te_attention(args):
        args.te_rng_tracker = True  # TE attention and TE graphs assert TE's RNG tracker


def _check_full_iteration(args) -> None:
    if args.cuda_graph_warmup_steps < 1:
        fail("--cuda-graph-warmup-steps", args.cuda_graph_warmup_steps,
             "Full-iteration graphs need an eager iteration first (NCCL, cuBLAS and kernel "
             "autotuning set up on first use); use 1 or more")
    if args.pipeline_model_parallel_size > 1:
        fail("--pipeline-model-parallel-size", args.pipeline_model_parallel_size,
             "Full-iteration graphs are for PP = 1: megatron-core's pipeline send/receive "
             "synchronises the device after every exchange; use --cuda-graph-impl local")
    if args.context_parallel_size > 1:
        fail("--context-parallel-size", args.context_parallel_size,
             "Context parallelism inside full-iteration graphs is not verified; use "
             "--cuda-graph-impl local or transformer_engine")
    if args.num_experts is not None:
        fail("--num-experts", args.num_experts,
             "MoE inside full-iteration graphs is not supported (host state per micro-batch); "
             "use --cuda-graph-impl local")
    if args.cuda_graph_check_interval:
        fail("--cuda-graph-check-interval", args.cuda_graph_check_interval,
             "The health check replays one micro-batch's graph and a full-iteration run has "
             "one graph per iteration; drop it or use --cuda-graph-impl local")
    if args.packed_cuda_graph_modules:
        fail("--cuda-graph-modules", " ".join(args.packed_cuda_graph_modules),
             "Full-iteration graphs capture whole iterations, and whole layers or chunks for "
             "the iterations they miss; drop --cuda-graph-modules")
    if args.check_for_nan_in_loss_and_grad:
        fail("--no-check-for-nan-in-loss-and-grad", "not given",
             "DDP's NaN check (on by default) reads every gradient bucket's norm on the host, "
             "which a full-iteration graph cannot capture; add "
             "--no-check-for-nan-in-loss-and-grad (as Megatron-LM requires too)")


def check_health_check(args) -> None:
    if args.cuda_graph_check_interval < 0:
        fail("--cuda-graph-check-interval", args.cuda_graph_check_interval, "Use 0 (off) or N > 0")
    if args.cuda_graph_check_interval and args.packed_graph_impl == "none":
        fail("--cuda-graph-check-interval", args.cuda_graph_check_interval,
             "The health check compares graphs with eager; add --cuda-graph-impl local")
    if args.cuda_graph_check_interval and args.pipeline_model_parallel_size > 1:
        fail("--cuda-graph-check-interval", args.cuda_graph_check_interval,
             "The check runs one micro-batch outside the pipeline schedule, which would take "
             "a graph runner's turn on every stage; use --pipeline-model-parallel-size 1 or "
             "drop the flag")
    if not 0 < args.cuda_graph_check_tolerance < 1:
        fail("--cuda-graph-check-tolerance", args.cuda_graph_check_tolerance,
             "Use a relative difference in (0, 1), e.g. 0.01")


def check_optimizer_graph(args) -> None:
    """--optimizer-cuda-graph: the fork's own graph of the optimizer step (optimizer_graph.py)."""
    if not args.packed_optimizer_graph:
        return
    if args.fp16:
        fail("--optimizer-cuda-graph", True, "fp16's loss scaler reads its found-inf flag on "
                                             "the host; use --bf16")
    if args.log_num_zeros_in_grad:
        fail("--log-num-zeros-in-grad", True, "Counting zero gradients reads the count on the "
                                               "host each step; drop it with "
                                               "--optimizer-cuda-graph")
    if args.num_experts is not None and not args.use_distributed_optimizer:
        fail("--optimizer-cuda-graph", True, "MoE models have two chained optimizers, whose "
                                             "norms megatron-core merges on the host without "
                                             "--use-distributed-optimizer; add it")


def check_moe_graphs(args) -> None:
    """MoE under graphs: whole-layer graphs need drop-and-pad on the alltoall dispatcher;
    overflow reruns need graphed drop-and-pad layers; partial graphs' own limits; dropless
    MoE graphs (moe_dropless_args.py) take the place of drop-and-pad."""
    from megatron.packed_training.moe_dropless_args import (
        check_moe_dropless_graphs,
        check_moe_router_skew,
    )

    check_moe_router_skew(args)
    dropless_graphs = check_moe_dropless_graphs(args)
    if args.num_experts is None:
        for flag, value in (("--moe-capacity-overflow", args.moe_capacity_overflow != "drop"),
                            ("--moe-router-load-file", args.moe_router_load_file)):
            if value:
                fail(flag, getattr(args, flag[2:].replace("-", "_")),
                     "It configures MoE layers; add --num-experts or drop the flag")
        return
    factor, topk = args.moe_expert_capacity_factor, args.moe_router_topk
    drop_and_pad = bool(factor and args.moe_pad_expert_input_to_capacity)
    if drop_and_pad and factor * topk > args.num_experts:
        fail("--moe-expert-capacity-factor", factor,
             f"With --moe-pad-expert-input-to-capacity, capacity factor x top-k ({factor} x "
             f"{topk}) above --num-experts ({args.num_experts}) gives each expert a capacity "
             f"above the micro-batch's token count, which megatron-core's drop-and-pad "
             f"permutation does not size for; use a factor <= {args.num_experts / topk:g}")
    partial = [m for m in args.packed_cuda_graph_modules if m in PARTIAL_MOE_MODULES]
    graphs = args.packed_graph_impl != "none"
    if args.moe_capacity_overflow == "rerun":
        why = ("without CUDA graphs MoE layers run dropless directly: drop it and "
               "--moe-expert-capacity-factor, or add --cuda-graph-impl" if not graphs else
               "partial MoE graphs (--cuda-graph-modules moe_router) run dispatch and experts "
               "eager, dropless already: drop it and --moe-expert-capacity-factor" if partial
               else "it reruns what overflowed the drop-and-pad capacity: add "
               "--moe-expert-capacity-factor <f> --moe-pad-expert-input-to-capacity "
               "(tools/capacity_advisor.py suggests f)" if not drop_and_pad else None)
        if why:
            fail("--moe-capacity-overflow", "rerun", why[0].upper() + why[1:])
    if args.moe_router_load_file and args.moe_capacity_overflow != "rerun":
        fail("--moe-router-load-file", args.moe_router_load_file,
             "The loads are measured by --moe-capacity-overflow rerun; add it")
    if not graphs:
        return
    if args.moe_token_dispatcher_type != "alltoall":
        fail("--moe-token-dispatcher-type", args.moe_token_dispatcher_type,
             "Graphed MoE layers use the alltoall dispatcher: allgather reads token counts "
             "back to the host in every MoE layer, and flex needs DeepEP, which does too; "
             "use alltoall")
    if "mlp" in args.packed_cuda_graph_modules:
        fail("--cuda-graph-modules", "mlp",
             "With --num-experts the MLPs are MoE layers, which mlp graphs do not capture; "
             "drop mlp, or capture whole layers")
    if "moe_preprocess" in partial and factor and not drop_and_pad:
        fail("--moe-expert-capacity-factor", factor,
             "With moe_preprocess graphed, a capacity without "
             "--moe-pad-expert-input-to-capacity sizes the permuted tokens from a host read "
             "inside the graph; add --moe-pad-expert-input-to-capacity, or drop the factor")
    whole_layers = not args.packed_cuda_graph_modules and args.cuda_graph_granularity == "layer"
    if whole_layers and not drop_and_pad and not dropless_graphs:
        fail("--moe-expert-capacity-factor", factor,
             "Dropless MoE reads per-expert token counts on the host, which a whole-layer "
             "graph cannot capture; add --moe-expert-capacity-factor <f> "
             "--moe-pad-expert-input-to-capacity, or --moe-dropless-graphs, or graph MoE "
             "layers in part (--cuda-graph-modules moe_router)")


def check_mla(args, model: str) -> None:
    """Multi-latent attention on packed data: TE attention (check_attention), the fused yarn
    RoPE, and the flags that only mean something with it."""
    pattern = args.hybrid_layer_pattern or ""
    if not args.multi_latent_attention:
        if model == "hybrid" and "+" in pattern:
            fail("--hybrid-layer-pattern", repr(pattern),
                 "Its '+' layers are multi-latent attention layers; add "
                 "--multi-latent-attention")
        if args.mla_pad_v != "always":
            fail("--mla-pad-v", args.mla_pad_v,
                 "It configures multi-latent attention; add --multi-latent-attention or drop it")
        return
    if args.rope_type == "rope" and args.packed_graph_impl != "none":
        fail("--rope-type", "rope",
             "MLA's unfused THD RoPE reads cu_seqlens back to the host, which graphs cannot "
             "capture; use yarn (with --rotary-scaling-factor 1 it rotates like plain RoPE)")
    if args.qk_pos_emb_head_dim % 4:
        fail("--qk-pos-emb-head-dim", args.qk_pos_emb_head_dim,
             "The fused MLA RoPE rotates channel pairs in two halves; use a multiple of 4")
    query_head = args.qk_head_dim + args.qk_pos_emb_head_dim
    if args.mla_pad_v == "never" and query_head == args.v_head_dim:
        fail("--mla-pad-v", "never",
             f"V already has the query head size ({query_head}), so nothing is padded; "
             "drop the flag")


def check_long_documents(args) -> None:
    fraction = args.max_truncated_token_fraction
    if fraction is None:
        return
    if not 0.0 <= fraction <= 1.0:
        fail("--max-truncated-token-fraction", fraction, "Use a fraction in [0, 1], e.g. 0.05")
    if args.long_document_policy != "truncate":
        fail("--max-truncated-token-fraction", fraction,
             f"It limits what truncation drops and --long-document-policy "
             f"{args.long_document_policy} drops nothing; add --long-document-policy truncate")


def packed_attention_backend(args) -> str:
    """The fork's attention for Megatron-LM's ``--attention-backend``: TE's backends (flash,
    fused, unfused) run TE attention ('te'); local runs the TE-free varlen attention
    (flash-attn where importable, else PyTorch's); auto prefers TE, then as local."""
    name = args.attention_backend.name
    if name in TE_ATTENTION:
        return "te"
    if name == "local":
        return "flash" if is_importable("flash_attn") else "torch"
    return "auto"


def require_mamba_kernels() -> None:
    """pretrain_mamba.py: mamba-ssm and causal-conv1d importable (checked before any GPU work,
    not at parse time, so hybrid launch lines parse anywhere)."""
    for package in ("mamba_ssm", "causal_conv1d"):
        if not is_importable(package):
            fail("pretrain_mamba.py", f"{package} is not importable",
                 "The Mamba layers need mamba-ssm and causal-conv1d: pip install "
                 "--no-build-isolation -e \".[mamba]\" (docs/quickstart.md)")
