"""The one CUDA-graph runtime of a training run: plan, capture, replay, fallback, statistics.

Built once from the run's frozen `GraphSettings` (settings.py) and the model chunks
(`GraphRuntime.from_settings`); it plans with the `GraphRuntimeConfig` derived from them.
The training loop hands it each iteration's micro-batches and its forward step:

    with graphs.iteration(micro_batches, forward_step) as step:
        losses = step.run(schedule)  # schedule(step.forward_step, step.micro_batches)
    log(step.stats)

On entry every micro-batch gets its `StepGraphPlan` on the host (`dispatch.plan_iteration`,
per model chunk: `dispatch.plan_chunks`), and Transformer Engine graphs are captured when
this is their capture iteration (before the schedule: one bank, or one per CP size). Each
micro-batch then runs under its plan (`plan.running`): the graphable modules read it,
megatron-core's local graphs record it and capture at the end of the schedule. On exit the
iteration's statistics are in ``step.stats``: documents per micro-batch, graph fallbacks,
eager micro-batches by reason, capture time and memory. A forward-only pass
(``training=False``: evaluation, log-probs) runs with the model in eval mode and replays
forward-only graphs (forward_graphs.py), one per capacity, captured at the first such pass;
where they cannot run it is eager (`Reason.EVAL`); its statistics are its own. With
``--cuda-graph-check-interval``
the exit of every N-th training iteration first runs the graph health check
(health_check.py), which may turn graphs off for the rest of the run.

With ``--cuda-graph-impl full_iteration`` an iteration may instead be one graph
(full_iteration.py): the runtime plans the iteration as a whole first (`IterationPlan`), stages
its micro-batches into the graph's static inputs and captures or replays the schedule
(`run_iteration_graph`); an iteration that misses runs per micro-batch as above, counted.

Every piece of graph state lives in the runtime or in the model's own graph managers: which
capacities and banks are captured, the TE banks, the iteration count. The model chunks' slot
tables are built once, here.

The forward step the runtime drives (megatron.packed_training.packed_step.PackedForwardStep):

* ``stage(batch, capacity)`` -> a staged micro-batch with ``params`` (its PackedBatchParams):
  the host micro-batch on the device, ``cu_seqlens`` padded to ``capacity`` when not None;
* ``run(model, staged)`` -> ``(output, loss_func)``, megatron-core's forward-step result;
* ``bank_layout(cp_size, capacity)`` -> params laid out like a graphed micro-batch of that
  CP size (dynamic CP banks are captured with it);
* ``graph_layout(cp_size, capacity, like)`` -> a staged micro-batch laid out like a graphed
  one of that CP size and capacity, as long as the collated micro-batch ``like`` (forward-only
  graphs are captured with it).

From each micro-batch (a collated dict) the runtime reads the host values ``num_segments``,
``num_documents`` and, under dynamic CP, ``cp_turn`` (its CP size), ``cp_mix``, ``cp_rounds``,
``iteration_positions``.
"""

from collections import Counter
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Callable, Collection, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.packed_upstream import graph_engine
from megatron.packed_graphs.capacity import fits_capacity
from megatron.packed_graphs.chunk_graphs import chunk_slot_count
from megatron.packed_graphs.full_iteration import (
    IterationGraph,
    IterationPlan,
    all_ranks_fit,
    iteration_graph_due,
    plan_full_iteration,
)
from megatron.packed_graphs.forward_graphs import ForwardGraphs, eval_mode, forward_graph_pool
from megatron.packed_graphs import fp8_state
from megatron.packed_graphs.fp8_state import WeightCacheFlag
from megatron.packed_graphs.graph_memory import capture_graph
from megatron.packed_graphs.health_check import GraphHealthCheck, HealthCheckConfig
from megatron.packed_model.moe import moe_accumulators_kept
from megatron.packed_graphs.dispatch import (
    assign_chunk_slots,
    micro_batch_reasons,
    plan_chunks,
    plan_iteration,
)
from megatron.packed_graphs.plan import (
    FALLBACK_REASONS,
    Granularity,
    GraphKey,
    GraphRuntimeConfig,
    Mode,
    Reason,
    StepGraphPlan,
    running,
)
from megatron.packed_graphs.settings import GraphSettings
from megatron.packed_graphs.te_graphs import TELayerGraphs

