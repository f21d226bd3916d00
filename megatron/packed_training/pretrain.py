"""``pretrain_gpt.py`` / ``pretrain_mamba.py``: Megatron-LM's own ``pretrain()`` (the megatron-core
wheel's ``megatron.training``) with the fork's model, data and forward step, and the graph
runtime entered through the loop's one install step (training_loop.route_training_loop, which
docs/architecture.md lists with every name it rebinds).

    args  = parse_args_or_exit(model, script, dump=held)  # Megatron-LM's parser, fork's flags
    check = run_data_check(args)              # rank 0, before any GPU work
    require_cuda(script)                      # then the GPU; hybrid: then the Mamba kernels
    print(held.getvalue())                    # Megatron-LM's argument dump: every check passed
    pretrain(container, packed data provider, ModelType.encoder_or_decoder, PackedForwardStep,
             model_provider=<the fork's spec>)   # train(), evaluate(), checkpoints: upstream's

`PackedGraphRun` is built once the model and optimizer exist (training_loop.route_training_loop):
the `GraphRuntime`, the MoE overflow monitor and the optimizer graph; its ``wrap`` puts a
`GraphRuntimeSchedule` around megatron-core's schedule for every ``train()`` and
``evaluate()`` iteration.
"""

import io
import sys
from functools import partial
from typing import Callable


def model_provider(build: Callable, pre_process=True, post_process=True, vp_stage=None,
                   config=None, pg_collection=None):
    """Megatron-LM's ``model_provider`` contract around the script's ``build(args, config,
    pre_process, post_process, vp_stage)``."""
    from megatron.training import get_args

    from megatron.packed_upstream import graph_engine
    from megatron.packed_training.config import transformer_config_from_args

    args = get_args()
    model = build(args, config or transformer_config_from_args(args), pre_process=pre_process,
                  post_process=post_process, vp_stage=vp_stage)
    # After the build (megatron-core's graph manager may switch streams in it), and here, not
    # around DDP: get_model wraps DDP in a stream scope whose exit would undo the switch.
    graph_engine.use_side_stream()
    return model


def packed_data_provider(packed_rows: dict | None):
    """Megatron-LM's ``train_valid_test_datasets_provider`` for packed rows: iterators of this
    rank's micro-batch dicts (``--dataloader-type external``; under dynamic CP, of this rank's
    turns per iteration), every rank its own (the packed metadata is needed on every stage),
    resuming at the consumed samples of a loaded checkpoint. ``packed_rows``: the data check's
    rows (rank 0), not read again."""
    built = {}

    def provider(num_samples, vp_stage=None):
        from megatron.core import parallel_state
        from megatron.training import get_args, print_rank_0

        from megatron.packed_training.datasets.builder import (
            build_data_iterator,
            build_datasets,
            build_rank_iterators,
            describe_balance,
            describe_packing,
            build_test_dataset,
        )
        from megatron.packed_training.datasets.sources import pack_data

        args = get_args()
        rank = parallel_state.get_data_parallel_rank()
        size = parallel_state.get_data_parallel_world_size()
        if not built:  # one packing for every virtual pipeline chunk
            packed = packed_rows
            if packed is None and not args.mock_data:  # ranks but the first: pack it here
                packed = pack_data(args, with_test=bool(args.eval_iters))
            built["train"], built["valid"], stats = build_datasets(args, packed)
            built["test"] = build_test_dataset(args, packed)
            if stats is not None:
                print_rank_0(f" > packed training data: {describe_packing(stats)}")
            if size > 1 and args.rank == 0 and not args.mock_data and not args.dynamic_cp_sizes:
                print(f" > {describe_balance(built['train'], args, size)}", flush=True)
        train, valid = build_rank_iterators(built["train"], built["valid"], args, rank, size)
        test = None if built["test"] is None else build_data_iterator(
            built["test"], 0, args.micro_batch_size, rank, size)
        return train, valid, test

    provider.is_distributed = True
    return provider


