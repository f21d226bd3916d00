"""Reaches into Megatron-LM's training layer (the wheel's ``megatron.training``: loop,
start-up, parser), for megatron-core 0.19.2 (`gate.PATCHED_VERSION`).

`route_training_loop` is the one install step that enters Megatron-LM's loop: it replaces
``setup_model_and_optimizer`` (to build the graph runtime once the model exists),
``get_forward_backward_func`` (to hand every iteration to the runtime),
``get_megatron_optimizer_config`` (a capturable optimizer for the optimizer graph),
``wrap_model_chunks_with_ddp`` (DDP on the process's stream), and the loop's per-iteration
host syncs where they are identities (``logical_and_across_model_parallel_group``,
``reduce_max_stat_across_model_parallel_group``, ``training_log``'s loss sums, the rerun
machine's flags, the exit-signal check). Installing it twice is installing it once.

Also: `skip_dataset_helper_build` (patch; the fork's datasets need no compiled helper),
`build_hybrid_cp_groups_at_start_up` (dynamic CP: megatron-core's hybrid DP x CP groups
without Megatron-LM's own hybrid CP), `size_moe_metrics_as_the_routers_do` and
`megatron_parser_flaws_fixed` (bare '%' in help texts, enum typos as usage errors).
"""

import argparse
import functools
import re
import dataclasses
from typing import Callable, Optional
import torch
from megatron.core.rerun_state_machine import RerunStateMachine

from megatron.packed_upstream.megatron_ddp import ddp_on_the_process_stream
from megatron.packed_upstream.gate import patch
from megatron.packed_upstream.megatron_optimizer import keep_loss_scale_on_host


UPSTREAM_REDUCE_ANY = RerunStateMachine._reduce_any


# A '%' in a help text: an escaped '%%', an argparse field such as '%(default)s', or bare.
_PERCENT = re.compile(r"%(?:%|\([a-z_]+\)[a-z])?")


def megatron_parser_flaws_fixed(parser: argparse.ArgumentParser) -> None:
    """Two flaws of Megatron-LM's parser, fixed on ``parser`` in place: some help texts hold a
    bare '%', on which argparse's ``--help`` fails; enum flags (``--attention-backend``,
    ``--exit-signal``) convert by name lookup, whose KeyError argparse does not catch, so a typo
    ended in a traceback instead of a usage error naming the choices."""
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = _PERCENT.sub(lambda m: "%%" if m.group() == "%" else m.group(),
                                       action.help)
        if callable(action.type) and not isinstance(action.type, type):
            action.type = _unknown_name_is_a_bad_value(action.type, action.choices)


def _unknown_name_is_a_bad_value(convert, choices):
    @functools.wraps(convert)  # argparse names the type in its other errors
    def convert_or_refuse(value):
        try:
            return convert(value)
        except KeyError:
            names = ", ".join(getattr(c, "name", str(c)) for c in choices or [])
            raise argparse.ArgumentTypeError(
                f"invalid value {value!r}" + (f" (use one of {names})" if names else ""))
    return convert_or_refuse


@dataclasses.dataclass
class _LoopRoute:
    """What the routed loop calls: set by the latest `route_training_loop`."""

    on_setup: Optional[Callable] = None
    capturable_optimizer: bool = False
    wrap: Optional[Callable] = None  # on_setup's answer, once the model exists


_ROUTE = _LoopRoute()


