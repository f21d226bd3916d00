"""The graph runtime on CPU: plans per iteration, capture bookkeeping, statistics, eval, reruns.

The forward step here records what the runtime asks of it (stage, run, bank layout); the
schedule calls it once per micro-batch, as megatron-core's does. Captures themselves run on
the GPU (tests/gpu).
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megatron.packed_upstream import graph_engine
from megatron.packed_model.dynamic_cp import CPTurn
from megatron.packed_graphs.plan import (
    Granularity,
    GraphRuntimeConfig,
    Mode,
    Reason,
    active_plan,
)
from megatron.packed_graphs.runtime import PLAN_KEY, GraphRuntime, runtime_config
from megatron.packed_graphs.settings import CPBanks, GraphSettings

LOCAL = GraphRuntimeConfig(impl="local", capacity=8, warmup_iterations=1)


class RecordingStep:
    """A forward step that records the runtime's calls (ids stand in for the tensors)."""

    def __init__(self):
        self.staged, self.runs, self.layouts = [], [], []

    def stage(self, batch, capacity):
        self.staged.append((batch["id"], capacity))
        return SimpleNamespace(params=f"params of {batch['id']}", batch=batch)

    def run(self, model, staged):
        self.runs.append((staged.batch["id"], active_plan(), staged.params))
        return f"output of {staged.batch['id']}", None

    def bank_layout(self, cp_size, capacity):
        self.layouts.append((cp_size, capacity))
        return f"layout cp{cp_size}"


def batches(*segments, docs=None, **extra):
    docs = docs or segments
    return [[{"id": i, "num_segments": s, "num_documents": d, **extra}
             for i, (s, d) in enumerate(zip(segments, docs))]]


def schedule(forward_step, micro_batches):
    """megatron-core's schedule at PP = 1: forward_step once per micro-batch, in order."""
    data = iter(micro_batches[0])
    return [forward_step(data, "model") for _ in micro_batches[0]]


def run(runtime, micro_batches, step=None, training=True, during=None):
    step = step or RecordingStep()
    with runtime.iteration(micro_batches, step, training=training) as it:
        outputs = it.run(schedule)
        if during:
            during(it)
    return it, outputs, step


def fake_capture(forward_step, micro_batches):
    """megatron-core's end-of-schedule capture, as graph_engine.record_capture_statistics records it."""
    outputs = schedule(forward_step, micro_batches)
    graph_engine.capture_log.append({"time": 1.234, "graph_reserved_bytes": 3 * 2**20,
                                     "graphs": 4})
    return outputs


def test_warm_up_capture_and_replay_iterations_with_their_statistics():
    runtime = GraphRuntime(LOCAL)
    it, outputs, step = run(runtime, batches(3, 5))
    assert outputs == [("output of 0", None), ("output of 1", None)]
    assert it.stats == {"docs per micro-batch": 4.0, "graph fallbacks": 0, "eager warmup": 2,
                        "cuda graphs": "warmup"}
    assert step.staged == [(0, None), (1, None)]  # eager: no padding

    step = RecordingStep()
    with runtime.iteration(batches(3, 9), step) as it:
        it.run(fake_capture)
    assert runtime.captured == {(1, 8)} and not graph_engine.capture_log  # read and emptied
    assert it.stats == {"docs per micro-batch": 6.0, "graph fallbacks": 1, "eager overflow": 1,
                        "graph capture (s)": 1.23, "graph memory (MiB)": 3.0,
                        "graphs captured": 4}
    assert step.staged == [(0, 8), (1, None)]
    plans = [plan for _, plan, _ in step.runs]  # the plan each model call ran under
    assert [p.mode for p in plans] == [Mode.CAPTURE, Mode.EAGER]
    assert plans[1].reason is Reason.OVERFLOW and active_plan() is None

    it, _, step = run(runtime, batches(8, 2))
    assert [plan.mode for _, plan, _ in step.runs] == [Mode.REPLAY, Mode.REPLAY]
    assert it.stats == {"docs per micro-batch": 5.0, "graph fallbacks": 0}
    assert runtime.iterations == 3
    assert runtime.eager_totals == {Reason.WARMUP: 2, Reason.OVERFLOW: 1}


def test_evaluation_is_eager_counted_apart_and_leaks_into_no_training_iteration():
    runtime = GraphRuntime(replace(LOCAL, warmup_iterations=2))
    first, _, _ = run(runtime, batches(2, 4))
    assert first.stats["docs per micro-batch"] == 3.0
    evaluation, _, step = run(runtime, batches(10, 10, 10), training=False)
    assert evaluation.stats == {"eager eval": 3}
    assert {plan.reason for _, plan, _ in step.runs} == {Reason.EVAL}
    second, _, _ = run(runtime, batches(1, 1))
    # Its own micro-batches only; evaluation did not count as a (warm-up) iteration either.
    assert second.stats["docs per micro-batch"] == 1.0 and second.stats["eager warmup"] == 2
    assert runtime.iterations == 2


