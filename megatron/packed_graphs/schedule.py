"""The seam between Megatron-LM's training loop and the graph runtime.

Megatron-LM's ``train()`` and ``evaluate()`` (the megatron-core wheel's ``megatron.training``)
run every iteration through one callable, megatron-core's ``forward_backward_func``, and then
``optimizer.step()``. `GraphRuntimeSchedule` stands in that callable's place, the way upstream's
``FullCudaGraphWrapper`` and ``PagedStashRunner`` do:

    losses = schedule(forward_step_func=..., data_iterator=..., model=..., num_microbatches=N,
                      forward_only=False, ...)      # upstream's train_step, unchanged
    optimizer.step()                              # `wrap_optimizer_step` closes the iteration

Per call it reads the iteration's ``N`` micro-batches from the data iterator(s) up front, has
the graph runtime plan every one of them on the host (a graph key, or eager and why:
`runtime.GraphRuntime.iteration`), then runs megatron-core's schedule over the planned
micro-batches: layer, chunk and TE graphs replay inside it, a full-iteration graph replaces it.
A forward-only call (``evaluate()``'s, the library API's log-probs) is planned against the
runtime's forward-only graphs and reported at once (forward_graphs.py).
A training iteration stays open until its optimizer step has run, so the runtime's end of
iteration (statistics, the graph health check on the new weights, the iteration count) sees
the step, as it did when the fork ran its own loop. With ``--moe-capacity-overflow rerun`` the
overflowed micro-batches are rerun eager here, before the optimizer step.

The schedule always sees one THD stream per micro-batch: ``seq_length`` is the micro-batch's
``micro_batch_size * seq_length`` positions and ``micro_batch_size`` 1, whatever upstream passes.

Dynamic CP (``rank_iterations``): upstream passes every rank the same ``N``, but a rank runs
the micro-batches of its own turns (datasets/dynamic_cp.py), one or more, their count varying
by rank and iteration. The data iterator then yields one iteration per ``next()``, that list,
and the schedule runs as many micro-batches as it holds. The collectives stay matched: at
PP = 1 megatron-core's schedule reduces the gradients (DDP's bucket reductions, and
``finalize_model_grads``, which all-reduces the token count of the per-token loss) once per
call whatever the count, ``train_step`` all-reduces the loss once per iteration over the
data x context-parallel group (every rank has a loss: at least one turn), and the ranks of a
micro-batch's CP group meet its collectives in the same round order.

``forward_step_func`` must be the run's `PackedForwardStep` (megatron.packed_training): the
runtime stages and runs each micro-batch through it under the micro-batch's plan.

Nothing here touches upstream internals: training_loop.route_training_loop installs it.
"""

import sys
from contextlib import ExitStack
from typing import Callable, List, Optional, Sequence

from megatron.packed_graphs.runtime import GraphIteration, GraphRuntime


