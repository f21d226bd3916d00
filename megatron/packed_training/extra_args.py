"""The fork's flags (`add_packed_args`, added by arguments.extra_args_provider) and its rules
for a whole run (`validate_packed_args`, after Megatron-LM's ``validate_args``): one check per
feature, each raising ``ValueError("<what> is wrong: <value>. <what to do>.")`` (`fail`,
`refuse`: packed_model/refusals.py). The graph flags go to the fork's graph runtime
(`hand_graph_flags_to_the_runtime`). Every flag: docs/flags.md."""

import argparse
import importlib.util
import math

from megatron.core.transformer.enums import CudaGraphModule

from megatron.packed_model.mamba_shapes import mamba_heads
from megatron.packed_model.refusals import fail, refuse
from megatron.packed_training.data_paths import DATA_PATHS, parse_blend
from megatron.packed_training.datasets.data_flags import add_data_args, check_data_args
from megatron.packed_training.fp8_flags import check_fp8

GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
TE_ATTENTION = ("flash", "fused", "unfused")  # Megatron's TE attention backends
PARTIAL_MOE_MODULES = (CudaGraphModule.moe_router.name, CudaGraphModule.moe_preprocess.name)
ROW_ALIGNMENT = 8  # torch._grouped_mm (dropless MoE graphs): rows of 16 bytes, 8 bf16 values
MOE_ONLY = "It configures MoE layers; add --num-experts or drop the flag"


def is_importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def add_packed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The fork's flags on Megatron-LM's ``parser`` (arguments.extra_args_provider); returns it."""
    g = parser.add_argument_group("packed cuda graphs", "docs/flags.md, 'Packed CUDA graphs'")
    g.add_argument("--cuda-graph-max-packed-seqs", type=int, nargs="?", const=50, default=0,
                   help="Graph capacity: documents per micro-batch (bare flag: 50; 0: off).")
    g.add_argument("--cuda-graph-capacity-ladder", type=int, nargs="+", metavar="N",
                   help="Smaller capacities, ascending: a micro-batch takes the smallest fit.")
    g.add_argument("--cuda-graph-granularity", choices=["layer", "chunk"], default="layer",
                   help="Graphs per layer, or per model chunk and in-flight micro-batch.")
    g.add_argument("--cuda-graph-check-interval", type=int, default=0, metavar="N",
                   help="Every N iterations compare one graphed micro-batch with eager (0: off).")
    g.add_argument("--cuda-graph-check-tolerance", type=float, default=0.01,
                   help="Largest relative difference the health check accepts.")
    g.add_argument("--cuda-graph-check-action", choices=["warn", "disable"], default="warn",
                   help="On a health-check divergence: warn, or turn graphs off.")
    g.add_argument("--dynamic-cp-sizes", type=int, nargs="+",
                   help="Dynamic context parallelism: the CP sizes a micro-batch may get.")
    g.add_argument("--dynamic-cp-max-packed-seqs", type=int, nargs="+",
                   help="Graph capacity per dynamic CP size.")
    add_data_args(parser)
    g = parser.add_argument_group("packed models", "docs/moe.md, docs/mla.md, docs/flags.md")
    g.add_argument("--moe-capacity-overflow", choices=["drop", "rerun"], default="drop",
                   help="Overflowing expert capacity: drop tokens, or rerun eager, dropless.")
    g.add_argument("--moe-router-load-file",
                   help="With rerun: write the router loads here (tools/capacity_advisor.py).")
    g.add_argument("--moe-dropless-graphs", action="store_true",
                   help="Dropless MoE layers of static shapes, graphed whatever the routing.")
    g.add_argument("--moe-router-skew", type=float, default=0.0, metavar="FRACTION",
                   help="Benchmarks: route about FRACTION of slots to an eighth of the experts.")
    g.add_argument("--mla-pad-v", choices=["always", "never"], default="always",
                   help="Packed MLA: pad V to the query head size (always) or not (never).")
    g.add_argument("--mamba-conv-kernel-size", type=int, choices=[2, 3, 4], default=4,
                   help="Mamba's causal convolution width (megatron-core's d_conv).")
    g.add_argument("--metrics-file",
                   help="JSON-lines file: one record per training iteration and evaluation.")
    g.add_argument("--profile-trace-dir",
                   help="With --profile: Chrome traces of the profiled iterations here.")
    return parser


def hand_graph_flags_to_the_runtime(args) -> None:
    """Move ``--cuda-graph-impl`` / ``--optimizer-cuda-graph`` to the runtime's fields
    ``packed_graph_impl`` / ``packed_optimizer_graph``; Megatron-LM's loop sees ``local`` or
    ``none``, and False. Runs before and after ``validate_args`` (deprecated graph flags)."""
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
    """What Megatron-LM's ``validate_args`` needs from a fork launch line: ``--spec local`` for
    the fork's TE-free ``--attention-backend local``, and ``--rampup-batch-size`` as
    megatron-core's step schedule (0.19 ignores the flag itself)."""
    args.model = model
    if args.attention_backend.name == "local" and args.spec is None:
        args.spec = ["local"]
    if args.rampup_batch_size and args.step_batch_size_schedule is None:
        args.step_batch_size_schedule = rampup_schedule(
            args.rampup_batch_size, args.global_batch_size, args.seq_length)
        args._is_global_batch_size_explicitly_specified = False  # the schedule's last step