def test_evaluation_without_graphs_logs_nothing():
    runtime = GraphRuntime(GraphRuntimeConfig())
    evaluation, _, step = run(runtime, batches(3), training=False)
    assert evaluation.stats == {} and step.runs[0][1].reason is Reason.DISABLED
    training, _, _ = run(runtime, batches(3))
    assert training.stats == {"docs per micro-batch": 3.0}
    assert runtime.eager_totals == {Reason.DISABLED: 2}
    assert "every micro-batch runs eager: disabled" in runtime.describe()


def test_planned_copies_leave_the_loader_batches_alone():
    runtime = GraphRuntime(LOCAL)
    loaded = batches(3, 4)
    with runtime.iteration(loaded, RecordingStep()) as it:
        pass
    assert all(PLAN_KEY not in batch for batch in loaded[0])
    assert [b[PLAN_KEY] for b in it.micro_batches[0]] == it.plans[0]
    assert it.micro_batches[0][1]["id"] == 1


def test_a_rerun_runs_the_iteration_again_with_some_micro_batches_eager():
    runtime = GraphRuntime(replace(LOCAL, warmup_iterations=0))
    step = RecordingStep()
    with runtime.iteration(batches(3, 4, 5), step) as it:
        it.run(fake_capture)
        outputs = it.rerun({1}, schedule)
        assert it.reruns == {Reason.MOE_OVERFLOW_RERUN: 1}
        it.rerun({1, 2}, schedule)  # a second pass: micro-batch 1 is counted once
        assert it.reruns == {Reason.MOE_OVERFLOW_RERUN: 2}
        del step.runs[6:], step.staged[6:]
    assert len(outputs) == 3
    # Second pass: the graphs captured at the end of the first replay, position 1 runs eager.
    assert [(i, p.mode.value, p.reason.value) for i, p, _ in step.runs[3:]] == [
        (0, "replay", "graphed"), (1, "eager", "moe_overflow_rerun"), (2, "replay", "graphed")]
    assert step.staged[3:] == [(0, 8), (1, None), (2, 8)]
    assert it.stats["graph fallbacks"] == 2 and it.stats["eager moe_overflow_rerun"] == 2
    assert runtime.captured == {(1, 8)} and runtime.iterations == 1


def test_a_chunk_rerun_gives_the_slots_again():
    config = replace(LOCAL, granularity=Granularity.CHUNK, warmup_iterations=0,
                     slots_per_chunk=(2,))
    runtime = GraphRuntime(config)
    runtime.captured = frozenset({(1, 8)})
    step = RecordingStep()
    with runtime.iteration(batches(3, 4, 5), step) as it:
        it.run(schedule)
        it.rerun({0}, schedule)
    slots = [p.key.slot if p.key else p.reason.value for _, p, _ in step.runs]
    assert slots == [0, 1, 0, "moe_overflow_rerun", 0, 1]


def test_chunk_granularity_gives_each_chunk_its_slots():
    config = replace(LOCAL, granularity=Granularity.CHUNK, warmup_iterations=0,
                     slots_per_chunk=(2, 1))
    runtime = GraphRuntime(config)
    two_chunks = batches(3, 4, 5) * 2
    with runtime.iteration(two_chunks, RecordingStep()) as it:
        pass
    slots = [[b[PLAN_KEY].key.slot if b[PLAN_KEY].key else b[PLAN_KEY].reason.value
              for b in chunk] for chunk in it.micro_batches]
    assert slots == [[0, 1, "slot_cap"], [0, "slot_cap", "slot_cap"]]
    # Counted once per micro-batch, with the first chunk that ran it eager.
    assert it.stats["eager slot_cap"] == 2 and it.stats["graph fallbacks"] == 2
    assert runtime.captured == {(1, 8)}
    described = runtime.describe()
    assert "chunk graphs (local)" in described and "slots per chunk 2,1" in described


class RecordingTEGraphs:
    """Stands in for TELayerGraphs (its captures need TE and a GPU)."""

    def __init__(self):
        self.captures, self.loads = [], []

    def capture(self, banks):
        self.captures.append(list(banks))
        return {"graphs captured": 2, "graph capture (s)": 0.5}

    def load(self, cp_size, params):
        self.loads.append((cp_size, params))
        return f"bank {cp_size} buffers"


def te_runtime(config):
    runtime = GraphRuntime(config, model=[torch.nn.Identity()], model_config=None)
    runtime.te_graphs = RecordingTEGraphs()
    return runtime


