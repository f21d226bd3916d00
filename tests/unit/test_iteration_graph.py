"""Full-iteration graphs on CPU: the per-iteration plan, the static inputs, the runtime's
wiring and counters, the flags. Capture and replay themselves run on the GPU
(tests/gpu/test_full_iteration.py)."""

import multiprocessing
from dataclasses import replace

import pytest
import torch

from megatron.core.distributed import param_and_grad_buffer
from megatron.core.transformer import cuda_graphs

from megatron.packed_upstream import graph_engine
from megatron.packed_graphs.full_iteration import (
    IterationGraph,
    StaticMicroBatches,
    all_ranks_fit,
    plan_full_iteration,
)
from megatron.packed_graphs.plan import (
    Granularity,
    GraphRuntimeConfig,
    Mode,
    Reason,
    active_plan,
    graphs_bypassed,
    in_iteration_graph,
)
from megatron.packed_graphs.runtime import GraphRuntime, runtime_config
from megatron.packed_training import extra_args
from megatron.packed_training.arguments import parse_args
from megatron.packed_training.packed_step import to_device_micro_batch

# Capacity 8, one warm-up iteration, graphs of 2 micro-batches; misses run layer graphs.
FULL = GraphRuntimeConfig(impl="local", capacity=8, warmup_iterations=1, full_iteration=True,
                          iteration_micro_batches=2)


def plan(iteration, counts, *, captured=(), graph=False, **kw):
    return plan_full_iteration(FULL, iteration, captured, graph, counts, **kw)


def shown(plans):
    return [(p.mode.value, p.key.granularity.value if p.key else p.reason.value)
            for p in plans]


# -- the plan -------------------------------------------------------------------------------

def test_warm_up_then_capture_then_replay_of_the_whole_iteration():
    whole, plans = plan(0, [3, 4])
    assert (whole.mode, whole.miss) == (Mode.EAGER, None)  # warm-up is no miss
    assert shown(plans) == [("eager", "warmup")] * 2
    whole, plans = plan(1, [3, 8])
    assert whole.mode is Mode.CAPTURE and whole.uses_graph and whole.miss is None
    assert shown(plans) == [("capture", "full_iteration")] * 2
    assert {p.key.capacity for p in plans} == {8}  # every micro-batch at the top capacity
    whole, plans = plan(5, [1, 2], graph=True)
    assert whole.mode is Mode.REPLAY and shown(plans) == [("replay", "full_iteration")] * 2


def test_an_overflow_misses_and_runs_layer_graphs_for_what_fits():
    # The first miss records layer graphs for the micro-batch that fits.
    whole, plans = plan(3, [5, 9], graph=True)
    assert (whole.mode, whole.miss) == (Mode.EAGER, Reason.OVERFLOW)
    assert shown(plans) == [("capture", "layer"), ("eager", "overflow")]
    # Once they exist they replay; nothing falls back wholesale.
    whole, plans = plan(4, [9, 2], captured={(1, 8)}, graph=True)
    assert whole.miss is Reason.OVERFLOW
    assert shown(plans) == [("eager", "overflow"), ("replay", "layer")]
    assert [p.is_fallback for p in plans] == [True, False]


def test_an_overflow_in_the_would_be_capture_iteration_postpones_the_iteration_graph():
    whole, plans = plan(1, [9, 2])
    assert whole.miss is Reason.OVERFLOW and shown(plans) == [("eager", "overflow"),
                                                              ("capture", "layer")]
    whole, _ = plan(2, [2, 2], captured={(1, 8)})  # the next fitting iteration captures it
    assert whole.mode is Mode.CAPTURE


def test_another_rank_overflowing_sends_every_rank_per_micro_batch():
    whole, plans = plan(3, [2, 2], captured={(1, 8)}, graph=True, fit_everywhere=False)
    assert whole.miss is Reason.OVERFLOW and shown(plans) == [("replay", "layer")] * 2


def test_another_micro_batch_count_misses_with_its_reason():
    whole, plans = plan(3, [2, 2, 2], captured={(1, 8)}, graph=True)
    assert whole.miss is Reason.MICRO_BATCH_COUNT and shown(plans) == [("replay", "layer")] * 3
    # Count first: an iteration of another count that also overflows misses for its count.
    assert plan(3, [9], graph=True)[0].miss is Reason.MICRO_BATCH_COUNT


def test_evaluation_and_graphs_off_are_no_misses():
    whole, plans = plan(5, [9, 2], graph=True, training=False)
    assert whole.miss is None and shown(plans) == [("eager", "eval")] * 2
    whole, plans = plan(5, [2, 2], graph=True, graphs_off=True)
    assert whole.miss is None and shown(plans) == [("eager", "disabled")] * 2


