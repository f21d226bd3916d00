"""Forward-only CUDA graphs: a model chunk's whole forward pass, one graph per capacity.

Evaluation and log-prob passes need no backward, so nothing has to stay alive between a
layer's forward and its backward graph, and nothing is gained by graphing layer by layer:
a forward-only graph holds the whole call of the forward step on a staged micro-batch
(``forward_step.run(model, staged)``): embedding, every layer, the output layer and what
the step computes from the logits (the per-token loss of evaluation, the log-probs of
``megatron.packed_training.rl``). A replay is one launch for the whole micro-batch.

Keys and plan. A forward-only graph is keyed like a training graph, by capacity and CP size
(`plan.GraphKey.forward`, ``forward_only=True``); `dispatch.plan_forward_only` gives each
micro-batch of a forward-only pass the smallest bank that fits or an eager reason, counted
like training's. Every bank of `GraphRuntimeConfig.forward_banks` is captured at the first
forward-only pass, on every rank alike whatever its own micro-batches need (the captures run
the model's collectives), from a layout of one all-padding segment
(`forward_step.graph_layout`).

What a capture does (`ForwardGraphs.capture`), per bank: static inputs are allocated by
staging the layout into `full_iteration.StaticMicroBatches` (outside the graph's pool);
the forward step runs twice eagerly on them (kernel autotuning, workspaces and tables built
on first use, none of which a capture may do); then one call is captured under
``torch.no_grad()``, with the model in eval mode (the runtime enters it) so every layer
runs its plain forward inside the graph whatever the training graph implementation.

Memory. The graphs of one runtime share one pool: megatron-core's local-graph pool when the
training graphs are local layer graphs (``pool`` from `graph_engine.local_graph_pool`),
else a pool of the forward graphs' own. Sharing is safe because a forward-only pass never
overlaps a training iteration's forward and backward, and every output of a forward-only
graph is consumed (the loss function reads it) before the next replay of any graph in the
pool. What each capture adds is reported as ``forward graph memory (MiB)``: the pool's
growth (little where it shares the training graphs' free blocks) and the static inputs.

Contract of a replay (`ForwardGraphs.run`): the staged micro-batch is copied into the
bank's static inputs (device copies, no sync), the graph replays, and the result captured
with it is returned: ``(output, loss_func)`` whose tensors are graph-owned (the next replay
of any graph in the pool overwrites them) and whose ``loss_func`` reads the static inputs.
Call ``loss_func`` (or copy the output) before the next micro-batch.

A bank is captured over one model chunk and one forward step: replaying it for another
raises, since the graph would run the captured model's weights.
"""

import dataclasses
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import (Any, Callable, ContextManager, Dict, Iterable, Iterator, Optional, Sequence,
                    Tuple)

import torch

from megatron.packed_graphs.full_iteration import StaticMicroBatches
from megatron.packed_graphs.graph_memory import capture_graph
from megatron.packed_graphs.plan import GraphKey, Mode, StepGraphPlan, running

WARMUP_PASSES = 2  # eager passes before a capture (as megatron-core's and TE's captures do)


@dataclass
class ForwardGraph:
    """One captured forward-only graph: its static inputs (a staged micro-batch), the graph,
    the ``(output, loss_func)`` its capture returned, and the model chunk it runs."""

    inputs: StaticMicroBatches
    graph: Any
    result: Tuple[Any, Callable]
    model: torch.nn.Module