def rampup_schedule(rampup, global_batch_size, seq_length: int) -> str:
    """``--rampup-batch-size START INCREMENT SAMPLES`` as megatron-core's ``"THRESHOLD:BATCH
    ..."`` schedule (thresholds in tokens, samples x --seq-length): INCREMENT more samples per
    batch every SAMPLES / ((GBS - START) / INCREMENT) consumed samples, from START to GBS."""
    start, increment, samples = (int(x) for x in rampup)
    if global_batch_size is None:
        fail("--rampup-batch-size", _shown(rampup),
             "It ramps up to --global-batch-size: give that too")
    if not (0 < start <= global_batch_size and increment > 0 and samples >= 0
            and (global_batch_size - start) % increment == 0):
        fail("--rampup-batch-size", _shown(rampup), "Give START INCREMENT SAMPLES with 0 < "
             f"START <= --global-batch-size ({global_batch_size}), INCREMENT > 0 dividing "
             f"{global_batch_size} - START")
    steps = (global_batch_size - start) // increment
    per_step = samples / steps if steps else 0
    # Fewer ramp-up samples than steps: several increments land at one threshold, and the
    # batch jumps to the last of them (megatron-core wants strictly increasing thresholds).
    batch_at = {math.ceil(k * per_step) * seq_length: start + k * increment
                for k in range(steps + 1)}
    return " ".join(f"{threshold}:{batch}" for threshold, batch in batch_at.items())


def validate_packed_args(args, model: str) -> argparse.Namespace:
    """The fork's rules, after ``validate_args``. Fills ``packed_graph_impl``, ``num_microbatches``,
    ``packed_cuda_graph_modules`` (names), ``te_rng_tracker``, ``packed_notes`` (start-up log)."""
    hand_graph_flags_to_the_runtime(args)
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size
                                                       * args.data_parallel_size)
    args.packed_notes = []
    check_gradient_accumulation_fusion(args)
    refuse((args.lr is None, "--lr", "not given", "Megatron-LM's learning-rate schedule needs "
            "the peak rate (without it the run fails once the model is built); add --lr 1e-4"))
    if not (is_importable("transformer_engine") or is_importable("apex")):
        args.packed_notes.append("neither Transformer Engine nor apex is importable: "
                                 "megatron-core uses torch's Adam, norms and multi-tensor ops")
    # --profile alone: the fork's nsys range (profiling.py), not Megatron-LM's emit_nvtx as well.
    args.packed_profile = bool(args.profile and not args.use_pytorch_profiler)
    args.profile = args.profile and not args.packed_profile
    if not uses_te_attention(args):  # the TE-free path: RoPE by gather, torch norms
        args.apply_rope_fusion, args.no_persist_layer_norm = False, True
    check_attention(args)
    check_mamba(args, model)
    check_tokenizer(args)
    check_dynamic_cp(args)
    check_graphs(args, model)
    # Megatron-LM asks for TE's RNG tracker for any graphs; megatron-core's is graph-safe too.
    args.te_rng_tracker = args.te_rng_tracker and is_importable("transformer_engine")
    check_health_check(args)
    check_optimizer_graph(args)
    check_moe_graphs(args)
    check_mla(args, model)
    check_fp8(args, model, te_attention=uses_te_attention(args))
    check_data_args(args)
    return args