def route_training_loop(on_setup: Callable, capturable_optimizer: bool = False) -> None:
    """Put the fork's graph runtime into Megatron-LM's ``pretrain()``: the one install step.

    ``train()`` and ``evaluate()`` look up ``get_forward_backward_func`` in their module at call
    time and run every iteration through what it returns; ``pretrain()`` builds the model and
    optimizer through ``setup_model_and_optimizer``. So:

    * after ``setup_model_and_optimizer`` returns, ``on_setup(model, optimizer, scheduler)``
      builds the runtime and returns a callable ``wrap(schedule) -> schedule`` (e.g.
      `schedule.GraphRuntimeSchedule`);
    * ``get_forward_backward_func(...)`` then returns ``wrap(<megatron-core's schedule>)``;
      before the set-up (never, in ``pretrain``) megatron-core's own;
    * with ``capturable_optimizer`` the optimizer is built capturable
      (``OptimizerConfig.optimizer_cuda_graph``, for the fork's optimizer graph) while upstream's
      own ``--optimizer-cuda-graph`` wrapper stays off;
    * DDP is built on the stream the process runs on (`ddp_on_the_process_stream`);
    * every pipeline stage holds the MoE metrics at the routers' size
      (`size_moe_metrics_as_the_routers_do`);
    * the end of each iteration reads nothing back from the GPU where nothing needs reading
      (`all_model_parallel_ranks_updated`, `max_stat_across_model_parallel_ranks`,
      `keep_loss_scale_on_host`, `training_log_summing_losses_on_device`,
      `reduce_rerun_flags_on_host`, `check_exit_signal_on_host`).

    Installing again (a second `PackedPolicy`, a test) replaces ``on_setup`` and
    ``capturable_optimizer``; upstream's names are rebound once per process.

    Upstream's own graph wrappers (``FullCudaGraphWrapper``, ``TECudaGraphHelper``, the
    optimizer wrapper) key on ``args.cuda_graph_impl`` / ``args.optimizer_cuda_graph``, which
    the fork's entry keeps at "local"/"none" and False: every graph decision is the runtime's.
    """
    _ROUTE.on_setup, _ROUTE.capturable_optimizer, _ROUTE.wrap = (
        on_setup, capturable_optimizer, None)
    training_loop_routed()  # a @patch: installed once per process


@patch
def training_loop_routed() -> None:
    """The rebinds behind `route_training_loop` (installed once per process)."""
    import megatron.training.training as loop
    from megatron.core.utils import get_model_config
    from megatron.training import get_args

    upstream_setup = loop.setup_model_and_optimizer
    upstream_schedule = loop.get_forward_backward_func
    upstream_optimizer_config = loop.get_megatron_optimizer_config

    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = upstream_setup(*args, **kwargs)
        keep_loss_scale_on_host(optimizer)
        size_moe_metrics_as_the_routers_do(get_args(), get_model_config(model[0]))
        _ROUTE.wrap = _ROUTE.on_setup(model, optimizer, scheduler)
        return model, optimizer, scheduler

    def get_forward_backward_func(*args, **kwargs):
        schedule = upstream_schedule(*args, **kwargs)
        return schedule if _ROUTE.wrap is None else _ROUTE.wrap(schedule)

    def get_megatron_optimizer_config(args, *more, **kwargs):
        # Upstream copies args' fields into the config and derives per-parameter overrides
        # from it, so the flag is set on args for the duration of the call.
        if not _ROUTE.capturable_optimizer:
            return upstream_optimizer_config(args, *more, **kwargs)
        shown, args.optimizer_cuda_graph = args.optimizer_cuda_graph, True
        try:
            return upstream_optimizer_config(args, *more, **kwargs)
        finally:
            args.optimizer_cuda_graph = shown

    loop.setup_model_and_optimizer = setup_model_and_optimizer
    loop.get_forward_backward_func = get_forward_backward_func
    loop.get_megatron_optimizer_config = get_megatron_optimizer_config
    loop.wrap_model_chunks_with_ddp = ddp_on_the_process_stream(loop.wrap_model_chunks_with_ddp)
    loop.logical_and_across_model_parallel_group = all_model_parallel_ranks_updated
    loop.reduce_max_stat_across_model_parallel_group = max_stat_across_model_parallel_ranks
    loop.training_log = training_log_summing_losses_on_device(loop.training_log)
    reduce_rerun_flags_on_host()
    check_exit_signal_on_host()


def moe_metric_names(args) -> list:
    """The MoE metrics Megatron-LM's ``training_log`` reports and reduces, in its order."""
    balancing = args.moe_router_load_balancing_type  # a name or a list of names
    names = [name for name in ("load_balancing_loss", "seq_load_balancing_loss",
                               "global_load_balancing_loss")
             if name.replace("load_balancing_loss", "aux_loss") in balancing]
    return names + (["z_loss"] if args.moe_z_loss_coeff is not None else [])


def size_moe_metrics_as_the_routers_do(args, config) -> None:
    """Create Megatron-LM's MoE metrics on this rank at the size its routers record them.

    megatron-training 0.19.2's ``training_log`` reduces each MoE metric over the pipeline
    group, having created it where no router did at the size it passes: for a hybrid model,
    the number of MoE layers. The routers create it with one slot per layer
    (``config.num_layers`` plus MTP layers). A hybrid pipeline stage without an MoE layer
    (Nemotron-H at PP = 2: ``M*-`` | ``EM*``) then reduces a tensor of another size than
    its peer, and the run hangs at its first log line. Created here first, at the routers'
    size, every stage reduces the same shape; a router's own record sets its groups.
    """
    if args.num_experts is None:
        return
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    for name in moe_metric_names(args):
        tracker.ensure_initialized(name, config.num_layers + (config.mtp_num_layers or 0))


