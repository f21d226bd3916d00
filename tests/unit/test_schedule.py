"""The seam into Megatron-LM's loop (packed_graphs/schedule.py) on CPU, with a real GraphRuntime.

The schedule under the seam stands in for megatron-core's (which allocates on CUDA): it calls
the forward step once per micro-batch in order and returns the loss reports, as
``forward_backward_no_pipelining`` does. The forward step records what the runtime asks of it.
"""

from types import SimpleNamespace

import pytest

from megatron.packed_graphs import core_patches
from megatron.packed_graphs.plan import GraphRuntimeConfig, Reason, active_plan
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
        self.calls = []

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, **kwargs):
        self.calls.append(kwargs)
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
    monkeypatch.setattr(core_patches, "guard_local_capture", lambda guard: guard())


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