def check_gradient_accumulation_fusion(args) -> None:
    """Without apex's kernel: on for TE's linears, which fuse in TE's GEMM (megatron-core's own
    build unfused: model_layers.megatron_core_linears_unfused_without_apex); off if TE-free."""
    if not args.gradient_accumulation_fusion or is_importable("fused_weight_gradient_mlp_cuda"):
        return
    refuse((args.defer_embedding_wgrad_compute, "--defer-embedding-wgrad-compute", "on",
            "It needs apex's fused_weight_gradient_mlp_cuda; install apex or drop the flag"))
    args.gradient_accumulation_fusion = uses_te_attention(args)
    args.packed_notes.append("gradient accumulation fusion " + (
        "on in Transformer Engine's linears, unfused in the output layer (no apex)"
        if args.gradient_accumulation_fusion else "off: no apex for the TE-free model's linears"))


def uses_te_attention(args) -> bool:
    name = args.attention_backend.name
    return name in TE_ATTENTION or (name == "auto" and is_importable("transformer_engine"))


def check_attention(args) -> None:
    """``--attention-backend``: flash / fused / unfused are TE's, local the TE-free path."""
    name = args.attention_backend.name
    refuse((args.multi_latent_attention and not uses_te_attention(args), "--attention-backend",
            name, "Packed multi-latent attention runs only on Transformer Engine attention; "
            "install TE and use auto, flash or fused"),
           (name in TE_ATTENTION and not is_importable("transformer_engine"),
            "--attention-backend", name, "It is a Transformer Engine backend and TE is not "
            "importable: install it (`pip install .[te]`), or use local (PyTorch varlen)"),
           # megatron-core's torch norms (the TE-free spec) assert it away at model build.
           (args.sequence_parallel and not uses_te_attention(args), "--sequence-parallel",
            True, f"The TE-free path (--attention-backend {name}) has no sequence-parallel "
            "norms; use Transformer Engine (--attention-backend auto) or drop the flag"))


def check_mamba(args, model: str) -> None:
    """The widths MambaMixer asserts (inner width 2 x hidden), before it is built; GPT: none."""
    refuse((model == "gpt" and args.mamba_conv_kernel_size != 4, "--mamba-conv-kernel-size",
            args.mamba_conv_kernel_size, "A GPT model has no Mamba layers; drop the flag"))
    if model == "hybrid":
        inner, heads = 2 * args.hidden_size, mamba_heads(args)
        refuse((args.mamba_num_heads is None and inner % args.mamba_head_dim, "--mamba-head-dim",
                args.mamba_head_dim, f"It must divide the Mamba inner width 2 x --hidden-size = "
                f"{inner}, or set --mamba-num-heads"),
               (heads % args.mamba_num_groups, "--mamba-num-groups", args.mamba_num_groups,
                f"It must divide the Mamba head count ({heads})"))


def check_tokenizer(args) -> None:
    """``--tokenizer-type HuggingFaceTokenizer``: the local tokenizer's size is the vocabulary;
    chat data (``messages`` JSONL) needs ``--sft``."""
    from megatron.packed_training.datasets.chat import chat_line
    from megatron.packed_training.datasets.token_cache import first_jsonl
    from megatron.packed_training.tokenizer import TOKENIZER_TYPES, load_tokenizer

    if args.tokenizer_type in TOKENIZER_TYPES:  # load_tokenizer refuses a missing/bad model
        size = load_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size
        if args.vocab_size is not None and args.vocab_size != size:
            fail("--vocab-size", args.vocab_size,
                 f"--tokenizer-model {args.tokenizer_model} has {size} tokens and sets the "
                 f"vocabulary size; drop --vocab-size or set it to {size}")
        args.vocab_size = size
    for flag, dest in DATA_PATHS:
        for path in parse_blend(getattr(args, dest), flag).paths if getattr(args, dest) else ():
            path = first_jsonl(path)  # a folder's first file stands for its format
            line = chat_line(path) if path else None
            if line is not None and not args.sft:
                fail(flag, path, f"Line {line} is a chat conversation, whose loss is on "
                                 "assistant tokens only; add --sft")