# Megatron-LM's train_step and training_log end every iteration with three host reads: whether
# the update succeeded on every model-parallel rank, the gradient norm's maximum over them
# (train_step) and the learning rate's (training_log), each a one-element tensor built on the
# GPU, all-reduced and read back; and train() reads the optimizer's loss scale, a CUDA tensor,
# every iteration. Each read waits for the whole step, so the GPU idles while the host plans
# the next iteration (docs/benchmarks.md). With a model-parallel group of one these reductions
# are identities, and without a loss scaler the scale is the constant 1: route_training_loop
# installs the two functions below, and the loss scale goes to the host after the set-up.
def _model_parallel_size(group) -> int:
    from megatron.core import parallel_state

    group = group if group is not None else parallel_state.get_model_parallel_group()
    return torch.distributed.get_world_size(group)


def all_model_parallel_ranks_updated(update_successful: bool, group=None) -> bool:
    """Upstream's ``logical_and_across_model_parallel_group`` without the device round trip in
    a model-parallel group of one (then it is ``update_successful``); upstream's otherwise."""
    if _model_parallel_size(group) == 1:
        return bool(update_successful)
    return _upstream_loop_utils()[0](update_successful, group=group)


def max_stat_across_model_parallel_ranks(stat, group=None):
    """Upstream's ``reduce_max_stat_across_model_parallel_group`` (the gradient norm, the zero
    count, the learning rate) without a host read where none is needed:

    * a model-parallel group of one: ``stat`` itself (a float or None), or the optimizer's
      CUDA gradient norm as a 0-dim tensor, which the log reads only when it prints it;
    * a CUDA tensor in a larger group: its maximum over the group as a 0-dim CUDA tensor (an
      all-reduce on the device; ranks without the statistic take upstream's path, which joins
      the same all-reduce with -1);
    * otherwise upstream's (a float: one all-reduce and a host read).
    """
    if _model_parallel_size(group) == 1:
        # 0-dim, so the log line's f"{grad_norm:.3f}" formats it (a 1-element tensor cannot)
        return stat.detach().reshape(()) if torch.is_tensor(stat) else stat
    if torch.is_tensor(stat) and stat.is_cuda:
        reduced = stat.detach().float().reshape(1).clone()
        torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX, group=group)
        return reduced.reshape(())
    return _upstream_loop_utils()[1](stat, group=group)


def _upstream_loop_utils():
    from megatron.training.utils import common_utils

    return (common_utils.logical_and_across_model_parallel_group,
            common_utils.reduce_max_stat_across_model_parallel_group)


def training_log_summing_losses_on_device(upstream_log: Callable) -> Callable:
    """Megatron-LM's ``training_log`` that adds the iteration's losses to the interval's sums
    without a host copy. Upstream evaluates ``torch.tensor([0.0], device='cuda')`` for every
    loss key of every iteration (the default of a ``dict.get``): a pageable host-to-device
    copy, which waits for the whole step. Here the sums start from ``torch.zeros`` on the
    device (a fill kernel) and the same additions run on the device, so the values are
    upstream's bitwise. Upstream still gets the iteration's losses where it reads them itself:
    a skipped iteration (its NaN check) and a TensorBoard/W&B iteration (the writers)."""
    import inspect

    from megatron.training.global_vars import get_args, get_tensorboard_writer

    signature = inspect.signature(upstream_log)

    def training_log(*positional, **keywords):
        call = signature.bind(*positional, **keywords)
        losses, sums = call.arguments["loss_dict"], call.arguments["total_loss_dict"]
        args, iteration = get_args(), call.arguments["iteration"]
        writes = (get_tensorboard_writer() is not None
                  and iteration % args.tensorboard_log_interval == 0)
        if losses and not call.arguments["skipped_iter"] and not writes:
            for key, loss in losses.items():
                total = sums.get(key)
                if total is None:
                    total = torch.zeros(1, dtype=torch.float, device=loss.device)
                sums[key] = total + loss
            call.arguments["loss_dict"] = {}
        return upstream_log(*call.args, **call.kwargs)

    training_log.__wrapped__ = upstream_log
    return training_log