class PackedGraphRun:
    """What the fork adds to one Megatron-LM run, built once the model and optimizer exist (and a
    checkpoint is loaded): the graph runtime, the MoE overflow monitor, the optimizer graph and
    the runtime's log. Megatron-LM's loop reaches it through `wrap`
    (packed_upstream/training_loop.route_training_loop); `finish` runs after ``pretrain()``
    returns."""

    def __init__(self, args, log: bool = True):
        self.args = args
        self.runtime = self.moe_rerun = self.log = self.optimizer = None
        # The graph package's settings (config.graph_settings_from_args), built once with the
        # runtime: megatron.packed_graphs reads them, never ``args``.
        self.settings = None
        self.step_wrapped = False  # train()'s schedule comes first; evaluate() gets its own
        # The runtime's log line and metrics file (RuntimeLog); the library API (rl/policy.py)
        # reports its statistics itself.
        self.with_log = log

    def __call__(self, model, optimizer, scheduler):
        from megatron.core.utils import get_model_config
        from megatron.training import print_rank_0

        from megatron.packed_graphs.moe_rerun import MoEOverflowRerun
        from megatron.packed_graphs.optimizer_graph import OptimizerGraph
        from megatron.packed_graphs.runtime import GraphRuntime
        from megatron.packed_training.config import graph_settings_from_args
        from megatron.packed_training.metrics import RuntimeLog

        # Here, after the model, optimizer and any checkpoint's arguments: what the run uses.
        settings = self.settings = graph_settings_from_args(self.args)
        self.moe_rerun = MoEOverflowRerun.from_settings(settings, model)
        guards = [self.moe_rerun.suspended] if self.moe_rerun else []
        self.runtime = GraphRuntime.from_settings(settings, model, get_model_config(model[0]),
                                                  check_guards=guards)
        print_rank_0(f" > {self.runtime.describe()}")
        if graph := OptimizerGraph.install(settings, optimizer, self.runtime):
            print_rank_0(f" > {graph.describe()}")
        self.optimizer = optimizer
        self.log = RuntimeLog(self.args, model) if self.with_log else None
        return self.wrap

    def wrap(self, schedule):
        """megatron-core's ``schedule`` behind the graph runtime (packed_graphs/schedule.py).
        The first one is train()'s: its iterations close after ``optimizer.step``. Megatron-LM
        asks for a schedule once per ``train()`` and once per ``evaluate()`` pass, so any
        evaluation the log holds has ended: it is reported before the next one adds to it."""
        from megatron.packed_upstream import megatron_optimizer
        from megatron.packed_graphs.schedule import GraphRuntimeSchedule

        if self.log is not None:
            self.log.report_evaluation()

        settings = self.settings
        seam = GraphRuntimeSchedule(self.runtime, schedule,
                                    stream_length=settings.micro_batch_size * settings.seq_length,
                                    moe_rerun=self.moe_rerun, optimizer=self.optimizer,
                                    rank_iterations=settings.cp_banks is not None)
        if not self.step_wrapped:
            megatron_optimizer.install_optimizer_step(
                self.optimizer, seam.wrap_optimizer_step(self.optimizer.step))
            self.step_wrapped = True
        if self.log is not None:
            seam.before_iteration.append(self.log.begin_iteration)
            seam.listeners.append(self.log)
        return seam

    def finish(self) -> None:
        """After training: the last evaluation's record, the measured router loads
        (``--moe-router-load-file``, for tools/capacity_advisor.py)."""
        if self.log is not None:
            self.log.close()
        if self.moe_rerun is not None and self.args.moe_router_load_file:
            self.moe_rerun.write_router_loads(self.args.moe_router_load_file)


def run_pretraining(model: str, build: Callable, script: str, argv=None) -> None:
    """Entry point of pretrain_gpt.py (``model`` 'gpt') and pretrain_mamba.py ('hybrid')."""
    from megatron.packed_training.arguments import parse_args_or_exit

    # First: its messages come before imports. Megatron-LM's argument dump waits for the
    # start-up checks, so that a bad data file or a missing GPU is the first thing printed.
    argument_dump = io.StringIO()
    args = parse_args_or_exit(model, script, argv, dump=argument_dump)
    from megatron.packed_training.datasets.preflight import run_data_check
    from megatron.packed_training.initialize import require_cuda, require_mamba_kernels

    try:
        check = run_data_check(args)  # rank 0 only, before distributed start-up and the GPU
        require_cuda(script)  # exits 1 itself
        if model == "hybrid":  # after the GPU: mamba-ssm is built for one
            require_mamba_kernels()
    except ValueError as err:  # the data or the kernels: status 1, as a missing GPU
        print(f"{script}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    print(argument_dump.getvalue(), end="", flush=True)

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.global_vars import set_global_variables

    from megatron.packed_upstream.patches import apply_core_patches
    from megatron.packed_upstream.training_loop import (
        build_hybrid_cp_groups_at_start_up,
        route_training_loop,
    )
    from megatron.packed_training.packed_step import PackedForwardStep

    set_global_variables(args)  # the tokenizer, micro-batch calculator, writers, timers
    patches = apply_core_patches()
    if args.rank == 0:
        print(" > megatron-core patches: " + ", ".join(
            f"{name} ({state})" for name, state in patches.items()), flush=True)
    run = PackedGraphRun(args)
    route_training_loop(run, capturable_optimizer=args.packed_optimizer_graph)
    if args.dynamic_cp_groups:  # a --dynamic-cp-sizes size above 1
        build_hybrid_cp_groups_at_start_up()
    if args.rank == 0:
        for note in args.packed_notes:
            print(f" > {note}", flush=True)
    forward_step = PackedForwardStep.from_args(args, with_seq_idx=model == "hybrid")
    pretrain(pretrain_cfg_container_from_args(args),
             packed_data_provider(check.rows if check else None),
             ModelType.encoder_or_decoder, forward_step,
             model_provider=partial(model_provider, build))
    run.finish()