PLAN_KEY = "graph_plan"  # where a planned micro-batch (a copy of the loader's dict) holds its plan
STATIC_KEY = "static_micro_batch"  # an iteration graph's micro-batch: its static staged inputs
# Dynamic CP: the statistic holding the iteration's token positions (its samples, all ranks).
ITERATION_POSITIONS = "iteration positions"


def tokens_per_rank(settings: GraphSettings) -> int:
    """Positions of a micro-batch's THD stream that one rank's layers see."""
    if settings.cp_banks is not None:
        return settings.cp_banks.tokens_per_rank
    tokens = settings.micro_batch_size * settings.seq_length // settings.context_parallel_size
    return tokens // settings.tensor_parallel_size if settings.sequence_parallel else tokens


def forward_graphs_unavailable(settings: GraphSettings,
                               fp8_recipe: Optional[str] = None) -> Optional[str]:
    """Why forward-only passes of this run cannot replay forward-only graphs (they then run
    eager, `Reason.EVAL`); None when they can. A forward-only graph holds the whole forward
    pass of a model chunk: every part of it must be capturable, and nothing outside it may
    be needed between micro-batches. ``fp8_recipe``: the model's (`fp8_state.fp8_recipe`)."""
    if settings.impl == "none":
        return "--cuda-graph-impl none"
    fp8_reason = fp8_state.forward_graphs_unavailable(fp8_recipe)
    if fp8_reason:
        return fp8_reason
    if settings.pipeline_parallel_size > 1:
        return ("pipeline parallelism (a stage's forward waits on the previous stage's send, "
                "outside any graph)")
    if settings.overlap_param_gather:
        return ("--overlap-param-gather (DDP gathers the parameters in forward pre-hooks, "
                "which a replay does not run)")
    moe = settings.moe
    if moe is not None:
        if moe.capacity_overflow == "rerun":
            return ("--moe-capacity-overflow rerun (forward-only passes run the MoE layers "
                    "dropless, which reads token counts on the host)")
        if not moe.dropless_graphs and (moe.expert_capacity_factor is None
                                        or not moe.pad_expert_input_to_capacity):
            return ("MoE without drop-and-pad (the dispatch reads token counts on the host); "
                    "add --moe-dropless-graphs, or --moe-expert-capacity-factor and "
                    "--moe-pad-expert-input-to-capacity")
    return None


def runtime_config(settings: GraphSettings, slots_per_chunk: Sequence[int] = (1,),
                   fp8_recipe: Optional[str] = None) -> GraphRuntimeConfig:
    """The runtime's frozen plan settings from the run's graph settings (docs/cuda-graphs.md):
    a full-iteration run plans local layer (or chunk) graphs for its misses, dynamic CP under
    TE graphs one bank per CP size."""
    impl = settings.impl
    full_iteration = impl == "full_iteration"  # local layer or chunk graphs for its misses
    impl = "local" if full_iteration else impl
    banks = ()
    if settings.cp_banks is not None and impl == "transformer_engine":
        granularity = Granularity.CP_BANK
        banks = tuple(zip(settings.cp_banks.sizes, settings.cp_banks.max_packed_seqs))
    else:
        granularity = Granularity(settings.granularity)
    return GraphRuntimeConfig(
        impl=impl, granularity=granularity,
        capacity=settings.capacity,
        warmup_iterations=settings.warmup_steps,
        ladder=tuple(settings.ladder),
        capture_needs_all_micro_batches=settings.pipeline_parallel_size > 1,
        cp_size=settings.context_parallel_size, bank_capacities=banks,
        slots_per_chunk=tuple(slots_per_chunk), tokens_per_rank=tokens_per_rank(settings),
        full_iteration=full_iteration,
        iteration_micro_batches=settings.num_microbatches if full_iteration else 0,
        forward_graphs=forward_graphs_unavailable(settings, fp8_recipe) is None)