@patch
def reduce_rerun_flags_on_host() -> None:
    """Megatron-LM's rerun state machine all-reduces its request flags over the world after
    every forward-backward (``RerunStateMachine._reduce_any``) as one-element CUDA tensors
    read back on the host: two device syncs per iteration in its default ``validate_results``
    mode. The flags are host booleans, so they are reduced on the host: as they are in a
    world of one, else over a Gloo group of the world (a host all-reduce, no device sync)."""
    RerunStateMachine._reduce_any = any_rank_requested


def any_rank_requested(machine, value):
    """``RerunStateMachine._reduce_any`` on the host: whether any rank's flag is set, for one
    flag or a list of flags (a tuple back), as upstream returns them."""
    flags = [bool(flag) for flag in (value if isinstance(value, list) else [value])]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        counts = torch.tensor(flags, dtype=torch.int32)
        torch.distributed.all_reduce(counts, group=_host_world_group())
        flags = [count > 0 for count in counts.tolist()]
    return tuple(flags) if isinstance(value, list) else flags[0]


@patch
def check_exit_signal_on_host() -> None:
    """With ``--exit-signal-handler`` Megatron-LM asks every iteration whether any rank got the
    signal (``DistributedSignalHandler.signals_received``): each rank's flag goes into a CUDA
    tensor, is all-gathered and read back, a device sync per iteration. The flag is a host
    boolean, so it is gathered on the host (`signals_received_on_host`)."""
    from megatron.training.dist_signal_handler import DistributedSignalHandler

    DistributedSignalHandler.signals_received = signals_received_on_host


def signals_received_on_host(handler) -> list:
    """``DistributedSignalHandler.signals_received`` on the host: every rank's flag, in rank
    order (a Gloo all-gather over the world; a world of one: this rank's)."""
    received = bool(handler._signal_received)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [received]
    flags = [torch.zeros(1, dtype=torch.int32)
             for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(flags, torch.tensor([int(received)], dtype=torch.int32),
                                 group=_host_world_group())
    return [bool(flag.item()) for flag in flags]  # host tensors: no device sync


_HOST_WORLD_GROUP = []


def _host_world_group():
    """A Gloo group of the whole world, made at the first reduction (a collective every rank
    reaches at the same point: the rerun machine's reduction is one already)."""
    if not _HOST_WORLD_GROUP:
        _HOST_WORLD_GROUP.append(torch.distributed.new_group(backend="gloo"))
    return _HOST_WORLD_GROUP[0]


@patch
def skip_dataset_helper_build() -> str:
    """Megatron-LM's start-up runs ``make`` in megatron-core's datasets folder on rank 0 to
    build its C++ helpers, and exits when that fails; the wheel ships the helpers prebuilt
    and no Makefile, so ``make`` always fails. The fork's packed datasets never call them."""
    from megatron.core.datasets import utils as dataset_utils

    if not hasattr(dataset_utils, "compile_helpers"):
        return "not needed: megatron-core has no compile_helpers"
    dataset_utils.compile_helpers = lambda: None
    return "applied"


@patch
def build_hybrid_cp_groups_at_start_up() -> None:
    """Make Megatron-LM's start-up build megatron-core's hybrid DP x CP groups: aligned blocks
    of the data x context-parallel ranks of every power-of-two size, from which dynamic CP
    takes each micro-batch's CP group (dynamic_cp.dynamic_cp_group). Idempotent.

    ``initialize_megatron`` (in ``pretrain()``) builds the process groups in
    ``_initialize_distributed``, which passes ``args.hybrid_context_parallel`` on to
    ``parallel_state.initialize_model_parallel``: that field is True for the duration of the
    call only. Left on, it would also start upstream's own hybrid CP, another scheduler over
    another data format: ``validate_args`` wants ``--dataloader-type single`` with it,
    ``train()`` wraps the data iterator in ``HybridCPDataLoaderWrapper`` (which all-gathers and
    reroutes upstream's sub-samples), and the TransformerConfig field of the same name turns
    megatron-core's no-pipelining schedule into ``hybrid_context_parallel_forward_backward``.
    """
    from megatron.training import get_args
    from megatron.training import initialize as start_up

    upstream = start_up._initialize_distributed
    if getattr(upstream, "builds_hybrid_cp_groups", False):
        return

    def initialize_distributed(*positional, **keywords):
        args = get_args()
        shown, args.hybrid_context_parallel = args.hybrid_context_parallel, True
        try:
            return upstream(*positional, **keywords)
        finally:
            args.hybrid_context_parallel = shown

    initialize_distributed.builds_hybrid_cp_groups = True
    start_up._initialize_distributed = initialize_distributed

