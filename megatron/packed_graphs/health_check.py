"""The graph health check: every N training iterations one graphed micro-batch is replayed and
run eager, and the two passes' loss and gradient norm compared (``--cuda-graph-check-interval``).

A captured graph replays whatever its buffers and baked-in addresses hold. A buffer that
another graph wrote into, a stale address, a host value fixed at capture that has changed
since: none of these raises, the replay just computes something else. The check compares a
replay with the eager computation of the same micro-batch on the same weights.

`GraphHealthCheck` belongs to the graph runtime (runtime.py), which calls `run` when a due
training iteration's scope exits, after the caller's optimizer step:

1. **Which micro-batch.** The iteration's first graphed one; the runtime kept its host dict,
   which is staged again. A rank without a graphed micro-batch runs its first micro-batch
   eager in both passes and compares nothing, so every rank runs the same passes
   (collectives across data-parallel ranks, e.g. expert all-to-alls, stay matched).
2. **Two passes**, forward and backward, on the weights the optimizer step just wrote: the
   graph replayed (the micro-batch's plan in replay mode), then eager (`Reason.HEALTH_CHECK`).
   Each starts from the same RNG states and zeroed gradients, with the data-parallel
   gradient reduction held off (DDP ``no_sync``).
3. **Compare.** The mean loss over the micro-batch's loss tokens and this rank's gradient
   norm; the largest relative difference is maxed over all ranks (one all-reduce, so every
   rank takes the same decision) and read on the host: the check's one deliberate sync.
4. **No trace in training.** RNG states are put back (CPU, the CUDA default generator and
   megatron-core's tracker, in place: graphs registered with a generator keep it), MoE aux
   losses and drop counts too (`moe.moe_accumulators_kept`); the caller's guards are entered
   around the passes (the MoE rerun monitor does not count them); the gradient buffers are
   left zeroed: the iteration's gradients were applied by the optimizer step, and the next
   iteration zeroes them before its first micro-batch anyway. The optimizer is not touched.

A difference above the tolerance, or a non-finite replay where eager is finite, is a
divergence: every rank that saw it prints both values and the graph key. With action
``disable`` the runtime then plans every later micro-batch eager (`Reason.DISABLED`).
"""

import math
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, ContextManager, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron.packed_model.moe import moe_accumulators_kept
from megatron.packed_graphs.plan import Granularity, GraphKey, Mode, Reason, StepGraphPlan
from megatron.packed_graphs.settings import HealthCheckConfig  # built with the graph settings


@dataclass(frozen=True)
class CheckResult:
    """One check, on the host. ``loss`` and ``grad_norm`` are (replayed, eager) on this rank."""

    iteration: int
    position: int  # of the checked micro-batch in its iteration
    key: Optional[GraphKey]  # the replayed graph; None: no graphed micro-batch on this rank
    loss: Tuple[float, float]
    grad_norm: Tuple[float, float]
    difference: float  # largest relative difference on this rank (0 when nothing compared)
    worst: float  # the largest over every rank
    diverged: bool  # worst above the tolerance
    time_ms: float  # the check's device time (host time on CPU)

    @property
    def compared(self) -> bool:
        return self.key is not None


