"""The training loop: build model chunks, optimizer and data; train, evaluate, checkpoint.

Composes megatron-core components (DDP, get_megatron_optimizer, OptimizerParamScheduler,
the pipeline schedules from get_forward_backward_func, dist_checkpointing); packing is the
forward step's business and CUDA graphs the graph runtime's (megatron/packed_graphs/runtime.py),
which runs every iteration's schedule.
"""

import gc
import signal
import time
from contextlib import nullcontext
from functools import partial
from typing import Callable, List, Optional

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron.packed_training.arguments import args_to_dict, format_args
from megatron.packed_training.checkpointing import load_checkpoint, save_checkpoint
from megatron.packed_training.config import (
    ddp_config_from_args,
    optimizer_config_from_args,
    transformer_config_from_args,
)
from megatron.packed_training.datasets.builder import (
    build_datasets,
    build_iteration_reader,
    describe_packing,
)
from megatron.packed_training.initialize import initialize_distributed, require_cuda, set_seeds
from megatron.packed_training.metrics import IntervalTimer, MetricsLogger, MoELosses, wandb_run_settings
from megatron.packed_training.profiling import StepProfiler
from megatron.packed_graphs.core_patches import apply_core_patches
from megatron.packed_graphs.moe_rerun import MoEOverflowRerun
from megatron.packed_graphs.optimizer_graph import OptimizerGraph
from megatron.packed_graphs.runtime import GraphRuntime


def print_rank_0(*args) -> None:
    if torch.distributed.get_rank() == 0:
        print(*args, flush=True)


def build_model(args, config, model_provider: Callable) -> List[torch.nn.Module]:
    """One DDP-wrapped chunk per virtual pipeline stage (a list of one without VPP)."""
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = model_provider(
            args, config,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        )
        chunk.model_type = ModelType.encoder_or_decoder
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunk.cuda(torch.cuda.current_device())
        if args.bf16:
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    num_params = sum(p.numel() for c in chunks for p in c.parameters())
    print(f" > number of parameters on (tensor, pipeline) model parallel rank "
          f"({parallel_state.get_tensor_model_parallel_rank()}, "
          f"{parallel_state.get_pipeline_model_parallel_rank()}): {num_params}", flush=True)
    ddp_config = ddp_config_from_args(args)
    return [
        DistributedDataParallel(config, ddp_config, module=chunk,
                                disable_bucketing=(i > 0))  # Megatron: bucket only chunk 0
        for i, chunk in enumerate(chunks)
    ]


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """megatron-core's scheduler, counted in samples as Megatron counts them."""
    gbs = args.global_batch_size
    decay_steps = args.lr_decay_iters * gbs
    # --lr-warmup-fraction: a fraction of the decay samples, as Megatron computes it.
    warmup_steps = (args.lr_warmup_iters * gbs if args.lr_warmup_fraction is None
                    else args.lr_warmup_fraction * decay_steps)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=(args.lr_wsd_decay_iters * gbs) if args.lr_wsd_decay_iters else None,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def _reduce_loss(losses_reduced: list) -> Optional[torch.Tensor]:
    """Token-weighted mean loss over micro-batches and data-parallel ranks, as a 0-dim CUDA
    tensor (not read on the host: the loop reads it when it logs). None off the last stage."""
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    total = torch.stack([x["lm loss"] for x in losses_reduced]).sum(dim=0)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return total[0] / total[1].clamp(min=1)


def _to_float(value) -> float:
    """A logged scalar (tensor, number or None) on the host; reading a CUDA tensor syncs."""
    return float("nan") if value is None else float(value)


def _run_schedule(args, forward_step, micro_batches, *, model, forward_only: bool):
    """Run the schedule over ``micro_batches`` (one list per model chunk)."""
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for batches in micro_batches],
        model=model,
        num_microbatches=len(micro_batches[0]),
        # THD: the micro-batch's rows travel between stages as one [mbs * seq, 1, h] stream.
        seq_length=args.micro_batch_size * args.seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
    )