def test_te_graphs_capture_before_the_schedule_with_the_first_graphed_layout():
    runtime = te_runtime(replace(LOCAL, impl="transformer_engine"))
    run(runtime, batches(3, 4))  # warm-up
    assert runtime.te_graphs.captures == []
    it, _, step = run(runtime, batches(30, 3, 4))
    # Captured once, before any model call, with the first graphed micro-batch padded.
    assert runtime.te_graphs.captures == [[(1, "params of 1")]]
    assert step.staged[0] == (1, 8) and runtime.captured == {(1, 8)}
    assert runtime.te_graphs.loads == [(1, "params of 1"), (1, "params of 2")]
    assert [params for _, _, params in step.runs] == ["params of 0", "bank 1 buffers",
                                                       "bank 1 buffers"]
    assert it.stats["graphs captured"] == 2 and it.stats["eager overflow"] == 1
    run(runtime, batches(3))
    assert len(runtime.te_graphs.captures) == 1


def test_cp_banks_are_all_captured_past_the_warm_up_even_without_micro_batches():
    config = GraphRuntimeConfig(impl="transformer_engine", granularity=Granularity.CP_BANK,
                                warmup_iterations=1, bank_capacities=((1, 4), (2, 6)))
    runtime = te_runtime(config)
    turns = lambda *sizes: [CPTurn(i, size, 0) for i, size in enumerate(sizes)]
    mix = dict(cp_mix="cp1 x1, cp2 x1", cp_rounds=1, iteration_positions=96)
    first = [[dict(b, cp_turn=t) for b, t in zip(batches(3, 5, **mix)[0], turns(1, 2))]]
    it, _, _ = run(runtime, first)
    assert it.stats["eager warmup"] == 2 and it.stats["cp micro-batches"] == "cp1 x1, cp2 x1"
    assert it.stats["cp turns"] == 2 and it.stats["iteration positions"] == 96
    it, _, step = run(runtime, [[]])  # this rank has no turn in the iteration
    assert runtime.te_graphs.captures == [[(1, "layout cp1"), (2, "layout cp2")]]
    assert step.layouts == [(1, 4), (2, 6)] and runtime.captured == {(1, 4), (2, 6)}
    third = [[dict(b, cp_turn=t) for b, t in zip(batches(4, 5, 7)[0], turns(1, 2, 2))]]
    it, _, step = run(runtime, third)
    assert [(p.reason, p.key and p.key.cp_size) for _, p, _ in step.runs] == [
        (Reason.GRAPHED, 1), (Reason.GRAPHED, 2), (Reason.OVERFLOW, None)]
    assert runtime.te_graphs.loads[-2:] == [(1, "params of 0"), (2, "params of 1")]


def test_runtime_config_from_the_command_line(cpu_dist, monkeypatch):
    """Megatron-LM's launch line through arguments.parse_args reaches the runtime: the graph
    flags it keeps for the runtime (packed_graph_impl), not the ones upstream's loop sees."""
    from megatron.packed_training import extra_args
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import (
        graph_settings_from_args,
        transformer_config_from_args,
    )

    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
            "--mock-data", "--train-iters", "1", "--lr", "1e-4", "--attention-backend", "local"]
    graphs = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "8",
              "--cuda-graph-warmup-steps", "2"]
    args = parse_args(base + graphs + ["--cuda-graph-capacity-ladder", "4"])
    config = runtime_config(graph_settings_from_args(args))
    assert (config.impl, config.granularity, config.capacities, config.warmup_iterations) == (
        "local", Granularity.LAYER, (4, 8), 2)
    assert config.tokens_per_rank == 128 and not config.capture_needs_all_micro_batches
    # Graphs off: what the parser gives without --cuda-graph-impl (no capacity either).
    off = replace(graph_settings_from_args(args), impl="none", capacity=0, ladder=())
    assert not GraphRuntime.from_settings(off, [], None).config.enabled
    args = parse_args(base + graphs + ["--cuda-graph-granularity", "chunk"])
    runtime = GraphRuntime.from_settings(graph_settings_from_args(args), [torch.nn.Identity()],
                                         transformer_config_from_args(args))
    assert runtime.config.granularity is Granularity.CHUNK
    assert runtime.config.slots_per_chunk == (1,)  # one stage: one slot


def test_dynamic_cp_with_te_graphs_plans_cp_banks():
    settings = GraphSettings(
        impl="transformer_engine", capacity=8, warmup_steps=2, seq_length=128,
        cp_banks=CPBanks(sizes=(1, 2), max_packed_seqs=(4, 6), tokens_per_rank=64))
    config = runtime_config(settings)
    assert config.granularity is Granularity.CP_BANK and config.bank_capacities == ((1, 4), (2, 6))
    assert config.tokens_per_rank == 64
    with pytest.raises(ValueError, match="CUDA graph granularity is wrong: full_iteration"):
        runtime_config(replace(settings, cp_banks=None, granularity="full_iteration"))
