"""The seam into Megatron-LM's loop (packed_graphs/schedule.py) on CPU, with a real GraphRuntime.

The schedule under the seam stands in for megatron-core's (which allocates on CUDA): it calls
the forward step once per micro-batch in order and returns the loss reports, as
``forward_backward_no_pipelining`` does. The forward step records what the runtime asks of it.
"""

from types import SimpleNamespace

import pytest
import torch


from megatron.packed_upstream import graph_engine
from megatron.packed_graphs.plan import Granularity, GraphRuntimeConfig, Reason, active_plan
from megatron.packed_graphs.runtime import GraphRuntime
from megatron.packed_graphs.schedule import GraphRuntimeSchedule

LOCAL = GraphRuntimeConfig(impl="local", capacity=8, warmup_iterations=1)


class RecordingStep:
    def __init__(self):
        self.staged, self.plans = [], []

    def stage(self, batch, capacity):
        self.staged.append((batch["id"], capacity))
        return SimpleNamespace(params=None, batch=batch)

    def run(self, model, staged):
        self.plans.append((staged.batch["id"], active_plan()))
        return staged.batch["id"], lambda output: {"lm loss": output}


class Schedule:
    """Records each call's keywords; runs the forward step per micro-batch."""

    def __init__(self):
        self.calls, self.counts = [], []

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, **kwargs):
        self.calls.append(kwargs)
        self.counts.append(num_microbatches)
        if isinstance(data_iterator, list):  # virtual pipeline: chunk 0's iterator will do here
            data_iterator, model = data_iterator[0], model[0]
        outputs = [forward_step_func(data_iterator, model) for _ in range(num_microbatches)]
        return [loss_func(output) for output, loss_func in outputs]


class Chunk:
    def __init__(self):
        self.zeroed = 0

    def zero_grad_buffer(self):
        self.zeroed += 1


def micro_batches(*segments):
    return iter([{"id": i, "num_segments": s, "num_documents": s} for i, s in enumerate(segments)])


def seam_for(config=LOCAL, **kwargs):
    schedule = Schedule()
    seam = GraphRuntimeSchedule(GraphRuntime(config), schedule, stream_length=4096, **kwargs)
    events = []
    seam.before_iteration.append(lambda: events.append(("begin",)))
    seam.listeners.append(lambda split, stats, losses: events.append((split, stats, losses)))
    return seam, schedule, events


@pytest.fixture(autouse=True)
def no_local_capture(monkeypatch):
    # No layer here records a graph; the capture guard only wraps megatron-core's capture.
    monkeypatch.setattr(graph_engine, "guard_local_capture", lambda guard: guard())


def test_schedule_sees_one_thd_stream_per_micro_batch_whatever_upstream_passes():
    seam, schedule, _ = seam_for()
    step, model = RecordingStep(), [Chunk()]
    seam(forward_step_func=step, data_iterator=micro_batches(3, 5), model=model,
         num_microbatches=2, seq_length=2048, micro_batch_size=2, decoder_seq_length=None,
         forward_only=False, pg_collection="pgc")
    assert schedule.calls == [{"forward_only": False, "seq_length": 4096,
                               "micro_batch_size": 1, "decoder_seq_length": None,
                               "pg_collection": "pgc"}]


def test_an_iteration_stays_open_until_its_optimizer_step():
    seam, _, events = seam_for()
    optimizer_step = seam.wrap_optimizer_step(lambda: events.append(("step",)) or "result")
    step, model = RecordingStep(), [Chunk()]
    losses = seam(forward_step_func=step, data_iterator=micro_batches(3, 5), model=model,
                  num_microbatches=2)
    assert losses == [{"lm loss": 0}, {"lm loss": 1}]
    assert events == [("begin",)]  # not closed before the step
    assert seam.runtime.iterations == 0
    assert optimizer_step() == "result"
    assert [e[0] for e in events] == ["begin", "step", "train"]
    split, stats, reported = events[-1]
    assert reported == losses and stats["eager warmup"] == 2
    assert seam.runtime.iterations == 1