class GraphHealthCheck:
    """The health check of one graph runtime (see module doc): when it is due, and the check.

    ``model_chunks``: the model chunks the runtime drives (DDP-wrapped in training);
    ``guards``: callables returning context managers entered around the passes, for state the
    passes must not move that only the caller knows (the MoE rerun monitor's counting).
    ``checks`` / ``divergences`` count this run's checks (on every rank alike).
    """

    def __init__(self, config: HealthCheckConfig, model_chunks: Sequence[torch.nn.Module] = (),
                 guards: Sequence[Callable[[], ContextManager]] = ()):
        self.config = config
        self.model = list(model_chunks)
        self.guards = list(guards)
        self.checks = 0
        self.divergences = 0

    def due(self, iteration: int, warmup_iterations: int) -> bool:
        """Whether training iteration ``iteration`` (1-based, counted by this process) ends
        with a check: every ``interval``-th once past the eager warm-up. Host only; every
        rank decides alike."""
        interval = self.config.interval
        return interval > 0 and iteration > warmup_iterations and iteration % interval == 0

    def counts(self) -> dict:
        """The run's counters for the log line (empty when the check is off)."""
        if not self.config.enabled:
            return {}
        return {"graph checks": self.checks, "graph check divergences": self.divergences}

    def run(self, iteration: int, micro_batches: Sequence[dict],
            plans: Sequence[StepGraphPlan], run_micro_batch: Callable) -> CheckResult:
        """Check training iteration ``iteration`` over its ``micro_batches`` (host dicts) and
        their ``plans`` (one model chunk's). ``run_micro_batch(batch, plan)`` stages a
        micro-batch and calls the model under ``plan``, returning megatron-core's
        ``(output, loss_func)`` (the runtime's `run_micro_batch`).

        Runs forward and backward twice (module doc); leaves gradients zeroed. Syncs once
        (one all-reduce of one value over every rank, one host read); every rank must call
        it at the same iteration.
        """
        position, key = checked_micro_batch(plans)
        batch = micro_batches[position]
        eager = StepGraphPlan.eager(Reason.HEALTH_CHECK)
        replay = eager if key is None else StepGraphPlan.graphed(Mode.REPLAY, key)
        timer = _Timer()
        with ExitStack() as scope:
            scope.enter_context(torch.enable_grad())
            scope.enter_context(moe_accumulators_kept(self.model))
            for guard in self.guards:
                scope.enter_context(guard())
            rng = RNGStates()
            try:
                replayed = self._pass(run_micro_batch, batch, replay, rng)
                checked = self._pass(run_micro_batch, batch, eager, rng)
            finally:
                rng.restore()
                self._zero_grads()
        values = torch.stack([replayed[0], checked[0], replayed[1], checked[1]]).float()
        differences = relative_differences(values[0::2], values[1::2])
        local = differences.max() if key is not None else torch.zeros_like(differences[0])
        worst = local.clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
        timer.stop()
        # The check's deliberate sync: one host read of its values.
        loss_r, loss_e, norm_r, norm_e, local, worst = torch.cat(
            [values, local.view(1), worst.view(1)]).tolist()
        result = CheckResult(iteration, position, key, (loss_r, loss_e), (norm_r, norm_e),
                             local, worst, worst > self.config.tolerance, timer.elapsed_ms())
        self.checks += 1
        self.divergences += result.diverged
        if result.diverged:
            self._report(result)
        return result

    def stats(self, result: CheckResult) -> dict:
        """A check iteration's log-line values: the counters, its time, the largest difference."""
        return self.counts() | {"graph check (ms)": round(result.time_ms, 1),
                                "graph check rel diff": float(f"{result.worst:.3g}")}

    # -- the passes ----------------------------------------------------------------------------

    def _pass(self, run_micro_batch, batch: dict, plan: StepGraphPlan,
              rng: "RNGStates") -> Tuple[Tensor, Tensor]:
        """Forward and backward of ``batch`` under ``plan`` from the saved RNG states and zero
        gradients, no gradient reduction; returns (mean loss, gradient norm) on the device."""
        rng.restore()
        self._zero_grads()
        with ExitStack() as held:
            for chunk in self.model:
                if hasattr(chunk, "no_sync"):  # megatron-core DDP: no bucket reduction
                    held.enter_context(chunk.no_sync())
            output, loss_func = run_micro_batch(batch, plan)
            loss = micro_batch_loss(loss_func(output))
            loss.backward()
        return loss.detach(), gradient_norm(self.model, loss.device)

    def _zero_grads(self) -> None:
        for chunk in self.model:
            if hasattr(chunk, "zero_grad_buffer"):  # megatron-core DDP: main_grad buffers
                chunk.zero_grad_buffer()
            else:
                chunk.zero_grad(set_to_none=True)

    def _report(self, result: CheckResult) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        action = ("CUDA graphs are off for the rest of the run (--cuda-graph-check-action "
                  "disable)" if self.config.action == "disable" else
                  "training goes on with graphs (--cuda-graph-check-action warn)")
        if result.compared and result.difference > self.config.tolerance:
            print(f" graph health check at iteration {result.iteration}, rank {rank}: graph "
                  f"{describe_key(result.key)} diverged from eager on micro-batch "
                  f"{result.position}: loss replayed {result.loss[0]:.6e} eager "
                  f"{result.loss[1]:.6e}, grad norm replayed {result.grad_norm[0]:.6e} eager "
                  f"{result.grad_norm[1]:.6e}, largest relative difference "
                  f"{result.difference:.3g} > tolerance {self.config.tolerance:g}; {action}",
                  flush=True)
        elif rank == 0:
            print(f" graph health check at iteration {result.iteration}: a replay diverged "
                  f"from eager on another rank (largest relative difference "
                  f"{result.worst:.3g} > tolerance {self.config.tolerance:g}); {action}",
                  flush=True)


