"""``pretrain_gpt.py`` / ``pretrain_mamba.py``: Megatron-LM's own ``pretrain()`` (the megatron-core
wheel's ``megatron.training``) with the fork's model, data and forward step, and the graph
runtime at the loop's one seam.

    args  = parse_packed_args(model, script)     # Megatron-LM's parser + the fork's flags
    check = run_data_check(args)                  # rank 0, before any GPU work
    pretrain(container, packed data provider, ModelType.encoder_or_decoder, PackedForwardStep,
             model_provider=<the fork's spec>)   # train(), evaluate(), checkpoints: upstream's

`install_graph_runtime` runs once the model and optimizer exist (core_patches.route_training_loop):
it builds the `GraphRuntime`, the MoE overflow monitor and the optimizer graph, and returns the
`GraphRuntimeSchedule` that wraps megatron-core's schedule for every ``train()`` and
``evaluate()`` iteration.
"""

import argparse
import sys
from functools import partial
from typing import Callable

# Megatron-LM's defaults for what its parser leaves unset and a packed launch line may omit.
# (validate_args applies them to values still None.)
UPSTREAM_DEFAULTS = {"eval_interval": 1000}


def _error(script: str, err: BaseException) -> SystemExit:
    """A one-line ``<script>: error: <message>`` (exit 2), as argparse reports a bad flag."""
    print(f"{script}: error: {err}", file=sys.stderr, flush=True)
    return SystemExit(2)


def parse_packed_args(model: str, script: str, argv=None) -> argparse.Namespace:
    """Megatron-LM's arguments with the fork's (extra_args.py), checked by upstream's
    ``validate_args`` and the fork's rules. A bad value exits with status 2 and one line."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron.packed_training.extra_args import (
        add_packed_args,
        prepare_upstream_args,
        validate_packed_args,
    )

    if argv is not None:  # upstream parses sys.argv
        sys.argv = [script, *argv]
    args = parse_args(extra_args_provider=add_packed_args)
    try:
        prepare_upstream_args(args, model)
        if args.tokenizer_type is None:  # pre-tokenized data: ids below --vocab-size
            args.tokenizer_type = "NullTokenizer"
            args.vocab_size = args.vocab_size or 32000
        # The fork's data provider returns the iterators; upstream builds no data loader.
        args.dataloader_type = "external"
        validate_args(args, UPSTREAM_DEFAULTS)
        validate_packed_args(args, model)
    except (ValueError, AssertionError) as err:
        raise _error(script, err) from None
    return args


def graph_args(args) -> argparse.Namespace:
    """``args`` as the graph runtime reads them: the user's graph flags (extra_args module
    doc) and this run's micro-batch count."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return argparse.Namespace(**{
        **vars(args), "cuda_graph_impl": args.packed_graph_impl,
        "optimizer_cuda_graph": args.packed_optimizer_graph,
        "cuda_graph_modules": args.packed_cuda_graph_modules,
        "num_microbatches": get_num_microbatches()})


def packed_transformer_config(args):
    """megatron-core's TransformerConfig from Megatron-LM's own ``core_transformer_config_from_args``,
    in the fork's config class, with what the fork's layers read set on top."""
    from megatron.core.transformer.enums import CudaGraphModule
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron.packed_training.config import PackedMLATransformerConfig, PackedTransformerConfig
    from megatron.packed_training.extra_args import uses_te_attention

    cls = PackedMLATransformerConfig if args.multi_latent_attention else PackedTransformerConfig
    config = core_transformer_config_from_args(args, cls)
    impl = args.packed_graph_impl
    # The runtime's full-iteration graph is not megatron-core's: the layers carry local graphs
    # for the iterations it misses. megatron-core's warm-up count means passes inside a capture;
    # --cuda-graph-warmup-steps counts eager iterations before it (the runtime's).
    config.cuda_graph_impl = "local" if impl == "full_iteration" else impl
    config.cuda_graph_warmup_steps = 1
    config.cuda_graph_modules = [CudaGraphModule[name] for name in args.packed_cuda_graph_modules]
    config.cuda_graph_granularity = args.cuda_graph_granularity
    # TE's fused THD RoPE is the sync-free one on the TE path (packed_graphs/specs.py).
    config.apply_rope_fusion = uses_te_attention(args)
    if args.multi_latent_attention:
        config.mla_pad_v = args.mla_pad_v == "always"
    return config


def model_provider(build: Callable, pre_process=True, post_process=True, vp_stage=None,
                   config=None, pg_collection=None):
    """Megatron-LM's ``model_provider`` contract around the script's ``build(args, config,
    pre_process, post_process, vp_stage)``."""
    from megatron.training import get_args

    from megatron.packed_graphs.runtime import GraphRuntime

    args = get_args()
    GraphRuntime.prepare(graph_args(args))  # TE graph capture: the process on a side stream
    return build(args, config or packed_transformer_config(args), pre_process=pre_process,
                 post_process=post_process, vp_stage=vp_stage)