def test_every_micro_batch_is_planned_before_the_schedule_and_replays_at_its_capacity():
    seam, _, events = seam_for()
    optimizer_step = seam.wrap_optimizer_step(lambda: None)
    model = [Chunk()]
    for segments in ((3, 5), (2, 9), (4, 1)):  # warm-up, capture, replay; 9 overflows 8
        step = RecordingStep()
        seam(forward_step_func=step, data_iterator=micro_batches(*segments), model=model,
             num_microbatches=2)
        optimizer_step()
    assert step.staged == [(0, 8), (1, 8)]  # the replay iteration: padded to the capacity
    counts = [event[1] for event in events if event[0] == "train"]
    assert counts[0]["eager warmup"] == 2
    assert counts[1]["eager overflow"] == 1 and counts[1]["graph fallbacks"] == 1
    assert "eager overflow" not in counts[2]


def test_a_skipped_optimizer_step_still_closes_the_iteration_at_the_next_one():
    seam, _, events = seam_for()
    model = [Chunk()]
    for _ in range(2):  # upstream's rerun machine may skip the step: no wrap called
        seam(forward_step_func=RecordingStep(), data_iterator=micro_batches(1), model=model,
             num_microbatches=1)
    assert [e[0] for e in events] == ["begin", "train", "begin"]
    assert seam.runtime.iterations == 1


def test_evaluation_runs_eager_and_reports_at_once_without_touching_the_open_iteration():
    seam, _, events = seam_for()
    model = [Chunk()]
    seam(forward_step_func=RecordingStep(), data_iterator=micro_batches(1), model=model,
         num_microbatches=1)
    step = RecordingStep()
    seam(forward_step_func=step, data_iterator=micro_batches(2, 2), model=model,
         num_microbatches=2, forward_only=True)
    assert [e[0] for e in events] == ["begin", "valid"]
    assert events[-1][1]["eager eval"] == 2
    assert [plan.reason for _, plan in step.plans] == [Reason.EVAL, Reason.EVAL]
    assert seam.runtime.iterations == 0  # the training iteration is still open


def test_virtual_pipeline_chunks_each_read_their_own_iterator():
    seam, schedule, _ = seam_for(GraphRuntimeConfig(impl="none"))
    step, model = RecordingStep(), [Chunk(), Chunk()]
    seam(forward_step_func=step, data_iterator=[micro_batches(3), micro_batches(3)],
         model=model, num_microbatches=1)
    with pytest.raises(ValueError, match="one iterator for 2 model chunks"):
        seam(forward_step_func=step, data_iterator=micro_batches(3), model=model,
             num_microbatches=1)


def test_a_moe_rerun_zeroes_the_gradients_and_reruns_the_overflowed_micro_batches_eager():
    class Rerun:  # the MoE overflow monitor's contract: rerun(eager positions) -> result
        def after_forward_backward(self, losses, rerun):
            return rerun(frozenset({1})), {}

    class Optimizer:
        zeroed = 0

        def zero_grad(self):
            Optimizer.zeroed += 1

    seam, schedule, _ = seam_for(GraphRuntimeConfig(impl="none"), moe_rerun=Rerun(),
                                 optimizer=Optimizer())
    step, model = RecordingStep(), [Chunk()]
    losses = seam(forward_step_func=step, data_iterator=micro_batches(2, 2), model=model,
                  num_microbatches=2)
    assert len(schedule.calls) == 2 and model[0].zeroed == 1 and Optimizer.zeroed == 1
    assert losses == [{"lm loss": 0}, {"lm loss": 1}]
    rerun_plans = [plan.reason for _, plan in step.plans[2:]]
    assert rerun_plans[1] is Reason.MOE_OVERFLOW_RERUN


# -- dynamic CP: each rank runs its own turns --------------------------------------------------

def test_dynamic_cp_runs_this_ranks_turns_whatever_upstream_counts():
    seam, schedule, events = seam_for(GraphRuntimeConfig(impl="none"), rank_iterations=True)
    optimizer_step = seam.wrap_optimizer_step(lambda: None)
    step, model = RecordingStep(), [Chunk()]
    turns = [{"id": i, "num_segments": 1, "num_documents": 1} for i in range(4)]
    data = iter([turns[:3], turns[3:]])
    for _ in range(2):  # upstream passes every rank its global batch / DP share: 2
        seam(forward_step_func=step, data_iterator=data, model=model, num_microbatches=2)
        optimizer_step()
    assert schedule.counts == [3, 1] and [i for i, _ in step.staged] == [0, 1, 2, 3]
    assert [e[0] for e in events] == ["begin", "train", "begin", "train"]
    seam(forward_step_func=step, data_iterator=iter([turns[:2]]), model=model,
         num_microbatches=5, forward_only=True)  # evaluation: one item too
    assert schedule.counts[-1] == 2