def checked_micro_batch(plans: Sequence[StepGraphPlan]) -> Tuple[int, Optional[GraphKey]]:
    """The micro-batch a check replays: (position, key) of the first plan with graphs of its
    own (captured in this iteration or replayed: either replays by the iteration's end), else
    (0, None). A micro-batch inside a whole-iteration graph has none: its layers run plain
    inside that graph, and alone it would run eager."""
    return next(((i, plan.key) for i, plan in enumerate(plans) if plan.uses_graphs
                 and plan.key.granularity is not Granularity.FULL_ITERATION), (0, None))


def micro_batch_loss(result) -> Tensor:
    """The mean loss of a micro-batch from megatron-core's loss-function result:
    ``(loss, num_tokens, reports)`` (loss summed over tokens) or ``(loss, reports)`` (a mean)."""
    if len(result) == 3:
        loss, num_tokens, _ = result
        return loss / torch.as_tensor(num_tokens, device=loss.device).clamp(min=1)
    return result[0]


def gradient_norm(model_chunks: Sequence[torch.nn.Module], device=None) -> Tensor:
    """L2 norm of this rank's parameter gradients (``main_grad`` under megatron-core's DDP,
    else ``grad``), fp32, on their device (``device`` when there is none). No host sync."""
    grads: List[Tensor] = []
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if param.requires_grad and grad is not None:
                grads.append(grad)
    if not grads:
        return torch.zeros((), device=device)
    return torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in grads]))


def relative_differences(replayed: Tensor, eager: Tensor) -> Tensor:
    """``|replayed - eager| / |eager|`` elementwise; infinite where the replay is not finite and
    eager is, 0 where eager is not finite (nothing to compare against). On the device."""
    tiny = torch.finfo(torch.float32).tiny
    difference = (replayed - eager).abs() / eager.abs().clamp(min=tiny)
    difference = torch.where(torch.isfinite(replayed), difference,
                             torch.full_like(difference, math.inf))
    return torch.where(torch.isfinite(eager), difference, torch.zeros_like(difference))


def describe_key(key: GraphKey) -> str:
    return (f"({key.granularity.value}, capacity {key.capacity}, cp {key.cp_size}, "
            f"slot {key.slot})")


class RNGStates:
    """The RNG states a forward and backward pass draws from, saved to be put back: the CPU
    generator, the current CUDA device's default generator and megatron-core's CUDA RNG
    tracker. Generators are restored in place (their seed and offset), so CUDA graphs
    registered with a generator keep drawing from it."""

    def __init__(self):
        from megatron.core import tensor_parallel

        self.cpu = torch.get_rng_state()
        self.tracker = tensor_parallel.get_cuda_rng_tracker()
        self.tracker_states = dict(self.tracker.get_states())
        generators = [state for state in self.tracker_states.values()
                      if isinstance(state, torch.Generator)]  # graph-safe tracker
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
        self.generators = [(generator, generator.get_state()) for generator in generators]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for generator, state in self.generators:
            generator.set_state(state)
        self.tracker.set_states(dict(self.tracker_states))


class _Timer:
    """The check's time: CUDA events on the current stream (the device's work between the
    check's start and its last op) where CUDA is in use, else the host clock."""

    def __init__(self):
        self.events = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start, self.end = time.perf_counter(), None

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()
        self.end = time.perf_counter()

    def elapsed_ms(self) -> float:
        """After the check's host read: the end event has completed by then."""
        if self.events is not None:
            return self.events[0].elapsed_time(self.events[1])
        return (self.end - self.start) * 1000.0