class ForwardGraphs:
    """The forward-only graphs of one forward step, one per (CP size, capacity).

    ``forward_step``: the step whose ``run`` is captured (the graph runtime keeps one
    `ForwardGraphs` per forward step it is handed); ``pool``: returns the memory pool
    handle to capture into (called at each capture); ``capture``: the capture function,
    `graph_memory.capture_graph` (a stand-in may be passed where CUDA graphs cannot run);
    ``rng_states``: returns the generators a graph registers; ``guard``: returns a context
    manager the warm-up passes and capture run in (MoE accumulators kept).
    """

    def __init__(self, forward_step, pool: Callable[[], Any], *,
                 capture: Callable = capture_graph,
                 rng_states: Callable[[], dict] = dict,
                 guard: Callable[[], ContextManager] = nullcontext):
        self.forward_step = forward_step
        self.graphs: Dict[Tuple[int, int], ForwardGraph] = {}  # (CP size, capacity) -> graph
        self._pool, self._capture, self._rng_states = pool, capture, rng_states
        self._guard = guard

    @property
    def captured(self) -> frozenset:
        """(CP size, capacity) pairs captured, as `dispatch.plan_forward_only` reads them."""
        return frozenset(self.graphs)

    def capture(self, model: torch.nn.Module,
                banks: Iterable[Tuple[GraphKey, Any]]) -> dict:
        """Capture one graph per ``(key, layout)``: ``layout`` a micro-batch staged like a
        graphed one of that key (the forward step's ``graph_layout``). Every rank must call
        this with the same keys in the same order. Syncs the device. Returns the statistics
        for the log line: capture time, graph memory (MiB), graphs captured."""
        seconds, memory, count = 0.0, 0, 0
        for key, layout in banks:
            if key.capacity <= 0 or not key.forward_only:
                raise ValueError(f"forward-only graph key is wrong: {key}. Use "
                                 f"GraphKey.forward(capacity, cp_size).")
            inputs = StaticMicroBatches()
            static = inputs.fill([layout])[0]
            body = self._body(model, key, static)
            with self._guard():
                for _ in range(WARMUP_PASSES):
                    body()
                graph, result, took, pool_growth = self._capture(
                    body, pool=self._pool(), generators=self._rng_states().values())
            self.graphs[(key.cp_size, key.capacity)] = ForwardGraph(inputs, graph, result, model)
            seconds += took
            memory += pool_growth + tensor_bytes(static)
            count += 1
        return {"forward graph capture (s)": round(seconds, 2),
                "forward graph memory (MiB)": round(memory / 2**20, 1),
                "forward graphs captured": count}

    def _body(self, model, key: GraphKey, static) -> Callable[[], Tuple[Any, Callable]]:
        plan = StepGraphPlan.graphed(Mode.CAPTURE, key)

        def body():
            with torch.no_grad(), running(plan):
                return self.forward_step.run(model, static)
        return body

    def run(self, model: torch.nn.Module, key: GraphKey, staged) -> Tuple[Any, Callable]:
        """Replay the graph of ``key`` on ``staged`` (staged at ``key.capacity``): its inputs
        copied into the static ones, no sync. Returns ``(output, loss_func)``, graph-owned
        (module doc). Raises when the bank was not captured, or was captured over another
        model chunk."""
        graph = self.graphs.get((key.cp_size, key.capacity))
        if graph is None:
            raise RuntimeError(f"no forward-only graph was captured for {key} (captured: "
                               f"{sorted(self.graphs)}); the graph runtime captures every "
                               f"bank at the first forward-only pass")
        if graph.model is not model:
            raise RuntimeError("a forward-only graph replays the model chunk it was captured "
                               "over; another was passed. Load other weights into the model "
                               "in place (megatron.packed_training.rl.weights) instead.")
        graph.inputs.fill([staged])
        graph.graph.replay()
        return graph.result


def tensor_bytes(value, seen: Optional[set] = None) -> int:
    """Bytes of the distinct tensors in ``value`` (a staged micro-batch: dataclasses, dicts)."""
    seen = set() if seen is None else seen
    if torch.is_tensor(value):
        if id(value) in seen:
            return 0
        seen.add(id(value))
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item, seen) for item in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_bytes(getattr(value, field.name), seen)
                   for field in dataclasses.fields(value))
    return 0


@contextmanager
def eval_mode(model_chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Within the scope every chunk is in eval mode (no dropout; the graphable layers run
    their plain forward); each chunk's own mode is put back after."""
    modes = [chunk.training for chunk in model_chunks]
    for chunk in model_chunks:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, training in zip(model_chunks, modes):
            chunk.train(training)


def forward_graph_pool(shared: Optional[Callable[[], Any]] = None) -> Callable[[], Any]:
    """The pool function of a runtime's forward-only graphs: ``shared()`` (the training
    graphs' pool) where it returns one, else one pool of their own, made at the first
    capture that needs it."""
    own = []

    def pool():
        handle = shared() if shared is not None else None
        if handle is not None:
            return handle
        if not own:
            own.append(torch.cuda.graph_pool_handle())
        return own[0]
    return pool