def check_dynamic_cp(args) -> None:
    """--dynamic-cp-sizes / --dynamic-cp-max-packed-seqs (docs/context-parallel.md). Fills
    ``dynamic_cp_tokens_per_rank`` (0: off), ``dynamic_cp_max_packed_seqs`` (a capacity per
    size) and ``dynamic_cp_groups`` (a size above 1: hybrid DP x CP groups at start-up)."""
    from megatron.packed_model.dynamic_cp import check_cp_sizes

    sizes, capacities = args.dynamic_cp_sizes, args.dynamic_cp_max_packed_seqs
    args.dynamic_cp_tokens_per_rank, args.dynamic_cp_groups = 0, False
    if not sizes:
        if capacities:
            fail("--dynamic-cp-max-packed-seqs", _shown(capacities),
                 "It sizes the graph banks of dynamic CP; add --dynamic-cp-sizes or drop it")
        return
    impl, modules = args.packed_graph_impl, module_names(args)
    uneven = "Ranks run different numbers of micro-batches under dynamic CP"
    one_size = "Dynamic CP places whole global batches of one size; drop it"
    ramp = "--rampup-batch-size" if args.rampup_batch_size else "--step-batch-size-schedule"
    ramped = args.rampup_batch_size or args.step_batch_size_schedule
    refuse((args.context_parallel_size > 1, "--context-parallel-size", args.context_parallel_size,
            "Dynamic CP picks each micro-batch's CP group from the data-parallel ranks; use 1"),
           (args.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size",
            args.pipeline_model_parallel_size, f"{uneven}, which pipeline stages cannot; use 1"),
           (args.expert_model_parallel_size > 1, "--expert-model-parallel-size",
            args.expert_model_parallel_size, "Ranks hold different token counts under dynamic "
            "CP, so expert capacities would differ within one expert-parallel all-to-all; use 1"),
           (args.micro_batch_size != 1, "--micro-batch-size", args.micro_batch_size,
            "Under dynamic CP a micro-batch is one packed stream; use 1"),
           (bool(ramped), ramp, _shown(ramped), one_size),
           (args.decrease_batch_size_if_needed, "--decrease-batch-size-if-needed", True, one_size),
           (not args.calculate_per_token_loss, "--calculate-per-token-loss", "not given",
            f"{uneven}, so only the per-token loss weighs them right; add it"),
           (args.fp8 and args.fp8_recipe == "delayed", "--fp8-recipe", "delayed", f"{uneven}, "
            "and delayed scaling all-reduces amaxes over them after every micro-batch; use "
            "tensorwise or blockwise"),
           (impl in ("local", "full_iteration"), "--cuda-graph-impl", impl, "Dynamic CP graphs are "
            "banks of TE layer graphs, one per CP size; use transformer_engine, or none"),
           (args.cuda_graph_check_interval > 0, "--cuda-graph-check-interval",
            args.cuda_graph_check_interval, "Each rank checks its first graphed micro-batch, "
            "and the ranks of a dynamic CP group need not pick the same one; drop it"),
           ("moe_preprocess" in modules, "--cuda-graph-modules", _shown(modules),
            "Graph banks hold different token counts, but an MoE layer's eager part reads the last "
            "bank's preprocess shapes; drop moe_preprocess"), suffix=", or drop --dynamic-cp-sizes")
    ranks, backend = args.data_parallel_size, args.attention_backend.name
    sizes = list(check_cp_sizes(sizes, ranks, what="--dynamic-cp-sizes"))
    shown, largest = _shown(sizes), sizes[-1]
    refuse((ranks & (ranks - 1), "--dynamic-cp-sizes", shown,
            f"Dynamic CP places micro-batches on power-of-two blocks of the {ranks} "
            "data-parallel ranks; use a power-of-two rank count"),
           (largest > 1 and not uses_te_attention(args), "--attention-backend", backend,
            f"CP sizes above 1 (--dynamic-cp-sizes {shown}) run Transformer Engine's "
            "context-parallel attention; install TE and use auto, flash, fused or unfused"))
    if args.model == "hybrid":
        # What megatron-core's MambaContextParallel asserts: whole heads per CP rank, and the
        # CP size and the B/C groups per TP rank dividing one another.
        tp = args.tensor_model_parallel_size
        heads, groups = mamba_heads(args) // tp, max(args.mamba_num_groups // tp, 1)
        for size in sizes:
            if heads % size or max(size, groups) % min(size, groups):
                fail("--dynamic-cp-sizes", shown, f"Mamba CP needs each size to divide the "
                     f"{heads} Mamba heads per TP rank and to divide or be divided by the "
                     f"{groups} groups per TP rank (--mamba-num-groups / TP); {size} does not")
    refuse((args.seq_length % (2 * largest * largest), "--seq-length", args.seq_length,
            f"With --dynamic-cp-sizes up to {largest} every rank holds --seq-length / {largest} "
            f"positions, a multiple of 2 x {largest}: use a multiple of {2 * largest ** 2}"),
           (capacities and impl == "none", "--dynamic-cp-max-packed-seqs", _shown(capacities),
            "It would be ignored without graphs; add --cuda-graph-impl transformer_engine"),
           (capacities and (len(capacities) != len(sizes) or min(capacities) < 1),
            "--dynamic-cp-max-packed-seqs", _shown(capacities),
            f"Give one positive capacity per --dynamic-cp-sizes entry ({len(sizes)})"))
    args.dynamic_cp_sizes, args.dynamic_cp_groups = sizes, largest > 1
    args.dynamic_cp_max_packed_seqs = capacities or [args.cuda_graph_max_packed_seqs] * len(sizes)
    args.dynamic_cp_tokens_per_rank = args.seq_length // largest