class GraphRuntime:
    """Owner of every CUDA-graph decision and all graph state of a run (see module doc)."""

    def __init__(self, config: GraphRuntimeConfig, model: Sequence[torch.nn.Module] = (),
                 model_config=None, health_check: HealthCheckConfig = HealthCheckConfig(),
                 check_guards: Sequence[Callable] = ()):
        self.config = config
        self.model = list(model)
        self.iterations = 0  # training iterations run through the runtime
        self.captured: frozenset = frozenset()  # (CP size, capacity) pairs graphs exist for
        # Graphs turned off for the rest of the run (the health check's disable action).
        self.graphs_off = False
        # check_guards: context managers the check's passes run in (health_check.py).
        self.health_check = GraphHealthCheck(health_check, self.model, check_guards)
        # Eager micro-batches of the whole run by reason (training and evaluation).
        self.eager_totals: Counter = Counter()
        # Full-iteration graphs: training iterations that missed the graph, by reason.
        self.iteration_misses: Counter = Counter()
        self.te_graphs: Optional[TELayerGraphs] = None
        if config.impl == "transformer_engine":
            self.te_graphs = TELayerGraphs(self.model, model_config, config.tokens_per_rank)
        # More per-iteration statistics, from graphs outside the schedule (`add_statistics`).
        self.statistics_sources: List[Callable[[], dict]] = []
        # Full-iteration graphs: the iteration graph, and the group whose ranks agree on it.
        self.iteration_graph: Optional[IterationGraph] = None
        self.agreement_group = None
        if config.full_iteration:
            # Layer-graph replays leave events on the parameters that a capture may not
            # wait on; they are complete after the capture's device sync.
            self.iteration_graph = IterationGraph(
                _rng_states, partial(graph_engine.forget_layer_graph_grad_events, self.model))
        # Forward-only graphs, one set per forward step handed to a forward-only pass
        # (evaluation's, log-probs'), all in one pool: the local layer graphs' where training
        # graphs are local, so forward-only passes add little graph memory.
        self.forward_graphs: List[ForwardGraphs] = []
        self.forward_pool = forward_graph_pool(
            graph_engine.local_graph_pool if config.impl == "local" else None)
        self.forward_capture: Callable = capture_graph  # CPU tests pass a stand-in
        # Why forward-only passes run eager (from_settings; None: they replay graphs, or unknown).
        self.forward_eager_reason: Optional[str] = None
        self._forced = False  # inside `forced_eager`
        # FP8: the writer of TE's weight-cache flag (fp8_state.py); a no-op without FP8.
        self.fp8_weights = WeightCacheFlag.for_run(model_config)

    def add_statistics(self, source: Callable[[], dict]) -> None:
        """Add ``source()`` to every training iteration's statistics (called on the
        iteration's exit, after the optimizer step): e.g. the optimizer graph's eager steps
        and capture time (optimizer_graph.py)."""
        self.statistics_sources.append(source)

    @classmethod
    def from_settings(cls, settings: GraphSettings, model: Sequence[torch.nn.Module],
                      model_config, check_guards: Sequence[Callable] = ()) -> "GraphRuntime":
        """The run's runtime: its graph settings (built once from the validated arguments,
        settings.py), chunk slots from this rank's pipeline schedule (chunk granularity; needs
        the parallel state), TE layer graphs, the health check (``check_guards``: see
        `GraphHealthCheck`)."""
        recipe = fp8_state.fp8_recipe(model_config)
        fp8_state.check_fp8_graphs(settings.impl, settings.granularity, recipe)
        if recipe is not None and settings.impl in ("local", "full_iteration"):
            from megatron.packed_upstream.graph_engine import graph_runtime_owns_fp8_weight_flag

            graph_runtime_owns_fp8_weight_flag()
        slots = (1,)
        if settings.impl in ("local", "full_iteration") and settings.granularity == "chunk":
            slots = tuple(chunk_slot_count(model_config, chunk) for chunk in range(len(model)))
        runtime = cls(runtime_config(settings, slots, recipe), model, model_config,
                      settings.health_check, check_guards)
        runtime.forward_eager_reason = forward_graphs_unavailable(settings, recipe)
        if runtime.iteration_graph is not None:
            from megatron.core import parallel_state

            runtime.agreement_group = parallel_state.get_data_parallel_group_gloo(
                with_context_parallel=True)
        return runtime

    def describe(self) -> str:
        """One start-up log line: what is graphed and how."""
        c = self.config
        if not c.enabled:
            return ("cuda graphs: off (--cuda-graph-impl none); every micro-batch runs eager: "
                    "disabled")
        if c.granularity is Granularity.CP_BANK:
            sizes = ", ".join(f"cp{size}: {capacity}" for size, capacity in c.bank_capacities)
            what = f"capacity per CP-size bank {sizes}"
        else:
            what = "capacities " + ",".join(map(str, c.capacities))
        if c.granularity is Granularity.CHUNK:
            what += ", slots per chunk " + ",".join(map(str, c.slots_per_chunk))
        line = (f"cuda graphs: {c.granularity.value} graphs ({c.impl}), {what}, "
                f"{c.warmup_iterations} eager warm-up iterations")
        if c.full_iteration:
            line = (f"cuda graphs: full-iteration graphs of {c.iteration_micro_batches} "
                    f"micro-batches at capacity {c.capacity}; iterations that miss run "
                    + line.removeprefix("cuda graphs: "))
        if c.forward_graphs:
            line += ("; forward-only passes (evaluation, log-probs): forward-only graphs at "
                     + ", ".join(f"cp{size}: {capacity}" if c.bank_capacities else str(capacity)
                                 for size, capacity in c.forward_banks))
        elif self.forward_eager_reason:
            line += f"; forward-only passes run eager: {self.forward_eager_reason}"
        check = self.health_check.config
        if check.enabled:
            line += (f", health check every {check.interval} iterations (tolerance "
                     f"{check.tolerance:g}, on divergence: {check.action})")
        return line

    @contextmanager
    def forced_eager(self) -> Iterator[None]:
        """Every micro-batch of the passes in this scope runs eager (`Reason.FORCED`, counted):
        an eager reference on the same weights, e.g. log-probs to compare a replay with.
        Nothing is captured in the scope; a training iteration in it still counts."""
        forced, self._forced = self._forced, True
        try:
            yield
        finally:
            self._forced = forced

    # -- planning ------------------------------------------------------------------------------

    def plan(self, micro_batches: Sequence[Sequence[dict]], training: bool = True,
             forward_step=None) -> List[List[StepGraphPlan]]:
        """Plans of an iteration's micro-batches (one list per model chunk, every chunk the
        same micro-batches), for this runtime's state. A forward-only pass
        (``training=False``) is planned against ``forward_step``'s forward-only graphs. Host
        only; changes nothing."""
        batches = micro_batches[0]
        cp_sizes = None
        if self.config.granularity is Granularity.CP_BANK:
            cp_sizes = [batch["cp_turn"].cp_size for batch in batches]
        forward_captured = () if training else self._forward_bank(forward_step).captured
        plans = plan_iteration(self.config, self.iterations, self.captured,
                               [batch["num_segments"] for batch in batches], cp_sizes,
                               training=training, graphs_off=self.graphs_off,
                               forward_captured=forward_captured, forced=self._forced)
        return plan_chunks(self.config, plans, len(micro_batches))

    def plan_iteration_graph(self, micro_batches: Sequence[Sequence[dict]], training: bool = True,
                             forward_step=None
                             ) -> Tuple[Optional[IterationPlan], List[List[StepGraphPlan]]]:
        """The iteration's plan (None without full-iteration graphs, and for a forward-only
        pass) and its micro-batches' plans, one list per model chunk. Where the iteration
        graph is due, the data-parallel ranks agree whether all their micro-batches fit (one
        host all-reduce, no device sync)."""
        if self.iteration_graph is None or not training or self._forced:
            return None, self.plan(micro_batches, training, forward_step)
        counts = [batch["num_segments"] for batch in micro_batches[0]]
        captured, fit = self.iteration_graph.captured, None
        if iteration_graph_due(self.config, self.iterations, captured, training=training,
                               graphs_off=self.graphs_off):
            fit = all_ranks_fit(all(fits_capacity(count, self.config.capacity)
                                    for count in counts), self.agreement_group)
        whole, plans = plan_full_iteration(self.config, self.iterations, self.captured,
                                           captured, counts, fit_everywhere=fit,
                                           training=training, graphs_off=self.graphs_off)
        if whole.uses_graph:  # one graph: no chunk slots
            return whole, [list(plans) for _ in micro_batches]
        return whole, plan_chunks(self.config, plans, len(micro_batches))

    @contextmanager
    def iteration(self, micro_batches: Sequence[Sequence[dict]], forward_step,
                  training: bool = True) -> Iterator["GraphIteration"]:
        """One iteration (training, or a forward-only pass) over ``micro_batches``, one list
        per model chunk. Plans and, in the TE capture iteration or the first forward-only pass
        that needs forward-only graphs, captures on entry (syncs the device); yields the
        `GraphIteration` the schedule runs; collects statistics on exit. A forward-only pass
        runs with every model chunk in eval mode."""
        if not training:
            with eval_mode(self.model):
                yield from self._forward_only_iteration(micro_batches, forward_step)
            return
        whole, plans = self.plan_iteration_graph(micro_batches)
        step = GraphIteration(self, forward_step, micro_batches, plans, True, whole)
        self.fp8_weights.begin_pass(self.model)  # the optimizer stepped since the last pass
        # Layer (or chunk) graphs are recorded only in iterations that are not one graph.
        capturing = (self.config.enabled and not self.captured and not self.graphs_off
                     and not self._forced and not (whole and whole.uses_graph))
        # Capture warm-up runs the layers on placeholder inputs: keep it out of the MoE aux
        # losses and drop counts of this step (TE captures here, local at the schedule's end).
        keep_moe_accumulators = partial(moe_accumulators_kept, self.model)
        capture_stats = {}
        if capturing and self.te_graphs:
            with keep_moe_accumulators():
                capture_stats = self._capture_te(step)
        with (graph_engine.guard_local_capture(keep_moe_accumulators) if capturing
              else nullcontext()):
            yield step
        checked = self._check_health(step)
        step.stats = self._statistics(step)
        if capturing:
            step.stats |= capture_stats | self._after_capture(step)
        step.stats |= checked or self.health_check.counts()
        if whole is not None:
            step.stats |= self._iteration_graph_statistics(step)
        self.iterations += 1

    def _forward_only_iteration(self, micro_batches, forward_step) -> Iterator["GraphIteration"]:
        """`iteration` for a forward-only pass (model chunks in eval mode already): plans;
        at the first pass that may use forward-only graphs, captures every bank first (on
        every rank, whatever its own micro-batches need: captures run collectives); yields;
        collects the pass's statistics."""
        _, plans = self.plan_iteration_graph(micro_batches, False, forward_step)
        step = GraphIteration(self, forward_step, micro_batches, plans, False)
        self.fp8_weights.begin_pass(self.model)  # weights may be new (a step, an RL refit)
        capture_stats = {}
        if (self.config.forward_graphs and not self.graphs_off and not self._forced
                and not self._forward_bank(forward_step).captured):
            capture_stats = self._capture_forward(step)
        yield step
        step.stats = self._statistics(step) | capture_stats

    def run_micro_batch(self, forward_step, model, batch: dict, plan: StepGraphPlan):
        """Stage ``batch``, load a graphed one into its TE bank, call the model under ``plan``;
        a forward-only graph's micro-batch replays that graph instead.

        Returns megatron-core's forward-step result ``(output, loss_func)``; a forward-only
        graph's is graph-owned (forward_graphs.py: consume it before the next micro-batch).
        """
        if plan.uses_graphs:  # captured too, inside a full-iteration graph
            self.fp8_weights.before_graphed(model)
        if plan.forward_only:
            staged = forward_step.stage(batch, plan.capacity)
            return self._forward_bank(forward_step).run(model, plan.key, staged)
        staged = batch.get(STATIC_KEY)  # an iteration graph's micro-batch is staged already
        if staged is None:
            staged = forward_step.stage(batch, self._staging_capacity(batch, plan))
        if plan.uses_graphs and self.te_graphs is not None:
            staged.params = self.te_graphs.load(plan.key.cp_size, staged.params)
        with running(plan):
            return forward_step.run(model, staged)

    def _staging_capacity(self, batch: dict, plan: StepGraphPlan) -> Optional[int]:
        """The capacity ``batch``'s boundaries are padded to: its plan's; under full-iteration
        graphs also in the eager warm-up when it fits, so the kernels' one-time set-up
        (autotuning, attention plans per boundary count) sees the layout the iteration graph
        is captured with, outside the capture. Padding adds zero-length segments only."""
        if (plan.capacity is None and plan.reason is Reason.WARMUP
                and self.iteration_graph is not None
                and fits_capacity(batch["num_segments"], self.config.capacity)):
            return self.config.capacity
        return plan.capacity

    def run_iteration_graph(self, step: "GraphIteration", schedule: Callable):
        """The iteration as one graph (full_iteration.py): every micro-batch staged at the top
        capacity into the graph's static inputs; in the capture iteration the schedule over
        them is captured (syncs the device); then the graph replays. Returns the schedule's
        result: graph-owned losses, overwritten by the next replay."""
        staged = [step.forward.stage(batch, plan.capacity)
                  for batch, plan in zip(step.micro_batches[0], step.plans[0])]

        def schedule_static(static):
            return schedule(step.forward_step, [
                [{PLAN_KEY: plan, STATIC_KEY: mb} for mb, plan in zip(static, chunk_plans)]
                for chunk_plans in step.plans])

        result, step.graph_stats = self.iteration_graph.run(step.whole.mode, staged,
                                                            schedule_static)
        return result

    # -- capture -------------------------------------------------------------------------------

    def _capture_te(self, step: "GraphIteration") -> dict:
        """TE graphs are captured before the schedule of their capture iteration: every CP
        bank at the first iteration past the warm-up (every rank alike: captures run the
        groups' collectives), or one bank laid out like the iteration's first graphed
        micro-batch."""
        config, forward_step = self.config, step.forward
        if config.granularity is Granularity.CP_BANK:
            if self.iterations < config.warmup_iterations:
                return {}
            banks = [(size, forward_step.bank_layout(size, capacity))
                     for size, capacity in config.bank_capacities]
            self.captured = frozenset(config.bank_capacities)
            return self.te_graphs.capture(banks)
        first = next(((batch, plan) for batch, plan in zip(step.micro_batches[0], step.plans[0])
                      if plan.mode is Mode.CAPTURE), None)
        if first is None:
            return {}
        batch, plan = first
        stats = self.te_graphs.capture([(plan.key.cp_size,
                                         forward_step.stage(batch, plan.capacity).params)])
        self.captured = frozenset({(plan.key.cp_size, plan.key.capacity)})
        return stats

    def _forward_bank(self, forward_step) -> ForwardGraphs:
        """The forward-only graphs of ``forward_step`` (made empty at first ask)."""
        for bank in self.forward_graphs:
            if bank.forward_step is forward_step:
                return bank
        bank = ForwardGraphs(forward_step, self.forward_pool, capture=self.forward_capture,
                             rng_states=_rng_states,
                             guard=partial(moe_accumulators_kept, self.model))
        self.forward_graphs.append(bank)
        return bank

    def _capture_forward(self, step: "GraphIteration") -> dict:
        """Every forward-only bank of the run (`GraphRuntimeConfig.forward_banks`), each laid
        out like the pass's first micro-batch (one all-padding segment at the bank's
        capacity), over the one model chunk (PP = 1). Every rank captures the same banks in
        the same order: the first forward-only pass is reached by every rank together.
        Syncs the device."""
        if len(self.model) != 1:
            raise RuntimeError(f"forward-only graphs capture one model chunk (PP = 1); the "
                               f"runtime holds {len(self.model)}")
        like = step.micro_batches[0][0]
        layouts = [(GraphKey.forward(capacity, size),
                    step.forward.graph_layout(size, capacity, like))
                   for size, capacity in self.config.forward_banks]
        return self._forward_bank(step.forward).capture(self.model[0], layouts)

    def _after_capture(self, step: "GraphIteration") -> dict:
        """After the schedule of an iteration that had nothing captured at its start: what the
        local implementation captured at its end (TE: captured before it)."""
        recorded = {(plan.key.cp_size, plan.key.capacity) for plans in step.plans for plan in plans
                    if plan.mode is Mode.CAPTURE}
        stats: dict = {}
        if self.te_graphs is None and recorded:
            self.captured = frozenset(recorded)
            if self.config.ladder:
                stats["graph capacities"] = ",".join(str(c) for _, c in sorted(recorded))
            stats |= _drain_capture_log()
        if not self.captured:
            reasons = micro_batch_reasons(step.plans)
            stats["cuda graphs"] = reasons[0].value if reasons else "-"
        return stats

    # -- health check --------------------------------------------------------------------------

    def _check_health(self, step: "GraphIteration") -> dict:
        """The graph health check at the end of a due training iteration (health_check.py):
        one graphed micro-batch replayed and run eager, its eager pass counted
        (`Reason.HEALTH_CHECK`); on a divergence with action ``disable`` every later
        micro-batch is planned eager (`Reason.DISABLED`). Syncs once when due; {} otherwise."""
        check = self.health_check
        if (not self.config.enabled or self.graphs_off
                or not check.due(self.iterations + 1, self.config.warmup_iterations)):
            return {}
        self.fp8_weights.begin_pass(self.model)  # after the optimizer step: re-quantize
        result = check.run(self.iterations + 1, step.micro_batches[0], step.plans[0],
                           partial(self.run_micro_batch, step.forward, self.model[0]))
        step.count_rerun(Reason.HEALTH_CHECK, [result.position])
        if result.diverged and check.config.action == "disable":
            self.graphs_off = True
        return check.stats(result)

    # -- statistics ----------------------------------------------------------------------------

    def _iteration_graph_statistics(self, step: "GraphIteration") -> dict:
        """A training iteration's full-iteration counters: ``iteration graphs: 1`` when it ran
        as one graph (plus the capture's time and memory), ``iteration graph misses: 1`` and
        ``iteration graph miss <reason>: 1`` when it ran per micro-batch instead."""
        whole = step.whole
        if whole.uses_graph:
            return {"iteration graphs": 1} | step.graph_stats
        if whole.miss is None:
            return {}
        self.iteration_misses[whole.miss] += 1
        return {"iteration graph misses": 1, f"iteration graph miss {whole.miss.value}": 1}

    def _statistics(self, step: "GraphIteration") -> dict:
        batches = step.micro_batches[0]
        stats: dict = {}
        if step.training:
            documents = sum(batch["num_documents"] for batch in batches)
            stats["docs per micro-batch"] = round(documents / max(len(batches), 1), 2)
            for source in self.statistics_sources:
                stats |= source()
            if batches and "cp_mix" in batches[0]:  # dynamic CP: the iteration's sizes, rounds
                stats |= {"cp micro-batches": batches[0]["cp_mix"],
                          "cp rounds": batches[0]["cp_rounds"],
                          "cp turns": len(batches),  # this rank's micro-batches
                          # Samples differ in length: the log's throughput counts these.
                          ITERATION_POSITIONS: batches[0]["iteration_positions"]}
        eager = Counter(r for r in micro_batch_reasons(step.plans) if r is not Reason.GRAPHED)
        eager.update(step.reruns)
        self.eager_totals.update(eager)
        if not self.config.enabled:
            return stats
        if step.training:
            stats["graph fallbacks"] = sum(n for r, n in eager.items() if r in FALLBACK_REASONS)
        elif self.config.forward_graphs:
            stats["forward graphs"] = sum(plan.forward_only for plan in step.plans[0])
        stats |= {f"eager {reason.value}": count for reason, count in sorted(eager.items())}
        return stats


