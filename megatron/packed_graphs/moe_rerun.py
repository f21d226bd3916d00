"""Dropless MoE that stays graphed: micro-batches whose tokens overflowed an expert's capacity
are rerun eager and dropless before the optimizer step (``--moe-capacity-overflow rerun``).

Graphed MoE layers run drop-and-pad: every expert takes exactly its capacity of rows, and
tokens over it are dropped. In rerun mode none stays dropped:

1. **Detect on the device.** Every `PackedTopKRouter` folds [slots it dropped, its peak expert
   load] into one shared int64 buffer (a max, inside graphs too). Hooks on each model chunk
   zero it before a training forward call and fold it into the row of that call's micro-batch
   after it (each chunk sees its micro-batches in order under every schedule). No host sync.
2. **Decide once.** `MoEOverflowRerun.after_forward_backward`, called after the schedule and
   before the optimizer step, all-reduces the rows (max over every rank) and reads them back:
   one all-reduce and one host read per iteration.
3. **Redo the iteration** when any micro-batch dropped a token on any rank. The counters the
   first pass moved (MoE aux/z-loss tracker, dropped-slot counts) go back to where the
   iteration began; the caller's ``rerun`` zeroes the gradients and runs the schedule again
   over the same micro-batches, with the overflowed positions eager (on every rank alike:
   pipeline stages, expert all-to-alls and tensor-parallel gathers must agree on the mode)
   while the hooks put their MoE layers under `moe.dropless_moe`. The others replay their
   graphs. A second read checks that nothing was dropped (another pass otherwise).

Why redo rather than patch: the first pass already added its dropping gradients into the
gradient buffers and reduced them over data-parallel ranks, scaled by the iteration's token
count; subtracting a micro-batch's dropping backward and adding its dropless one leaves
rounding residue ((a + b) - b != a) and needs the same reductions again. A redo from zero
computes exactly what a schedule that had planned those micro-batches eager would: bitwise,
where the kernels are deterministic. Against a fully eager dropless iteration, the graphed
micro-batches differ only by how drop-and-pad lays rows out (same values, other summation
order). Dropout draws new masks in the rerun (the RNG is not rewound).
"""

import json
from contextlib import contextmanager
from typing import Callable, Dict, FrozenSet, Iterator, List, Sequence

import torch

from megatron.packed_model.moe import MoEAccumulators, dropless_moe, packed_routers
from megatron.packed_graphs.settings import GraphSettings

RERUN_REASON = "moe_overflow_rerun"
"""Why a rerun micro-batch ran eager: the counts' key (the graph plan's reason value)."""