def _shown(values) -> str:
    """A list-valued flag as typed (``1 2 4``), for error messages."""
    return " ".join(map(str, values)) if isinstance(values, (list, tuple)) else str(values)


def module_names(args) -> list:
    """``--cuda-graph-modules`` as names (upstream parses them into CudaGraphModule members)."""
    return [getattr(m, "name", str(m)) for m in args.cuda_graph_modules or []]


def check_graphs(args, model: str) -> None:
    """Graph implementation, capacity, ladder, granularity and modules."""
    impl, capacity = args.packed_graph_impl, args.cuda_graph_max_packed_seqs
    refuse((capacity < 0, "--cuda-graph-max-packed-seqs", capacity,
            "Use 0 (graphs off) or a positive document capacity"))
    modules = args.packed_cuda_graph_modules = module_names(args)
    ladder = list(args.cuda_graph_capacity_ladder or [])
    if impl == "none":
        ignored = "It would be ignored without graphs; add --cuda-graph-impl local"
        refuse((capacity, "--cuda-graph-max-packed-seqs", capacity, ignored),
               (ladder, "--cuda-graph-capacity-ladder", _shown(ladder), ignored))
        return
    chunk, pp = args.cuda_graph_granularity == "chunk", args.pipeline_model_parallel_size
    refuse(
        (capacity == 0, "--cuda-graph-max-packed-seqs", 0, f"--cuda-graph-impl {impl} needs a "
         "document capacity per micro-batch, e.g. --cuda-graph-max-packed-seqs 64 "
         "(tools/capacity_advisor.py picks one from your data)"),
        (ladder and (min(ladder) < 1 or ladder != sorted(set(ladder)) or ladder[-1] >= capacity),
         "--cuda-graph-capacity-ladder", _shown(ladder), "Give positive capacities in ascending "
         f"order, all below --cuda-graph-max-packed-seqs ({capacity})"),
        (ladder and (impl != "local" or pp > 1 or chunk), "--cuda-graph-capacity-ladder",
         _shown(ladder), "A ladder needs local layer graphs at PP = 1 (a chunk has one slot)"),
        (chunk and impl not in ("local", "full_iteration"), "--cuda-graph-granularity", "chunk",
         f"Chunk graphs are the local implementation's, not {impl}; add --cuda-graph-impl local"),
        (chunk and modules, "--cuda-graph-modules", _shown(modules),
         "Chunk graphs capture whole chunks; drop --cuda-graph-modules"),
        (model == "gpt" and "mamba" in modules, "--cuda-graph-modules", "mamba",
         "A GPT model has no Mamba layers"),
        (impl == "transformer_engine" and not is_importable("transformer_engine"),
         "--cuda-graph-impl", impl, "Transformer Engine is not importable; install it or use "
         "--cuda-graph-impl local"),
        (impl == "transformer_engine" and pp > 1, "--pipeline-model-parallel-size", pp,
         "TE graphs are captured for PP = 1; use --cuda-graph-impl local (layer or chunk graphs)"),
        (impl == "transformer_engine" and model == "hybrid" and args.position_embedding_type
         == "rope", "--position-embedding-type", "rope", "TE graphs of a hybrid model do not "
         "replay its RoPE table; use --cuda-graph-impl local, or --position-embedding-type none"))
    args.cuda_graph_capacity_ladder = ladder
    if impl == "full_iteration":
        refuse(
            (args.cuda_graph_warmup_steps < 1, "--cuda-graph-warmup-steps",
             args.cuda_graph_warmup_steps, "Full-iteration graphs need an eager iteration first "
             "(NCCL, cuBLAS and kernel autotuning set up on first use); use 1 or more"),
            (pp > 1, "--pipeline-model-parallel-size", pp, "Full-iteration graphs are for PP = "
             "1: megatron-core's pipeline send/receive synchronises the device after every "
             "exchange; use --cuda-graph-impl local"),
            (args.context_parallel_size > 1, "--context-parallel-size",
             args.context_parallel_size, "Context parallelism inside full-iteration graphs is "
             "not verified; use --cuda-graph-impl local or transformer_engine"),
            (args.num_experts is not None, "--num-experts", args.num_experts, "MoE inside "
             "full-iteration graphs is not supported (host state per micro-batch); use "
             "--cuda-graph-impl local"),
            (args.cuda_graph_check_interval, "--cuda-graph-check-interval",
             args.cuda_graph_check_interval, "The health check replays one micro-batch's "
             "graph, not a whole iteration's; drop it or use --cuda-graph-impl local"),
            (modules, "--cuda-graph-modules", _shown(modules), "Full-iteration graphs capture "
             "whole iterations, and whole layers or chunks for the iterations they miss; drop "
             "--cuda-graph-modules"),
            (args.check_for_nan_in_loss_and_grad, "--no-check-for-nan-in-loss-and-grad",
             "not given", "DDP's NaN check (on by default) reads each gradient bucket's norm on "
             "the host, which the graph cannot capture; add --no-check-for-nan-in-loss-and-grad"))
    if impl in ("transformer_engine", "full_iteration") or uses_te_attention(args):
        args.te_rng_tracker = True  # TE attention and TE graphs assert TE's RNG tracker


