"""Full-iteration CUDA graphs (``--cuda-graph-impl full_iteration``): an iteration as one graph.

What the graph holds: megatron-core's schedule over every micro-batch of the iteration, so
each micro-batch's embedding, forward, loss and backward, the gradient accumulation into
DDP's buffers, and ``finalize_model_grads`` (the data-parallel reduction and, with
``--calculate-per-token-loss``, the token-count scaling). The optimizer step, gradient
clipping included, is not in it: megatron-core's ``optimizer.step()`` copies the gradients
to the main parameters, clips and steps in one call, and runs after the graph (sync-free,
see megatron_optimizer.clip_gradients_without_host_sync; an optimizer-step graph may wrap it).

The plan per iteration (`plan_full_iteration`, host only, before the schedule):

* warm-up iterations, evaluation, graphs off: as without iteration graphs;
* an iteration with the graph's micro-batch count whose micro-batches fit the capacity on
  every data-parallel rank (`all_ranks_fit`, one host all-reduce) is one graph: captured on
  the first such iteration past the warm-up, replayed from then on;
* any other iteration *misses* (`Reason.OVERFLOW`, `Reason.MICRO_BATCH_COUNT`) and runs per
  micro-batch exactly as ``--cuda-graph-impl local`` would: layer (or chunk) graphs for the
  micro-batches that fit, eager for those that do not. It never falls back wholesale.

Layer graphs and the iteration graph are two sets of graphs over one model. megatron-core's
local graphs record inside a schedule and capture at its end, so they cannot be created
inside a schedule that is itself being captured: the iteration graph is captured with the
layers' graphs bypassed (the plan's key says ``FULL_ITERATION``; layers.py and
chunk_graphs.py then run their plain forward), and the layer graphs are recorded and captured
in the first iteration that misses, in their own pool. Either may come first. Memory: the
iteration graph's private pool holds about one eager iteration's peak, on top of the layer
graphs' pool and the eager peak of the iterations that miss.

Static inputs (`StaticMicroBatches`): one staged micro-batch per position in the iteration,
allocated at the first fill (outside any capture) and refilled by device copies before each
replay; the graph reads only those. Nothing inside the captured region reads the host.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron.packed_graphs.capacity import fits_capacity
from megatron.packed_graphs.dispatch import Captured, plan_iteration
from megatron.packed_graphs.graph_memory import capture_in_own_pool
from megatron.packed_graphs.plan import (
    Granularity,
    GraphKey,
    GraphRuntimeConfig,
    Mode,
    Reason,
    StepGraphPlan,
)

# Host fields of a staged micro-batch the model never reads: they may differ between fills.
HOST_COUNTERS = frozenset({"num_segments", "num_documents"})


@dataclass(frozen=True)
class IterationPlan:
    """What a whole iteration does (host only): one graph (``mode`` CAPTURE or REPLAY) or its
    micro-batches' own plans (EAGER). ``miss``: why an iteration that could have been one
    graph was not (None when it was, or when it could not be: warm-up, evaluation, off)."""

    mode: Mode
    miss: Optional[Reason] = None

    @property
    def uses_graph(self) -> bool:
        return self.mode is not Mode.EAGER


def iteration_graph_due(config: GraphRuntimeConfig, iteration: int, graph_captured: bool, *,
                        training: bool = True, graphs_off: bool = False) -> bool:
    """Whether this iteration is one graph if its micro-batches allow (the same on every rank:
    it decides whether `all_ranks_fit` is called)."""
    return (config.enabled and config.full_iteration and training and not graphs_off
            and (graph_captured or iteration >= config.warmup_iterations))


def plan_full_iteration(config: GraphRuntimeConfig, iteration: int, captured: Captured,
                        graph_captured: bool, segment_counts: Sequence[int], *,
                        fit_everywhere: Optional[bool] = None, training: bool = True,
                        graphs_off: bool = False) -> Tuple[IterationPlan, List[StepGraphPlan]]:
    """The iteration's plan and its micro-batches' plans (one each, in order).

    ``captured``: the (CP size, capacity) pairs layer graphs exist for; ``graph_captured``:
    whether the iteration graph exists; ``fit_everywhere``: whether every data-parallel
    rank's micro-batches fit the capacity (default: this rank's do). A graph iteration gives
    every micro-batch a ``FULL_ITERATION`` key of the top capacity; a miss gives them the
    per-micro-batch plans of `dispatch.plan_iteration` (which capture layer graphs in the
    first iteration past the warm-up that runs them).
    """
    per_micro_batch = plan_iteration(config, iteration, captured, segment_counts,
                                     training=training, graphs_off=graphs_off)
    if not iteration_graph_due(config, iteration, graph_captured, training=training,
                               graphs_off=graphs_off):
        return IterationPlan(Mode.EAGER), per_micro_batch
    if fit_everywhere is None:
        fit_everywhere = all(fits_capacity(count, config.capacity) for count in segment_counts)
    if len(segment_counts) != config.iteration_micro_batches:
        return IterationPlan(Mode.EAGER, Reason.MICRO_BATCH_COUNT), per_micro_batch
    if not fit_everywhere:
        return IterationPlan(Mode.EAGER, Reason.OVERFLOW), per_micro_batch
    mode = Mode.REPLAY if graph_captured else Mode.CAPTURE
    key = GraphKey(Granularity.FULL_ITERATION, config.capacity, config.cp_size)
    return IterationPlan(mode), [StepGraphPlan.graphed(mode, key)] * len(segment_counts)


def all_ranks_fit(fits: bool, group=None) -> bool:
    """Whether ``fits`` holds on every rank of ``group`` (a Gloo group: a host all-reduce, no
    device sync). The iteration graph holds the data-parallel reduction, so every rank must
    take the same path. Without torch.distributed or in a group of one: ``fits``."""
    if group is None or not torch.distributed.is_initialized():
        return fits
    if torch.distributed.get_world_size(group) == 1:
        return fits
    flag = torch.tensor([int(fits)], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())  # a CPU tensor: no device sync


class StaticMicroBatches:
    """The iteration graph's inputs: one staged micro-batch per position, fixed addresses.

    A staged micro-batch is a dataclass (packed_step.PackedMicroBatch) of tensors, nested
    dataclasses (its PackedBatchParams), dicts of tensors (per-token tensors of a loss, e.g.
    megatron.packed_training.rl) and host values. `fill` copies every tensor into its
    static twin (allocated at the first fill, a clone; one twin per distinct tensor object,
    so ``cu_seqlens_q is cu_seqlens_kv`` stays true). Host values are frozen at the first fill
    and must not change (``max_seqlen``, ``qkv_format``, groups), except `HOST_COUNTERS`.
    Device copies on the current stream, no host sync. The static micro-batches are
    graph-owned: the next fill overwrites them.
    """

    def __init__(self):
        self.slots: List[Any] = []

    def fill(self, staged: Sequence[Any]) -> List[Any]:
        """Copy ``staged`` (one per position) into the static micro-batches; returns them."""
        if self.slots and len(staged) != len(self.slots):
            raise ValueError(f"graph inputs are wrong: {len(staged)} micro-batches "
                             f"for a graph of {len(self.slots)}.")
        if not self.slots:
            self.slots = [_twin(mb, {}) for mb in staged]
            return self.slots
        for static, mb in zip(self.slots, staged):
            _copy_into(static, mb, set(), "micro-batch")
        return self.slots


def _twin(value, seen: Dict[int, torch.Tensor]):
    """A copy of ``value`` whose tensors are fresh clones (shared tensors stay shared)."""
    if isinstance(value, torch.Tensor):
        if id(value) not in seen:
            seen[id(value)] = value.detach().clone()
        return seen[id(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        twin = _shallow_copy(value)
        for field in dataclasses.fields(value):
            setattr(twin, field.name, _twin(getattr(value, field.name), seen))
        return twin
    if isinstance(value, dict):
        return {key: _twin(item, seen) for key, item in value.items()}
    return value


def _shallow_copy(value):
    # Not dataclasses.replace: that re-runs __post_init__ (PackedSeqParams' may do tensor work).
    twin = object.__new__(type(value))
    twin.__dict__.update(value.__dict__)
    return twin


def _copy_into(static, value, done: set, where: str) -> None:
    for field in dataclasses.fields(value):
        _copy_item(field.name, getattr(static, field.name), getattr(value, field.name), done,
                   f"{where}.{field.name}")


def _copy_item(field: str, old, new, done: set, name: str) -> None:
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or \
                old.shape != new.shape or old.dtype != new.dtype:
            raise ValueError(f"graph input {name} is wrong: {_describe(new)}, captured as "
                             f"{_describe(old)}. Every micro-batch must be staged to the "
                             f"graph's capacity and length.")
        if id(old) not in done:
            old.copy_(new, non_blocking=True)
            done.add(id(old))
    elif dataclasses.is_dataclass(old):
        _copy_into(old, new, done, name)
    elif isinstance(old, dict):
        if not isinstance(new, dict) or old.keys() != new.keys():
            shown = sorted(new) if isinstance(new, dict) else repr(new)
            raise ValueError(f"graph input {name} is wrong: {shown}, captured with "
                             f"{sorted(old)}. Every micro-batch must carry the same tensors.")
        for key in old:
            _copy_item(key, old[key], new[key], done, f"{name}[{key!r}]")
    elif field not in HOST_COUNTERS and old is not new and old != new:
        raise ValueError(f"graph input {name} is wrong: {new!r}, captured as {old!r}. Host "
                         f"values are fixed at capture.")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return repr(value)


class IterationGraph:
    """The whole-iteration graph of a run: its static inputs, capture and replay.

    ``run(mode, staged, schedule)``: fill the static inputs from ``staged``; in a CAPTURE
    iteration capture ``schedule(static)`` (megatron-core's schedule over the static
    micro-batches); replay. Returns the schedule's result (graph-owned: losses the next
    replay overwrites; read them before) and the capture's statistics ({} on replay).
    """

    def __init__(self, rng_states: Callable[[], dict] = dict,
                 before_capture: Callable[[], Any] = lambda: None):
        self.inputs = StaticMicroBatches()
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.result: Any = None
        self._rng_states = rng_states  # generators the graph must advance (dropout)
        self._before_capture = before_capture  # called after a device sync, before capture

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def run(self, mode: Mode, staged: Sequence[Any],
            schedule: Callable[[List[Any]], Any]) -> Tuple[Any, dict]:
        static = self.inputs.fill(staged)
        stats = {}
        if mode is Mode.CAPTURE:
            if self.captured:
                raise RuntimeError("the iteration graph is captured once per run")
            stats = self._capture(lambda: schedule(static))
        elif not self.captured:
            raise RuntimeError("the iteration graph replays only after its capture iteration")
        self.graph.replay()  # the capture only recorded: this runs the iteration
        return self.result, stats

    def _capture(self, body: Callable[[], Any]) -> dict:
        """Capture ``body`` on the current stream, into a pool of its own. Syncs the device.

        The current stream: autograd runs parameters' gradient accumulation on the stream
        DDP built its hooks on (the process's side stream: graph_engine.use_side_stream,
        ddp_on_the_process_stream), and torch 2.11 cannot redirect those nodes to another
        capture stream.
        """
        torch.cuda.synchronize()
        self._before_capture()
        self.graph, self.result, seconds, graph_bytes = capture_in_own_pool(
            body, stream=torch.cuda.current_stream(),
            generators=self._rng_states().values())
        return {"iteration graph capture (s)": round(seconds, 2),
                "iteration graph memory (MiB)": round(graph_bytes / 2**20, 1)}