class GraphRuntimeSchedule:
    """megatron-core's ``forward_backward_func`` with the graph runtime in front of it.

    ``schedule``: megatron-core's own forward-backward function (``get_forward_backward_func()``).
    ``stream_length``: positions of one micro-batch's THD stream, ``micro_batch_size *
    seq_length`` (the schedule's ``seq_length``; it divides by the CP size, and by TP with
    sequence parallelism, for the ``[positions, 1, hidden]`` tensors stages exchange).
    ``moe_rerun``: the `MoEOverflowRerun` monitor, or None.
    ``before_iteration``: called with no argument as each training iteration starts (before its
    micro-batches are read), e.g. a profiler's start.
    ``listeners``: called as ``listener(split, stats, losses)`` when a training iteration closes
    (after its optimizer step; ``split`` "train") and after each evaluation iteration ("valid"),
    with the runtime's statistics of the iteration and the schedule's losses_reduced.
    ``rank_iterations``: each ``next()`` of the data iterator is a whole iteration of this
    rank, a non-empty list of micro-batches, and the schedule runs that many whatever
    ``num_microbatches`` says (dynamic CP, module doc).
    """

    def __init__(self, runtime: GraphRuntime, schedule: Callable, *, stream_length: int,
                 moe_rerun=None, optimizer=None, rank_iterations: bool = False):
        self.runtime = runtime
        self.schedule = schedule
        self.stream_length = stream_length
        self.moe_rerun = moe_rerun
        self.optimizer = optimizer  # zeroed with the gradient buffers before a MoE rerun
        self.rank_iterations = rank_iterations
        self.before_iteration: List[Callable[[], None]] = []
        self.listeners: List[Callable[[str, dict, list], None]] = []
        # The training iteration whose optimizer step has not run yet.
        self._open: Optional[ExitStack] = None
        self._open_step: Optional[GraphIteration] = None
        self._open_losses = None

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int,
                 forward_only: bool = False, seq_length=None, micro_batch_size=None,
                 **schedule_kwargs):
        """Plan, then run this iteration's ``num_microbatches`` micro-batches (one data
        iterator, or one per virtual pipeline chunk; with ``rank_iterations``, this rank's
        micro-batches of the iteration, however many). Returns what the schedule returns
        (losses_reduced; under a full-iteration graph, graph-owned tensors the next replay
        overwrites). Syncs only where the runtime does (captures, the MoE overflow read)."""
        if not forward_only:
            self.close_iteration()  # a previous iteration without an optimizer step (skipped)
            for hook in self.before_iteration:
                hook()
        chunks = len(model)
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        if len(iterators) == 1 and chunks > 1:  # VPP: every chunk reads the micro-batches itself
            raise ValueError(f"data_iterator is wrong: one iterator for {chunks} model chunks. "
                             "Give one iterator per virtual pipeline chunk.")
        micro_batches = [self._read(it, num_microbatches) for it in iterators]

        def run(step_forward, planned: Sequence[Sequence[dict]]):
            data = [iter(batches) for batches in planned]
            return self.schedule(
                forward_step_func=step_forward, data_iterator=data if chunks > 1 else data[0],
                model=model, num_microbatches=len(planned[0]), forward_only=forward_only,
                seq_length=self.stream_length, micro_batch_size=1, **schedule_kwargs)

        if forward_only:
            with self.runtime.iteration(micro_batches, forward_step_func, training=False) as step:
                losses = step.run(run)
            self._notify("valid", step.stats, losses)
            return losses

        stack = ExitStack()
        try:
            step = stack.enter_context(self.runtime.iteration(micro_batches, forward_step_func))
            losses = step.run(run)
            if self.moe_rerun is not None:
                losses, _ = self.moe_rerun.after_forward_backward(
                    losses, lambda eager: step.rerun(eager, self._zeroed(model, run)))
        except BaseException:
            stack.__exit__(*sys.exc_info())
            raise
        self._open, self._open_step, self._open_losses = stack, step, losses
        return losses

    def _read(self, iterator, num_microbatches: int) -> List[dict]:
        """One iteration's micro-batches from ``iterator``: ``num_microbatches`` of them, or
        with ``rank_iterations`` the list its next item is."""
        if not self.rank_iterations:
            return [next(iterator) for _ in range(num_microbatches)]
        turns = next(iterator)
        if not isinstance(turns, list) or not turns:
            # A rank without a micro-batch would skip the loss all-reduce the others wait in.
            shown = "an empty list" if turns == [] else f"a {type(turns).__name__}"
            raise ValueError(f"data iterator item is wrong: {shown}. With rank_iterations each "
                             "item is the non-empty list of this rank's micro-batches of one "
                             "iteration (datasets/dynamic_cp.DynamicCPBatches).")
        return turns

    def _zeroed(self, model, run: Callable) -> Callable:
        """``run`` after zeroing the gradients, as upstream's train_step does before its
        schedule: a MoE rerun redoes the whole iteration."""
        def zeroed(step_forward, planned):
            for chunk in model:
                chunk.zero_grad_buffer()
            if self.optimizer is not None:
                self.optimizer.zero_grad()
            return run(step_forward, planned)
        return zeroed

    def wrap_optimizer_step(self, step: Callable) -> Callable:
        """``optimizer.step`` followed by the end of the open training iteration."""
        def step_then_close(*args, **kwargs):
            result = step(*args, **kwargs)
            self.close_iteration()
            return result
        step_then_close.__wrapped__ = step
        return step_then_close

    def close_iteration(self) -> None:
        """End the open training iteration (the runtime's statistics, health check and
        count) and hand its statistics to the listeners. No-op when none is open."""
        if self._open is None:
            return
        stack, step, losses = self._open, self._open_step, self._open_losses
        self._open = self._open_step = self._open_losses = None
        stack.close()
        self._notify("train", step.stats, losses)

    def _notify(self, split: str, stats: dict, losses) -> None:
        for listener in self.listeners:
            listener(split, stats, losses)