def check_health_check(args) -> None:
    interval, flag = args.cuda_graph_check_interval, "--cuda-graph-check-interval"
    refuse((interval < 0, flag, interval, "Use 0 (off) or N > 0"),
           (interval and args.packed_graph_impl == "none", flag, interval,
            "The health check compares graphs with eager; add --cuda-graph-impl local"),
           (interval and args.pipeline_model_parallel_size > 1, flag, interval, "The check runs "
            "one micro-batch outside the pipeline schedule, which would take a graph runner's "
            "turn on every stage; use --pipeline-model-parallel-size 1 or drop the flag"),
           (not 0 < args.cuda_graph_check_tolerance < 1, "--cuda-graph-check-tolerance",
            args.cuda_graph_check_tolerance, "Use a relative difference in (0, 1), e.g. 0.01"))


def check_optimizer_graph(args) -> None:
    """--optimizer-cuda-graph: the fork's own graph of the optimizer step (optimizer_graph.py)."""
    if args.packed_optimizer_graph:
        refuse(
            (args.fp16, "--optimizer-cuda-graph", True,
             "fp16's loss scaler reads its found-inf flag on the host; use --bf16"),
            (args.log_num_zeros_in_grad, "--log-num-zeros-in-grad", True,
             "The zero count is read on the host each step; drop it with --optimizer-cuda-graph"),
            (args.num_experts is not None and not args.use_distributed_optimizer,
             "--optimizer-cuda-graph", True, "MoE models have two chained optimizers, whose norms "
             "megatron-core merges on the host without --use-distributed-optimizer; add it"))