class MoEOverflowRerun:
    """Per-micro-batch overflow detection on the device and the iteration's rerun decision.

    Build it once, after the model (before any graph capture: routers bake the address of
    the shared buffer into their graphs), on every rank, also ranks without MoE layers (they
    take part in the all-reduce). ``max_micro_batches`` bounds the training forward calls of
    a chunk per iteration (e.g. global batch / micro-batch size).

    Per iteration the training loop calls `after_forward_backward` once; in between, the
    hooks count micro-batches per chunk (training forward calls only: evaluation and
    ``torch.no_grad`` calls are not counted). Evaluation calls (chunk in eval mode), which
    run eager, run dropless.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], max_micro_batches: int, *,
                 group=None, max_passes: int = 3):
        if max_micro_batches < 1:
            raise ValueError(f"max_micro_batches is wrong: {max_micro_batches}. Pass the "
                             "largest micro-batch count of an iteration.")
        self.chunks = list(model_chunks)
        self.routers = [packed_routers(chunk) for chunk in self.chunks]
        flat = [router for routers in self.routers for router in routers]
        self.device = flat[0].token_slots.device if flat else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.group, self.max_passes = group, max_passes
        # Max over routers of [dropped slots, peak expert load] of the running forward call.
        self.counter = torch.zeros(2, dtype=torch.int64, device=self.device)
        # One row per micro-batch, then [experts, top-k] and [calls, tokens per call]: maxed
        # over ranks, so ranks without MoE layers learn the shape too.
        self.rows = torch.zeros(max_micro_batches + 2, 2, dtype=torch.int64, device=self.device)
        self.shape = {"num_experts": flat[0].config.num_moe_experts if flat else 0,
                      "moe_router_topk": flat[0].topk if flat else 0, "tokens_per_rank": 0}
        for router in flat:
            router.overflow_counter = self.counter
        self._calls = [0] * len(self.chunks)
        self._dropless: FrozenSet[int] = frozenset()
        self._scope = None
        self._snapshot = None
        self._suspended = False
        self.totals: Dict[str, int] = {RERUN_REASON: 0}
        # Peak expert load per micro-batch position -> how many (for tools/capacity_advisor).
        self.peak_loads: Dict[int, int] = {}
        self.micro_batches_per_iteration = 0
        self._hooks = [hook for index, chunk in enumerate(self.chunks) for hook in (
            chunk.register_forward_pre_hook(lambda module, inputs, i=index: self._before(i)),
            chunk.register_forward_hook(lambda module, inputs, out, i=index: self._after(i)))]

    @classmethod
    def from_settings(cls, settings: GraphSettings, model_chunks: Sequence[torch.nn.Module]):
        """The training run's monitor (the run's graph settings, settings.py); None unless
        ``--moe-capacity-overflow rerun``."""
        if settings.moe is None or settings.moe.capacity_overflow != "rerun":
            return None
        bound = settings.global_batch_size // settings.micro_batch_size
        if settings.cp_banks is None:  # else ranks run unequal shares
            bound //= settings.data_parallel_size
        return cls(model_chunks, max_micro_batches=max(1, bound))

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Forward calls in this block are neither counted nor made dropless: passes that are
        not the iteration's own (the graph health check's, health_check.py, which puts the
        MoE accumulators back itself)."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    # ------------------------------------------------------------------ hooks (no host sync)

    def _counting(self, index: int) -> bool:
        return self.chunks[index].training and torch.is_grad_enabled()

    def _before(self, index: int) -> None:
        if self._suspended:
            return
        if not self.chunks[index].training:  # evaluation runs eager: dropless, as training
            self._enter_dropless(index)
            return
        if not torch.is_grad_enabled():
            return
        if self._snapshot is None:
            self._snapshot = MoEAccumulators(self.chunks)
        micro_batch = self._calls[index]
        if micro_batch >= self.rows.shape[0] - 2:
            raise RuntimeError(f"model chunk {index} ran {micro_batch + 1} training forward "
                               f"calls since the last after_forward_backward; max_micro_batches "
                               f"is {self.rows.shape[0] - 2}. Call after_forward_backward once "
                               "per iteration, with a bound on its micro-batches.")
        self.counter.zero_()  # drops counted between calls (e.g. graph warm-up) are not ours
        if micro_batch in self._dropless:
            self._enter_dropless(index)

    def _after(self, index: int) -> None:
        self._exit_dropless()
        if self._suspended or not self._counting(index):
            return
        row = self.rows[self._calls[index]]
        torch.maximum(row, self.counter, out=row)
        self._calls[index] += 1

    def _enter_dropless(self, index: int) -> None:
        self._scope = dropless_moe(self.chunks[index])
        self._scope.__enter__()

    def _exit_dropless(self) -> None:
        if self._scope is not None:
            scope, self._scope = self._scope, None
            scope.__exit__(None, None, None)

    # ------------------------------------------------------------------ once per iteration

    def read_rows(self) -> List[List[int]]:
        """This pass's ``[dropped slots, peak expert load]`` per micro-batch position, the max
        over ranks; resets the rows for the next pass. Syncs: one all-reduce (max, over
        ``group``, default the world) and one host read; call it on every rank."""
        tokens = max((r.num_tokens or 0 for routers in self.routers for r in routers), default=0)
        for (row, column), value in {(-2, 0): self.shape["num_experts"],
                                     (-2, 1): self.shape["moe_router_topk"],
                                     (-1, 0): max(self._calls, default=0),
                                     (-1, 1): tokens}.items():
            self.rows[row, column] = value
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.rows, op=torch.distributed.ReduceOp.MAX,
                                         group=self.group)
        rows = self.rows.tolist()  # the iteration's host read
        self.rows.zero_()
        self._calls = [0] * len(self.chunks)
        (experts, topk), (calls, tokens) = rows[-2:]
        self.shape = {"num_experts": experts, "moe_router_topk": topk, "tokens_per_rank": tokens}
        return rows[:calls]

    def after_forward_backward(self, result, rerun: Callable[[FrozenSet[int]], object]):
        """Decide after the iteration's schedule (before the optimizer step), and rerun.

        ``result``: what the schedule returned (e.g. ``losses_reduced``). ``rerun(eager)``
        must zero the gradient buffers and run the schedule again over the same micro-batches
        (see `CachingIterator`), with the micro-batches at positions ``eager`` run eager,
        graphs bypassed (the hooks make their MoE layers dropless), and return the new
        result. Returns ``(result, counts)``: the final result and ``{RERUN_REASON: number
        of micro-batches rerun eager}`` for this iteration (also added to `totals`).

        Syncs: one all-reduce and host read; after a rerun, one more per pass.
        """
        try:
            rows = self.read_rows()
            self._record_peaks([peak for _, peak in rows])
            overflowed = {i for i, (dropped, _) in enumerate(rows) if dropped}
            passes = 0
            while overflowed:
                if overflowed & self._dropless:
                    raise RuntimeError(
                        f"micro-batches {sorted(overflowed & self._dropless)} dropped MoE "
                        "tokens in their dropless rerun: rerun(eager) must run them eager "
                        "(graphs bypassed), or the captured drop-and-pad replays")
                if passes == self.max_passes:
                    raise RuntimeError(f"micro-batches {sorted(overflowed)} still dropped MoE "
                                       f"tokens after {passes} dropless reruns")
                self._dropless = frozenset(overflowed | self._dropless)
                self._snapshot.restore()
                result = rerun(self._dropless)
                passes += 1
                overflowed = {i for i, (dropped, _) in enumerate(self.read_rows()) if dropped}
            count = len(self._dropless)
        finally:
            self._exit_dropless()  # a rerun that raised inside a dropless forward
            self._dropless, self._snapshot = frozenset(), None
        self.totals[RERUN_REASON] += count
        return result, {RERUN_REASON: count}

    def _record_peaks(self, peaks: List[int]) -> None:
        for peak in peaks:
            self.peak_loads[peak] = self.peak_loads.get(peak, 0) + 1
        self.micro_batches_per_iteration = max(self.micro_batches_per_iteration, len(peaks))

    def router_load_record(self) -> dict:
        """The peak expert loads seen so far, in the format tools/capacity_advisor.py reads
        (``--moe-router-loads``): one sample per micro-batch position of an iteration, the
        most tokens one expert of one MoE layer received from one rank, before the capacity."""
        return {**self.shape, "micro_batches_per_iteration": self.micro_batches_per_iteration,
                "peak_loads": {str(load): n for load, n in sorted(self.peak_loads.items())}}

    def write_router_loads(self, path: str) -> None:
        """Write `router_load_record` as JSON (``--moe-router-load-file``). Every rank holds the
        same record (loads and shape are maxed over ranks): global rank 0 writes."""
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        with open(path, "w") as f:
            json.dump(self.router_load_record(), f, indent=1)

    def remove(self) -> None:
        """Take the hooks off and detach the routers' shared buffer."""
        for hook in self._hooks:
            hook.remove()
        for routers in self.routers:
            for router in routers:
                router.overflow_counter = None


class CachingIterator:
    """Wraps a data iterator and keeps what it yielded since the last `clear`, so a rerun
    reads the iteration's micro-batches again, in the same order.

    ``next()`` reads the source and caches; `replay()` iterates over the cache (as often as
    needed); `clear()`, once the iteration is final, starts the next iteration's cache.
    """

    def __init__(self, source: Iterator):
        self.source = source
        self.cache: list = []

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.source)
        self.cache.append(item)
        return item

    def replay(self) -> Iterator:
        """The items read since the last `clear`, again."""
        return iter(list(self.cache))

    def clear(self) -> None:
        self.cache = []