def test_chunk_granularity_serves_the_misses():
    config = replace(FULL, granularity=Granularity.CHUNK)
    whole, plans = plan_full_iteration(config, 3, (), False, [2, 30])
    assert whole.miss is Reason.OVERFLOW and shown(plans) == [("capture", "chunk"),
                                                              ("eager", "overflow")]


@pytest.mark.parametrize("changes, match", [
    (dict(impl="transformer_engine"), "impl transformer_engine"),
    (dict(ladder=(4,)), r"ladder \(4,\)"),
    (dict(iteration_micro_batches=0), "0 micro-batches"),
    (dict(granularity=Granularity.CP_BANK, bank_capacities=((1, 8),)), "granularity cp_bank"),
])
def test_config_refusals(changes, match):
    with pytest.raises(ValueError, match=f"full-iteration graph settings are wrong: .*{match}"):
        replace(FULL, **changes)


def test_only_a_whole_iteration_key_marks_the_layers_inside_the_graph():
    _, graphed = plan(1, [3, 4])
    _, per_micro_batch = plan(3, [5, 9], graph=True)
    from megatron.packed_graphs.plan import running

    with running(graphed[0]):
        assert in_iteration_graph() and not graphs_bypassed()
    for p in per_micro_batch:
        with running(p):
            assert not in_iteration_graph()
    assert not in_iteration_graph()  # no plan


# -- static inputs --------------------------------------------------------------------------

def collated(cu_seqlens, length=16):
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    return {"tokens": torch.arange(length).unsqueeze(0), "labels": torch.arange(length)[None] + 1,
            "loss_mask": torch.ones(1, length), "position_ids": torch.arange(length)[None],
            "cu_seqlens": cu, "num_segments": len(cu_seqlens) - 1,
            "num_documents": len(cu_seqlens) - 1, "max_seqlen": length}


def staged(cu_seqlens, capacity=8, **kw):
    return to_device_micro_batch(collated(cu_seqlens), with_seq_idx=True, static_max_seqlen=True,
                                 capacity=capacity, device="cpu", **kw)


def test_static_inputs_keep_their_addresses_and_take_each_fill():
    static = StaticMicroBatches()
    first = static.fill([staged([0, 4, 16]), staged([0, 16])])
    addresses = [mb.tokens.data_ptr() for mb in first] + [first[0].params.cu_seqlens_q.data_ptr()]
    # cu_seqlens_q and _kv are one tensor upstream; their static twin is one tensor too.
    assert first[0].params.cu_seqlens_q is first[0].params.cu_seqlens_kv
    nxt = [staged([0, 2, 5, 9, 16]), staged([0, 8, 16])]
    nxt[0].tokens += 100
    again = static.fill(nxt)
    assert again is static.slots and [mb.tokens.data_ptr() for mb in again] + [
        again[0].params.cu_seqlens_q.data_ptr()] == addresses
    assert torch.equal(again[0].tokens, nxt[0].tokens)
    assert again[0].params.cu_seqlens_q.tolist() == [0, 2, 5, 9] + [16] * 5  # capacity 8 + 1
    assert torch.equal(again[0].params.seq_idx, nxt[0].params.seq_idx)
    assert again[0].num_segments == 2  # a host counter the model never reads: not refilled
    assert nxt[0].params.cu_seqlens_q.data_ptr() != addresses[-1]  # fills copy, never alias


def test_static_inputs_refuse_another_layout():
    static = StaticMicroBatches()
    static.fill([staged([0, 16])])
    with pytest.raises(ValueError, match=r"input micro-batch.params.cu_seqlens_q is wrong: "
                                         r"\(5,\) torch.int32, captured as \(9,\) torch.int32"):
        static.fill([staged([0, 16], capacity=4)])
    other = staged([0, 16])
    other.params.max_seqlen_q = 8
    with pytest.raises(ValueError, match="input micro-batch.params.max_seqlen_q is wrong: 8, "
                                         "captured as 16. Host values are fixed at capture"):
        static.fill([other])
    with pytest.raises(ValueError, match="inputs are wrong: 2 micro-batches for a graph of 1"):
        static.fill([staged([0, 16])] * 2)


# -- the runtime ----------------------------------------------------------------------------

class CPUStep:
    """The real staging (packed_step.to_device_micro_batch) on CPU tensors; `run` records."""

    def __init__(self):
        self.staged, self.runs = [], []

    def stage(self, batch, capacity):
        self.staged.append(capacity)
        return to_device_micro_batch(batch, with_seq_idx=False, static_max_seqlen=True,
                                     capacity=capacity, device="cpu")

    def run(self, model, mb):
        self.runs.append((active_plan(), mb))
        return mb.tokens.float().sum(), None


def schedule(forward_step, micro_batches):
    data = iter(micro_batches[0])
    return [forward_step(data, "model") for _ in micro_batches[0]]