def check_moe_graphs(args) -> None:
    """MoE under graphs: whole layers need drop-and-pad on the alltoall dispatcher, or dropless
    MoE graphs; overflow reruns need graphed drop-and-pad layers; partial graphs have limits."""
    check_moe_router_skew(args)
    dropless_graphs = check_moe_dropless_graphs(args)
    rerun, load_file = args.moe_capacity_overflow == "rerun", args.moe_router_load_file
    if args.num_experts is None:
        refuse((args.moe_capacity_overflow != "drop", "--moe-capacity-overflow",
                args.moe_capacity_overflow, MOE_ONLY),
               (load_file, "--moe-router-load-file", load_file, MOE_ONLY))
        return
    factor, topk = args.moe_expert_capacity_factor, args.moe_router_topk
    drop_and_pad = bool(factor and args.moe_pad_expert_input_to_capacity)
    if drop_and_pad and factor * topk > args.num_experts:
        fail("--moe-expert-capacity-factor", factor, f"Padded to capacity, factor x top-k "
             f"({factor} x {topk}) above --num-experts ({args.num_experts}) gives each expert a "
             "capacity above the micro-batch's token count, which megatron-core's drop-and-pad "
             f"permutation does not size for; use a factor <= {args.num_experts / topk:g}")
    modules, graphs = args.packed_cuda_graph_modules, args.packed_graph_impl != "none"
    partial = [m for m in modules if m in PARTIAL_MOE_MODULES]
    refuse(
        (rerun and not graphs, "--moe-capacity-overflow", "rerun", "Without CUDA graphs MoE "
         "layers run dropless: drop it and --moe-expert-capacity-factor, or add --cuda-graph-impl"),
        (rerun and partial, "--moe-capacity-overflow", "rerun", "Partial MoE graphs "
         "(--cuda-graph-modules moe_router) run dispatch and experts eager, dropless already: "
         "drop it and --moe-expert-capacity-factor"),
        (rerun and not drop_and_pad, "--moe-capacity-overflow", "rerun", "It reruns what "
         "overflowed the drop-and-pad capacity: add --moe-expert-capacity-factor <f> "
         "--moe-pad-expert-input-to-capacity (tools/capacity_advisor.py suggests f)"),
        (load_file and not rerun, "--moe-router-load-file", load_file,
         "The loads are measured by --moe-capacity-overflow rerun; add it"))
    if not graphs:
        return
    whole_layers = not modules  # whole layers, or the chunks holding them
    refuse(
        (args.moe_token_dispatcher_type != "alltoall", "--moe-token-dispatcher-type",
         args.moe_token_dispatcher_type, "Graphed MoE layers need alltoall: allgather reads "
         "token counts on the host in every MoE layer, and flex needs DeepEP, which does too; use "
         "alltoall"),
        ("mlp" in modules, "--cuda-graph-modules", "mlp", "With --num-experts the MLPs are MoE "
         "layers, which mlp graphs do not capture; drop mlp, or capture whole layers"),
        ("moe_preprocess" in partial and factor and not drop_and_pad,
         "--moe-expert-capacity-factor", factor, "A moe_preprocess graph would size an unpadded "
         "capacity from a host read; add --moe-pad-expert-input-to-capacity, or drop the factor"),
        (whole_layers and not drop_and_pad and not dropless_graphs,
         "--moe-expert-capacity-factor", factor, "Dropless MoE reads per-expert token counts on "
         "the host, which a whole-layer graph cannot capture; add --moe-expert-capacity-factor "
         "<f> --moe-pad-expert-input-to-capacity, or --moe-dropless-graphs, or graph MoE layers "
         "in part (--cuda-graph-modules moe_router)"))