@pytest.mark.parametrize("item, shown", [([], "an empty list"), ({"id": 0}, "a dict")])
def test_dynamic_cp_refuses_an_item_that_is_not_a_ranks_iteration(item, shown):
    seam, schedule, _ = seam_for(GraphRuntimeConfig(impl="none"), rank_iterations=True)
    with pytest.raises(ValueError, match=f"data iterator item is wrong: {shown}. With "
                                         "rank_iterations each item is the non-empty list"):
        seam(forward_step_func=RecordingStep(), data_iterator=iter([item]), model=[Chunk()],
             num_microbatches=1)
    assert schedule.calls == []


class TurnStep:
    """A forward step recording each staged turn (micro-batch index, CP size) and its plan."""

    def __init__(self):
        self.runs, self.layouts = [], []

    def stage(self, batch, capacity):
        return SimpleNamespace(params=None, batch=batch)

    def run(self, model, staged):
        turn = staged.batch["cp_turn"]
        self.runs.append((turn.micro_batch, turn.cp_size, active_plan()))
        return None, lambda output: {"lm loss": torch.ones(2)}

    def bank_layout(self, cp_size, capacity):
        self.layouts.append((cp_size, capacity))


class BankRecorder:
    """Stands in for TELayerGraphs (its captures need TE and a GPU)."""

    def __init__(self):
        self.captures = []

    def capture(self, banks):
        self.captures.append([size for size, _ in banks])
        return {}

    def load(self, cp_size, params):
        return params


def test_dynamic_cp_ranks_plan_and_run_their_own_turns_of_one_global_batch():
    """Two data-parallel ranks read the same global batches of mixed CP sizes through the data
    path and the seam: one schedule call per rank and iteration (one gradient reduction, one
    loss all-reduce) over that rank's turns, however many; both ranks run the CP-2
    micro-batches (their shared group) in the same order and plan each alike; past the
    warm-up every micro-batch replays its own size's bank, or runs eager for a reason."""
    from megatron.packed_training.datasets.builder import build_rank_iterators
    from megatron.packed_training.datasets.dynamic_cp import pack_rows_for_dynamic_cp
    from megatron.packed_training.datasets.mock import mock_documents
    from megatron.packed_training.datasets.packed_row_dataset import PackedRowDataset

    rows = pack_rows_for_dynamic_cp(mock_documents(4000, 128, 97, 3, 48, 1.3), (1, 2), 64)
    dataset = PackedRowDataset(rows, 16, seed=0)
    args = SimpleNamespace(dynamic_cp_sizes=[1, 2], global_batch_size=4,
                           consumed_train_samples=0)
    config = GraphRuntimeConfig(impl="transformer_engine", granularity=Granularity.CP_BANK,
                                warmup_iterations=1, bank_capacities=((1, 2), (2, 2)),
                                tokens_per_rank=64)
    ranks = []
    for rank in range(2):
        train, valid = build_rank_iterators(dataset, None, args, rank, 2)
        runtime = GraphRuntime(config, model=[torch.nn.Identity()], model_config=None)
        runtime.te_graphs = BankRecorder()
        seam = GraphRuntimeSchedule(runtime, Schedule(), stream_length=128, rank_iterations=True)
        ranks.append(SimpleNamespace(train=train, seam=seam, step=TurnStep(), runtime=runtime))
        assert valid is None
    for _ in range(4):
        for r in ranks:
            r.seam(forward_step_func=r.step, data_iterator=r.train, model=[Chunk()],
                   num_microbatches=2)
            r.seam.close_iteration()
    counts = [r.seam.schedule.counts for r in ranks]
    assert [len(c) for c in counts] == [4, 4] and counts[0] != counts[1]  # upstream: 2 each
    assert [r.runtime.te_graphs.captures for r in ranks] == [[[1, 2]], [[1, 2]]]
    runs = [r.step.runs for r in ranks]
    shared = [[(mb, plan.mode, plan.key) for mb, size, plan in rank_runs if size == 2]
              for rank_runs in runs]
    assert shared[0] == shared[1] and shared[0]
    past_warm_up = [run for rank_runs in runs for run in rank_runs[3:]]  # 3 warm-up turns each
    assert {plan.reason for _, _, plan in past_warm_up} == {Reason.GRAPHED, Reason.OVERFLOW}
    for _, size, plan in past_warm_up:
        assert plan.reason is Reason.OVERFLOW or (plan.uses_graphs and plan.key.cp_size == size)