def packed_data_provider(packed_rows: dict | None):
    """Megatron-LM's ``train_valid_test_datasets_provider`` for packed rows: iterators of this
    rank's micro-batch dicts (``--dataloader-type external``), every rank its own (the packed
    metadata is needed on every stage), resuming at the consumed samples of a loaded checkpoint.
    ``packed_rows``: the data check's rows (rank 0), not read again."""
    built = {}

    def provider(num_samples, vp_stage=None):
        from megatron.core import parallel_state
        from megatron.training import get_args, print_rank_0

        from megatron.packed_training.datasets.builder import (
            build_data_iterator,
            build_datasets,
            describe_packing,
        )

        args = get_args()
        if not built:  # one packing for every virtual pipeline chunk
            built["train"], built["valid"], stats = build_datasets(args, packed_rows)
            if stats is not None:
                print_rank_0(f" > packed training data: {describe_packing(stats)}")
        rank = parallel_state.get_data_parallel_rank()
        size = parallel_state.get_data_parallel_world_size()
        train = build_data_iterator(built["train"], args.consumed_train_samples,
                                    args.micro_batch_size, rank, size,
                                    num_workers=args.num_workers)
        valid = None
        if built["valid"] is not None:
            valid = build_data_iterator(built["valid"], 0, args.micro_batch_size, rank, size,
                                        cycle=True)
        return train, valid, None

    provider.is_distributed = True
    return provider


def install_graph_runtime(args, model, optimizer, scheduler):
    """Called once the model and optimizer exist (and a checkpoint is loaded): the graph
    runtime, the MoE overflow monitor, the optimizer graph, the runtime's log; returns the
    wrapper of megatron-core's schedule (core_patches.route_training_loop)."""
    from megatron.core.utils import get_model_config
    from megatron.training import print_rank_0

    from megatron.packed_graphs.moe_rerun import MoEOverflowRerun
    from megatron.packed_graphs.optimizer_graph import OptimizerGraph
    from megatron.packed_graphs.runtime import GraphRuntime
    from megatron.packed_graphs.schedule import GraphRuntimeSchedule
    from megatron.packed_training.metrics import RuntimeLog

    view = graph_args(args)
    config = get_model_config(model[0])
    moe_rerun = MoEOverflowRerun.from_args(view, model)
    runtime = GraphRuntime.from_args(view, model, config,
                                     check_guards=[moe_rerun.suspended] if moe_rerun else [])
    print_rank_0(f" > {runtime.describe()}")
    if graph := OptimizerGraph.install(view, optimizer, runtime):
        print_rank_0(f" > {graph.describe()}")
    seams = []

    def wrap(schedule):
        seam = GraphRuntimeSchedule(runtime, schedule,
                                    stream_length=args.micro_batch_size * args.seq_length,
                                    moe_rerun=moe_rerun, optimizer=optimizer)
        if not seams:  # train()'s schedule: its optimizer step closes each iteration
            optimizer.step = seam.wrap_optimizer_step(optimizer.step)
        seam.listeners.append(log)
        seams.append(seam)
        return seam

    log = RuntimeLog(args, model)
    return wrap


def run_pretraining(model: str, build: Callable, script: str, argv=None) -> None:
    """Entry point of pretrain_gpt.py (``model`` 'gpt') and pretrain_mamba.py ('hybrid')."""
    args = parse_packed_args(model, script, argv)
    from megatron.packed_training.datasets.preflight import run_data_check
    from megatron.packed_training.initialize import require_cuda

    try:
        check = run_data_check(args)  # rank 0 only, before distributed start-up and the GPU
    except ValueError as err:
        raise SystemExit(f"{script}: error: {err}") from None
    require_cuda(script)

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.global_vars import set_global_variables

    from megatron.packed_graphs.core_patches import apply_core_patches, route_training_loop
    from megatron.packed_training.packed_step import PackedForwardStep

    set_global_variables(args)  # the tokenizer, micro-batch calculator, writers, timers
    patches = apply_core_patches()
    if args.rank == 0:
        print(" > megatron-core patches: " + ", ".join(
            f"{name} ({state})" for name, state in patches.items()), flush=True)
    route_training_loop(partial(install_graph_runtime, args),
                        capturable_optimizer=args.packed_optimizer_graph)
    forward_step = PackedForwardStep.from_args(graph_args(args), with_seq_idx=model == "hybrid")
    pretrain(pretrain_cfg_container_from_args(args),
             packed_data_provider(check.rows if check else None),
             ModelType.encoder_or_decoder, forward_step,
             model_provider=partial(model_provider, build))