class ScheduleRecordingGraph(IterationGraph):
    """The iteration graph with its CUDA capture replaced by one call of the body: CPU tests
    of the runtime around it. Replay returns the captured result, as a graph would."""

    def _capture(self, body):
        self.result = body()
        self.graph = self  # replay() below
        return {"iteration graph capture (s)": 0.0}

    def replay(self):
        self.replays = getattr(self, "replays", 0) + 1


def iteration(runtime, *cu_seqlens, step=None):
    step = step or CPUStep()
    with runtime.iteration([[collated(c) for c in cu_seqlens]], step) as it:
        out = it.run(schedule)
    return it, out, step


def test_the_runtime_runs_one_graph_per_fitting_iteration_and_counts_misses():
    runtime = GraphRuntime(FULL)
    runtime.iteration_graph = ScheduleRecordingGraph()
    it, _, step = iteration(runtime, [0, 16], [0, *range(1, 9), 16])
    assert it.stats["eager warmup"] == 2 and "iteration graph misses" not in it.stats
    # The warm-up runs eager on the capture's layout where it fits (9 segments do not).
    assert step.staged == [8, None]

    it, out, step = iteration(runtime, [0, 4, 16], [0, 2, 16])  # capture iteration
    assert it.stats["iteration graphs"] == 1 and "iteration graph capture (s)" in it.stats
    assert step.staged == [8, 8]  # staged at the top capacity, then copied in
    static = runtime.iteration_graph.inputs.slots
    assert [mb for _, mb in step.runs] == static  # the schedule read the static inputs
    assert all(p.key.granularity is Granularity.FULL_ITERATION and p.mode is Mode.CAPTURE
               for p, _ in step.runs)
    assert it.stats.get("graph fallbacks") == 0 and runtime.captured == frozenset()

    it, replayed, step = iteration(runtime, [0, 1, 2, 16], [0, 16])  # replay: no schedule
    assert step.runs == [] and replayed is out and runtime.iteration_graph.replays == 2
    assert static[0].params.cu_seqlens_q.tolist()[:4] == [0, 1, 2, 16]

    it, _, step = iteration(runtime, [0, *range(1, 10), 16], [0, 16])  # 10 segments > 8
    assert it.stats["iteration graph misses"] == 1
    assert it.stats["iteration graph miss overflow"] == 1 and it.stats["eager overflow"] == 1
    assert [(p.mode, p.reason) for p, _ in step.runs] == [
        (Mode.EAGER, Reason.OVERFLOW), (Mode.CAPTURE, Reason.GRAPHED)]  # layer graphs
    assert step.runs[1][0].key.granularity is Granularity.LAYER
    assert step.runs[1][1] is not static[1]  # staged anew, not the graph's inputs
    assert runtime.iteration_misses == {Reason.OVERFLOW: 1}
    assert "full-iteration graphs of 2 micro-batches at capacity 8" in runtime.describe()


def test_misses_are_summed_over_the_log_interval():
    from megatron.packed_training.metrics import IntervalTimer

    interval = IntervalTimer()
    for stats in ({"iteration graphs": 1}, {"iteration graph misses": 1,
                                            "iteration graph miss overflow": 1}, {
                      "iteration graph misses": 1, "iteration graph miss overflow": 1}):
        interval.add(1, 1, stats)
    assert interval.stats == {"iteration graphs": 1, "iteration graph misses": 2,
                              "iteration graph miss overflow": 2}


def _agree(rank, store, results):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                         world_size=2)
    group = torch.distributed.group.WORLD
    results[rank] = (all_ranks_fit(True, group), all_ranks_fit(rank == 0, group))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_on_the_path_through_a_host_all_reduce(tmp_path):
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        workers = [context.Process(target=_agree, args=(rank, tmp_path / "store", results))
                   for rank in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
        # Both fit: both replay; rank 1 overflows: rank 0 misses too.
        assert dict(results) == {0: (True, False), 1: (True, False)}
    assert all_ranks_fit(False) is False and all_ranks_fit(True, group=None) is True


# -- core patch: layer-graph gradient events ------------------------------------------------

def test_layer_graph_grad_events_are_dropped_before_a_whole_iteration_capture():
    model = torch.nn.Linear(2, 2)
    model.weight._cudagraph_wgrad_ready_event = "event"
    assert graph_engine.forget_layer_graph_grad_events([model]) == 1
    assert not hasattr(model.weight, "_cudagraph_wgrad_ready_event")
    assert graph_engine.forget_layer_graph_grad_events([model]) == 0


def test_upstream_tags_parameters_with_replay_events_and_ddp_waits_on_them(monkeypatch):
    """Sentinel: upstream's replayed backward tags each parameter with the replay's event and
    DDP's grad sync waits on it; when upstream stops tagging (or waiting), the drop is no
    longer needed. Both run here on stand-ins for the graph, the stream and the event."""
    from types import SimpleNamespace

    class Waited(Exception):
        """What follows the wait is DDP's collective: not run here."""

    waited = []

    class Stream:
        def wait_event(self, event):
            waited.append(event)
            raise Waited

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: Stream())
    event = SimpleNamespace(record=lambda stream: None)
    weight = torch.nn.Parameter(torch.zeros(2))
    runner = SimpleNamespace(
        bwd_graph=SimpleNamespace(replay=lambda: None), status=cuda_graphs._GraphStatus.BWD_READY,
        static_grad_outputs=[], use_stream=False, bwd_graph_replay_complete_event=event,
        params_to_backprop=[weight], fp8_enabled=False, gtp_remat=False, static_grad_inputs=())
    cuda_graphs._CudagraphReplayNode.backward(SimpleNamespace(runner=runner))
    assert weight._cudagraph_wgrad_ready_event is event

    bucket = SimpleNamespace(params_list=[weight], params_with_extra_main_grads=[])
    group = SimpleNamespace(is_first_batch=False, grad_reduce_handle=None,
                            previous_grad_reduce_bucket_group=None, buckets=[bucket])
    with pytest.raises(Waited):
        param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync(group)
    assert waited == [event]