def _rng_states() -> dict:
    """The RNG tracker's generators, which an iteration graph's dropout must advance."""
    from megatron.core.tensor_parallel.random import get_all_rng_states

    return get_all_rng_states()


def _drain_capture_log() -> dict:
    """The latest end-of-schedule capture's statistics (graph_engine.capture_log), emptied."""
    capture = None
    while graph_engine.capture_log:
        capture = graph_engine.capture_log.popleft()
    if capture is None:
        return {}
    return {"graph capture (s)": round(capture["time"], 2),
            "graph memory (MiB)": round(capture["graph_reserved_bytes"] / 2**20, 1),
            "graphs captured": capture["graphs"]}


class GraphIteration:
    """One planned iteration: the micro-batches with their plans, and the forward step.

    ``micro_batches``: one list per model chunk of copies of the loader's dicts, each holding
    its plan under `PLAN_KEY`; ``plans``: the same plans; ``stats``: filled when the
    iteration's scope exits.
    """

    def __init__(self, runtime: GraphRuntime, forward_step, micro_batches, plans, training,
                 whole: Optional[IterationPlan] = None):
        self.runtime, self.forward, self.training = runtime, forward_step, training
        # Full-iteration graphs: the iteration's own plan (None without them), and the
        # capture statistics of its graph.
        self.whole = whole
        self.graph_stats: Dict = {}
        self.plans: List[List[StepGraphPlan]] = plans
        self.micro_batches: List[List[dict]] = [
            [{**batch, PLAN_KEY: plan} for batch, plan in zip(batches, chunk_plans)]
            for batches, chunk_plans in zip(micro_batches, plans)]
        self._rerun: Dict[Reason, set] = {}  # positions rerun eager, by reason
        self.stats: Dict = {}

    @property
    def reruns(self) -> Counter:
        """Micro-batches run again eager, by reason (each counted once however often)."""
        return Counter({reason: len(positions) for reason, positions in self._rerun.items()})

    def count_rerun(self, reason: Reason, positions: Collection[int]) -> None:
        """Count the micro-batches at ``positions`` as run again eager for ``reason``."""
        self._rerun.setdefault(reason, set()).update(positions)

    def forward_step(self, data_iterator, model):
        """megatron-core's ``forward_step_func``: the next planned micro-batch, under its plan."""
        batch = next(data_iterator)
        return self.runtime.run_micro_batch(self.forward, model, batch, batch[PLAN_KEY])

    def run(self, schedule: Callable):
        """The iteration's forward and backward passes: ``schedule(forward_step,
        micro_batches)`` (megatron-core's schedule over this iteration's planned micro-batches).

        With full-iteration graphs an iteration planned as one graph captures or replays
        this call (`GraphRuntime.run_iteration_graph`); one that misses runs it as is.
        """
        if self.whole is not None and self.whole.uses_graph:
            return self.runtime.run_iteration_graph(self, schedule)
        return schedule(self.forward_step, self.micro_batches)

    def rerun(self, eager: Collection[int], schedule: Callable,
              reason: Reason = Reason.MOE_OVERFLOW_RERUN):
        """Run the iteration's schedule again with the micro-batches at positions ``eager``
        eager for ``reason``, the others replaying their graphs (captured by now); returns
        what the schedule returns. Counted in this iteration's statistics, once per rerun
        micro-batch (a later rerun of the same one is not counted again). The caller zeroes
        the gradients first (moe_rerun.py redoes the whole iteration so that no dropping
        backward stays in them).
        """
        rerun_plan = StepGraphPlan.eager(reason)
        plans = []
        for chunk, chunk_plans in enumerate(self.plans):
            again = [rerun_plan if i in eager else _replayed(plan)
                     for i, plan in enumerate(chunk_plans)]
            if self.runtime.config.granularity is Granularity.CHUNK and self.runtime.config.enabled:
                again = assign_chunk_slots(again, self.runtime.config.slots_per_chunk[chunk])
            plans.append(again)
        self.count_rerun(reason, eager)
        micro_batches = [[{**batch, PLAN_KEY: plan} for batch, plan in zip(batches, chunk_plans)]
                         for batches, chunk_plans in zip(self.micro_batches, plans)]
        return schedule(self.forward_step, micro_batches)


def _replayed(plan: StepGraphPlan) -> StepGraphPlan:
    """A plan run again after its iteration's first pass: graphs recorded in that pass are
    captured by now, so they replay."""
    if plan.mode is Mode.CAPTURE:
        return StepGraphPlan.graphed(Mode.REPLAY, plan.key)
    return plan