def check_moe_dropless_graphs(args) -> bool:
    """``--moe-dropless-graphs``; returns whether it is on (whole-layer MoE graphs then need no
    drop-and-pad). The rules a TransformerConfig answers too: moe_dropless.dropless_refusals."""
    from megatron.packed_model.moe_dropless import dropless_refusals

    if not getattr(args, "moe_dropless_graphs", False):
        return False
    modules = args.packed_cuda_graph_modules
    refuse((args.num_experts is None, "--moe-dropless-graphs", True, MOE_ONLY),
           *dropless_refusals(args),
           (args.moe_capacity_overflow != "drop", "--moe-capacity-overflow",
            args.moe_capacity_overflow, "Nothing overflows without a capacity, so nothing is "
            "rerun: drop it with --moe-dropless-graphs"),
           (args.moe_router_load_file, "--moe-router-load-file", args.moe_router_load_file,
            "It is written by --moe-capacity-overflow rerun, which dropless graphs lack: drop it"),
           (any(m in (*PARTIAL_MOE_MODULES, CudaGraphModule.moe.name) for m in modules),
            "--cuda-graph-modules", _shown(modules), "Dropless MoE graphs capture whole MoE "
            "layers; drop moe, moe_router and moe_preprocess (they graph the dispatcher in part)"),
           (not args.bf16, "--bf16", False,
            "The grouped experts run torch._grouped_mm, which takes bf16: add --bf16"))
    for flag, size in (("--hidden-size", args.hidden_size),
                       ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size)):
        if size % ROW_ALIGNMENT:
            fail(flag, size, "torch._grouped_mm needs rows of a multiple of 16 bytes: use a "
                             f"multiple of {ROW_ALIGNMENT} with --moe-dropless-graphs")
    return True


def check_moe_router_skew(args) -> None:
    """``--moe-router-skew``: a share of an MoE model's routed slots the router can reach."""
    skew = getattr(args, "moe_router_skew", 0.0)
    refuse((skew and args.num_experts is None, "--moe-router-skew", skew,
            "It biases MoE routers; add --num-experts or drop it"))
    if skew:  # the MoE module only where a skew is asked for
        from megatron.packed_model.moe import skew_error, skew_limit
        if not 0.0 < skew < skew_limit(args.num_experts, args.moe_router_topk):
            raise ValueError(skew_error(skew, args.num_experts, args.moe_router_topk) + ".")


def check_mla(args, model: str) -> None:
    """MLA on packed data (TE attention: check_attention): the fused yarn RoPE, MLA-only flags."""
    pattern = args.hybrid_layer_pattern or ""
    if not args.multi_latent_attention:
        refuse((model == "hybrid" and "+" in pattern, "--hybrid-layer-pattern", repr(pattern),
                "Its '+' layers are multi-latent attention layers; add --multi-latent-attention"),
               (args.mla_pad_v != "always", "--mla-pad-v", args.mla_pad_v,
                "It configures multi-latent attention; add --multi-latent-attention or drop it"))
        return
    from megatron.packed_model.mla_rope import head_size_rules
    query_head = args.qk_head_dim + args.qk_pos_emb_head_dim
    refuse(
        (args.rope_type == "rope" and args.packed_graph_impl != "none", "--rope-type", "rope",
         "MLA's unfused THD RoPE reads cu_seqlens back to the host, which graphs cannot "
         "capture; use yarn (with --rotary-scaling-factor 1 it rotates like plain RoPE)"),
        *head_size_rules(args),  # the fused RoPE kernels' head sizes
        (args.mla_pad_v == "never" and query_head == args.v_head_dim, "--mla-pad-v", "never",
         f"V already has the query head size ({query_head}), so nothing is padded; drop the flag"))