def test_upstream_batched_p2p_still_syncs_the_device(monkeypatch):
    """Why PP > 1 is refused: upstream's batched p2p (its default) synchronizes the device
    after every exchange. When this fails, full-iteration graphs may allow pipelining."""
    from types import SimpleNamespace

    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import p2p_communication

    calls = []
    monkeypatch.setattr(p2p_communication, "_batched_p2p_ops",
                        lambda **tensors: calls.append("batched p2p") or [])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: calls.append("synchronize"))
    communicator = SimpleNamespace(config=ModelParallelConfig(), pp_group=None, next_rank=1,
                                   prev_rank=1)
    p2p_communication.P2PCommunicator._communicate(
        communicator, tensor_send_next=torch.zeros(2), tensor_send_prev=None, recv_prev=False,
        recv_next=False, tensor_shape=None)
    assert calls == ["batched p2p", "synchronize"]


# -- flags ----------------------------------------------------------------------------------

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
        "--mock-data", "--train-iters", "4", "--lr", "1e-4", "--global-batch-size", "4",
        "--attention-backend", "local"]
FULL_FLAGS = ["--cuda-graph-impl", "full_iteration", "--cuda-graph-max-packed-seqs", "8",
              "--no-check-for-nan-in-loss-and-grad"]


@pytest.fixture(autouse=True)
def no_optional_packages(monkeypatch):
    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_the_flag_is_accepted_and_builds_local_layer_graphs_for_misses(monkeypatch, cpu_dist):
    """The launch line's graph flags reach the runtime; the refusals of full-iteration graphs
    (PP, CP, MoE, modules, ladder, NaN check, ...) are extra_args' rules, tested in
    tests/unit/test_extra_args.py."""
    from megatron.core import parallel_state
    from megatron.packed_training.config import (
        graph_settings_from_args,
        transformer_config_from_args,
    )

    args = parse_args(BASE + FULL_FLAGS)
    # The runtime's; Megatron-LM's loop sees local graphs and builds no graph of its own.
    assert (args.packed_graph_impl, args.cuda_graph_impl) == ("full_iteration", "local")
    settings = graph_settings_from_args(args)
    assert settings.impl == "full_iteration"
    config = runtime_config(settings)
    assert (config.impl, config.granularity, config.full_iteration,
            config.iteration_micro_batches) == ("local", Granularity.LAYER, True, 4)
    model_config = transformer_config_from_args(args)
    assert model_config.cuda_graph_impl == "local"
    runtime = GraphRuntime.from_settings(settings, [torch.nn.Identity()], model_config)
    assert runtime.iteration_graph is not None and not runtime.iteration_graph.captured
    assert runtime.agreement_group is parallel_state.get_data_parallel_group_gloo(
        with_context_parallel=True)
    chunk = runtime_config(replace(settings, granularity="chunk"))
    assert chunk.granularity is Granularity.CHUNK and chunk.full_iteration
    monkeypatch.setenv("WORLD_SIZE", "2")
    data_parallel = parse_args(BASE + FULL_FLAGS + ["--calculate-per-token-loss"])
    assert (data_parallel.data_parallel_size, data_parallel.num_microbatches) == (2, 2)
    monkeypatch.delenv("WORLD_SIZE")
    assert BASE[:2] == ["--num-layers", "2"]  # upstream counts a hybrid's layers itself
    hybrid = parse_args(BASE[2:] + FULL_FLAGS + ["--hybrid-layer-pattern", "M*",
                                                 "--mamba-head-dim", "16"], model="hybrid")
    assert (hybrid.num_layers, hybrid.packed_graph_impl) == (2, "full_iteration")