def _zero_grads(model, optimizer) -> None:
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def train_step(args, graphs: GraphRuntime, forward_step, micro_batches, model, optimizer,
               scheduler, global_batch_size: int, moe_rerun: Optional[MoEOverflowRerun] = None):
    """One optimizer step over this rank's ``micro_batches`` (one list per model chunk) of a
    ``global_batch_size``-sample iteration.

    Returns ``(lm_loss, grad_norm, num_zeros, stats)``. Nothing here waits for the GPU
    except ``moe_rerun``'s one read per iteration, the graph health check's at a due
    iteration's end and the captures (once per run); the full-iteration ranks' agreement is a
    host all-reduce (Gloo). lm_loss (None off the last stage) and grad_norm are CUDA tensors
    (grad_norm graph-owned under --optimizer-cuda-graph: the next step overwrites it), read
    only when logged; stats are the graph runtime's host counters of the iteration.
    """
    _zero_grads(model, optimizer)
    schedule = partial(_run_schedule, args, model=model, forward_only=False)

    def rerun(eager):
        _zero_grads(model, optimizer)
        return step.rerun(eager, schedule)

    # The iteration's micro-batches are read up front so the graph runtime can plan them all
    # before the schedule starts.
    with graphs.iteration(micro_batches, forward_step) as step:
        losses_reduced = step.run(schedule)
        if moe_rerun is not None:  # --moe-capacity-overflow rerun: no token stays dropped
            losses_reduced, _ = moe_rerun.after_forward_backward(losses_reduced, rerun)
        update_successful, grad_norm, num_zeros = optimizer.step()
    if update_successful:
        scheduler.step(increment=global_batch_size)
    return _reduce_loss(losses_reduced), grad_norm, num_zeros, step.stats


@torch.no_grad()
def evaluate(args, graphs: GraphRuntime, forward_step, read_valid, model):
    """Validation loss over ``--eval-iters`` iterations, and their summed runtime counters."""
    for chunk in model:
        chunk.eval()
    losses, stats = [], {}
    for _ in range(args.eval_iters):
        with graphs.iteration(read_valid(args.num_microbatches), forward_step,
                              training=False) as step:
            losses += step.run(partial(_run_schedule, args, model=model, forward_only=True))
        stats = {key: stats.get(key, 0) + value for key, value in step.stats.items()}
    for chunk in model:
        chunk.train()
    return _to_float(_reduce_loss(losses)), stats


class ManualGC:
    """--manual-gc: Python's automatic garbage collection off for the run, one collection
    now and one after every ``interval``-th iteration (0: none), so that no collection pause
    lands inside a step's launches. ``close`` turns automatic collection back on."""

    def __init__(self, interval: int):
        self.interval = interval
        gc.disable()
        gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect()

    def close(self) -> None:
        gc.enable()


class ExitDeadline:
    """--exit-duration-in-mins: whether the run has used its minutes, decided alike on every
    rank. ``passed`` is called at log points only: it all-reduces one flag (the slowest
    rank's clock decides) and reads it back, a host sync the log line pays anyway."""

    def __init__(self, minutes: float, start: float, clock: Callable[[], float] = time.time):
        self.minutes, self.start, self.clock = minutes, start, clock

    def elapsed_minutes(self) -> float:
        return (self.clock() - self.start) / 60

    def passed(self) -> bool:
        return on_any_rank(self.elapsed_minutes() >= self.minutes)


class ExitSignal:
    """--exit-signal-handler: whether any rank has received ``sig`` (--exit-signal), decided
    alike on every rank. The handler only records the signal; ``received`` is called at log
    points and all-reduces the record, as `ExitDeadline.passed` does. Install from the main
    thread (Python runs signal handlers there); ``close`` puts the previous handler back."""

    def __init__(self, sig: signal.Signals):
        self.sig, self.seen = sig, False
        self._previous = signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        self.seen = True

    def received(self) -> bool:
        return on_any_rank(self.seen)

    def close(self) -> None:
        signal.signal(self.sig, self._previous)


def on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank: one all-reduce and a read back (a host sync; call
    it where the step waits for the GPU anyway). The same answer on every rank, so all leave
    the training loop at the same iteration."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        backend = torch.distributed.get_backend()
        value = torch.tensor([float(flag)], device="cuda" if backend == "nccl" else "cpu")
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        flag = bool(value.item())
    return flag


def _configure_schedule_hooks(config, model, optimizer) -> None:
    """The hooks megatron-core's schedules call (gradient sync, loss scaling)."""
    config.no_sync_func = [chunk.no_sync for chunk in model]
    if len(model) == 1:
        config.no_sync_func = config.no_sync_func[0]
    # megatron-core's own: it scales by the token count on the device, without a host sync.
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss


def _save(args, model, optimizer, scheduler, iteration: int, consumed_samples: int) -> None:
    """A checkpoint of ``iteration`` under --save, without what --no-save-optim and
    --no-save-rng leave out."""
    save_checkpoint(args.save, iteration, model, optimizer, scheduler, consumed_samples,
                    args_to_dict(args), with_optimizer=not args.no_save_optim,
                    with_rng=not args.no_save_rng)


def pretrain(args, model_provider: Callable, forward_step,
             packed_rows: dict | None = None, iteration_hook: Callable | None = None) -> dict:
    """Train ``args.train_iters`` iterations. Returns the last iteration's metrics record.

    ``forward_step``: stages and runs micro-batches for the graph runtime (packed_step.py).
    ``packed_rows``: rows of data files packed already (the data check's, by path).
    ``iteration_hook(iteration)``: a context manager entered around each training
    iteration's step (1-based number; tools/find_host_syncs.py watches one)."""
    start = time.time()  # --exit-duration-in-mins counts from here, as Megatron's does
    initialize_distributed(args)
    patches = apply_core_patches()
    set_seeds(args.seed, args.deterministic_mode, args.te_rng_tracker)
    print_rank_0(format_args(args))
    if args.megatron_flags_without_effect:
        print_rank_0(" > Megatron flags with no effect here: "
                     + "; ".join(args.megatron_flags_without_effect))
    print_rank_0(" > megatron-core patches: " + ", ".join(
        f"{name} ({state})" for name, state in patches.items()))
    config = transformer_config_from_args(args)

    GraphRuntime.prepare(args)  # before DDP
    model = build_model(args, config, model_provider)
    optimizer = get_megatron_optimizer(optimizer_config_from_args(args), model)
    scheduler = build_scheduler(args, optimizer)
    _configure_schedule_hooks(config, model, optimizer)
    moe_rerun = MoEOverflowRerun.from_args(args, model)  # before any capture; None unless asked
    # The graph health check's passes are not the iteration's: the rerun monitor skips them.
    graphs = GraphRuntime.from_args(args, model, config,
                                    check_guards=[moe_rerun.suspended] if moe_rerun else [])
    print_rank_0(f" > {graphs.describe()}")
    # --optimizer-cuda-graph: optimizer.step becomes one CUDA graph after the warm-up.
    if optimizer_graph := OptimizerGraph.install(args, optimizer, graphs):
        print_rank_0(f" > {optimizer_graph.describe()}")

    iteration, consumed_samples = 0, 0
    if args.load:
        iteration, consumed_samples = load_checkpoint(
            args.load, model, optimizer, scheduler, load_optim=not args.no_load_optim,
            load_rng=not args.no_load_rng, finetune=args.finetune)

    train_ds, valid_ds, stats = build_datasets(args, packed_rows)
    if stats is not None:
        print_rank_0(f" > packed training data: {describe_packing(stats)}")
    # Every pipeline stage and virtual chunk reads the same micro-batch sequence itself:
    # the packed metadata (cu_seqlens) is needed on every stage.
    read_train = build_iteration_reader(train_ds, consumed_samples, args, len(model))
    read_valid = None
    if valid_ds is not None and args.eval_interval > 0:
        read_valid = build_iteration_reader(valid_ds, 0, args, len(model), cycle=True)

    save = partial(_save, args, model, optimizer, scheduler)
    logger = MetricsLogger(args.metrics_file, args.tensorboard_dir, args.train_iters,
                           wandb_run_settings(args),
                           tensorboard_queue_size=args.tensorboard_queue_size,
                           validation_ppl=args.log_validation_ppl_to_tensorboard)
    profiler = StepProfiler(args.profile, args.profile_step_start, args.profile_step_end,
                           args.profile_trace_dir)
    record, saved = {}, False
    print_rank_0(f" > training from iteration {iteration} to {args.train_iters}")
    torch.cuda.reset_peak_memory_stats()
    # No per-iteration sync: the host queues the next iteration while the GPU finishes this
    # one. Times are per log interval (Megatron's "elapsed time per iteration"), measured
    # up to the log point, which waits for the GPU when it reads the loss.
    interval = IntervalTimer()
    manual_gc = ManualGC(args.manual_gc_interval) if args.manual_gc else None
    deadline = (ExitDeadline(args.exit_duration_in_mins, start)
                if args.exit_duration_in_mins is not None else None)
    exit_signal = (ExitSignal(signal.Signals[args.exit_signal])
                   if args.exit_signal_handler else None)
    moe_losses = MoELosses(args, model)  # MoE aux losses and drops, read at log points only
    while iteration < args.train_iters:
        profiler.begin(iteration + 1)
        # --rampup-batch-size grows the batch with the samples consumed (megatron-core).
        update_num_microbatches(consumed_samples, consistency_check=True)
        num_microbatches, batch = get_num_microbatches(), get_current_global_batch_size()
        micro_batches = read_train(num_microbatches)
        with iteration_hook(iteration + 1) if iteration_hook else nullcontext():
            lm_loss, grad_norm, num_zeros, stats = train_step(
                args, graphs, forward_step, micro_batches, model, optimizer, scheduler, batch,
                moe_rerun)
        iteration += 1
        if manual_gc:
            manual_gc.after_step(iteration)
        moe_losses.after_step(num_microbatches, iteration)
        consumed_samples += batch
        # Dynamic-CP samples differ in length; the reader counts their positions.
        positions = micro_batches[0][0].get("iteration_positions", batch * args.seq_length)
        interval.add(batch, positions, stats | profiler.finish(iteration))
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            lm_loss = _to_float(lm_loss)  # waits for this iteration's GPU work
            record = {
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "global_batch_size": batch,
                "lm_loss": lm_loss,
                **moe_losses.read(),
                "grad_norm": _to_float(grad_norm),
                "num_zeros": int(num_zeros) if num_zeros is not None else 0,
                "learning_rate": _to_float(optimizer.param_groups[0]["lr"]),  # may be a tensor
                **interval.timing(),
                "mem_allocated_bytes": torch.cuda.memory_allocated(),
                "mem_max_allocated_bytes": torch.cuda.max_memory_allocated(),
                "mem_reserved_bytes": torch.cuda.memory_reserved(),
                "extra_log": interval.stats,
            }
            logger.log_train(record)
            interval.restart()
        if read_valid and iteration % args.eval_interval == 0:
            logger.log_valid(iteration, *evaluate(args, graphs, forward_step, read_valid, model))
            interval.restart()
        saved = args.save and args.save_interval and iteration % args.save_interval == 0
        if saved:
            save(iteration, consumed_samples)
            interval.restart()
        if args.exit_interval and iteration % args.exit_interval == 0:
            print_rank_0(f" exiting after iteration {iteration} (--exit-interval)")
            break
        if deadline and iteration % args.log_interval == 0 and deadline.passed():
            print_rank_0(f" exiting after iteration {iteration} (--exit-duration-in-mins "
                         f"{args.exit_duration_in_mins:g}: {deadline.elapsed_minutes():.1f} "
                         "minutes)")
            break
        if exit_signal and iteration % args.log_interval == 0 and exit_signal.received():
            print_rank_0(f" exiting after iteration {iteration} (--exit-signal-handler: "
                         f"{args.exit_signal} received)")
            break
    if exit_signal:
        exit_signal.close()
    if args.save and not saved:
        save(iteration, consumed_samples)
    if moe_rerun is not None and args.moe_router_load_file:
        moe_rerun.write_router_loads(args.moe_router_load_file)  # for tools/capacity_advisor.py
    logger.close()
    if manual_gc:
        manual_gc.close()
    return record


def run_pretraining(model: str, model_provider: Callable, script: str, argv=None) -> None:
    """Entry point of pretrain_gpt.py / pretrain_mamba.py: parse, check the data (rank 0),
    check for CUDA, train.

    ``model`` is 'gpt' or 'hybrid'; hybrid models carry Mamba's per-token ``seq_idx``. A data
    problem exits with code 1 and its message (``<script>: error: ...``), before any GPU work.
    """
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.datasets.preflight import run_data_check
    from megatron.packed_training.packed_step import PackedForwardStep

    args = parse_args(argv, model=model)
    try:
        check = run_data_check(args)  # rank 0 only, before distributed start-up and the GPU
    except ValueError as err:
        raise SystemExit(f"{script}: error: {err}") from None
    require_cuda(script)
    pretrain(args, model_provider,
             PackedForwardStep.from_args(args, with_seq_idx=model == "hybrid"),
             packed_rows=check.rows if check else None)
