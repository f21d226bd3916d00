"""The graph health check (megatron/packed_graphs/health_check.py) on CPU: its flags, when the
runtime checks, and what a check finds, through megatron-core's real GPT.

On CPU no graph is captured: the model's own config has graphs off, so a micro-batch planned
"replay" runs the same eager code as the check's eager pass (eager against eager must agree,
bitwise). A forward hook that perturbs a layer's output whenever the running plan uses graphs
stands in for a corrupted graph buffer: the check must fire on it. The schedule below stands
in for megatron-core's, which allocates on the GPU. GPU tests: tests/gpu/test_graph_health_check.py.
"""

import math
from dataclasses import replace
from functools import partial

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.packed_graphs.health_check import (
    GraphHealthCheck,
    HealthCheckConfig,
    checked_micro_batch,
    relative_differences,
)
from megatron.packed_graphs.plan import (
    Granularity,
    GraphKey,
    GraphRuntimeConfig,
    Mode,
    Reason,
    StepGraphPlan,
    active_plan,
)
from megatron.packed_graphs.runtime import GraphRuntime
from megatron.packed_graphs.specs import gpt_layer_spec
from megatron.packed_training import extra_args
from megatron.packed_training.arguments import build_parser, parse_args
from megatron.packed_training.config import graph_settings_from_args, load_training_config
from megatron.packed_training.datasets.mock import MockPackedDataset
from megatron.packed_training.datasets.packing import collate_packed_rows
from megatron.packed_training.packed_step import PackedForwardStep, to_device_micro_batch
from tests.unit.conftest import TINY_LAYER, TINY_MOE

TOKENS, VOCAB, HIDDEN = 64, 128, 32
# Warm-up 1: iteration 2 is the capture iteration, later ones replay (capacity 8 fits all).
LOCAL = GraphRuntimeConfig(impl="local", capacity=8, warmup_iterations=1)

# ---------------------------------------------------------------- flags


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
        "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--attention-backend", "local"]
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "16"]


@pytest.fixture(autouse=True)
def no_optional_packages(monkeypatch):
    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_check_flags_default_off_and_reach_the_runtime():
    # The rules of the three flags: tests/unit/test_extra_args.py (check_health_check).
    defaults = build_parser().parse_args(BASE + GRAPHS)
    assert (defaults.cuda_graph_check_interval, defaults.cuda_graph_check_tolerance,
            defaults.cuda_graph_check_action) == (0, 0.01, "warn")
    args = parse_args(BASE + GRAPHS + ["--cuda-graph-check-interval", "5",
                                       "--cuda-graph-check-tolerance", "1e-3",
                                       "--cuda-graph-check-action", "disable"])
    settings = graph_settings_from_args(args)
    assert settings.health_check == HealthCheckConfig(5, 1e-3, "disable")
    runtime = GraphRuntime.from_settings(settings, [], None)
    assert runtime.health_check.config is settings.health_check
    assert runtime.describe().endswith(
        "health check every 5 iterations (tolerance 0.001, on divergence: disable)")
    # The library config takes the flags' dest names.
    api = load_training_config({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "seq_length": 256, "max_position_embeddings": 256,
                                "micro_batch_size": 1, "train_iters": 10, "lr": 1e-3,
                                "mock_data": True, "attention_backend": "local",
                                "cuda_graph_impl": "local", "cuda_graph_max_packed_seqs": 16,
                                "cuda_graph_check_interval": 10})
    assert api.cuda_graph_check_interval == 10
    assert graph_settings_from_args(api).health_check == HealthCheckConfig(10)


def test_check_action_is_one_of_two():
    with pytest.raises(SystemExit):  # argparse's choices
        build_parser().parse_args(BASE + GRAPHS + ["--cuda-graph-check-interval", "5",
                                                   "--cuda-graph-check-action", "stop"])
    with pytest.raises(ValueError, match="--cuda-graph-check-action is wrong: stop. Use warn or "
                                         "disable"):
        HealthCheckConfig(5, 0.01, "stop")


# ---------------------------------------------------------------- host decisions


def test_checks_fall_on_every_nth_iteration_past_the_warm_up():
    check = GraphHealthCheck(HealthCheckConfig(interval=5))
    assert [i for i in range(1, 21) if check.due(i, warmup_iterations=3)] == [5, 10, 15, 20]
    assert [i for i in range(1, 12) if check.due(i, warmup_iterations=5)] == [10]
    assert not any(GraphHealthCheck(HealthCheckConfig()).due(i, 0) for i in range(1, 20))
    assert GraphHealthCheck(HealthCheckConfig()).counts() == {}
    assert check.counts() == {"graph checks": 0, "graph check divergences": 0}


def test_the_first_graphed_micro_batch_is_checked():
    key = GraphKey(Granularity.LAYER, 8)
    plans = [StepGraphPlan.eager(Reason.OVERFLOW), StepGraphPlan.graphed(Mode.CAPTURE, key),
             StepGraphPlan.graphed(Mode.REPLAY, key)]
    assert checked_micro_batch(plans) == (1, key)
    assert checked_micro_batch(plans[:1]) == (0, None)
    whole = StepGraphPlan.graphed(Mode.REPLAY, GraphKey(Granularity.FULL_ITERATION, 8))
    assert checked_micro_batch([whole, whole]) == (0, None)  # no graph of its own


def test_relative_differences_flag_a_non_finite_replay_only():
    inf, nan = math.inf, math.nan
    replayed = torch.tensor([1.0, 1.01, 0.0, nan, inf, 2.0, nan])
    eager = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, nan, nan])
    got = relative_differences(replayed, eager).tolist()
    assert got[0] == 0.0 and got[1] == pytest.approx(0.01, rel=1e-4) and got[2] == 0.0
    assert got[3] == inf and got[4] == inf  # the replay broke, eager did not
    assert got[5] == 0.0 and got[6] == 0.0  # eager is not finite: nothing to compare against


# ---------------------------------------------------------------- a real GPT on CPU


class CPUForwardStep(PackedForwardStep):
    """The training forward step with the micro-batch staged on the CPU."""

    def stage(self, batch, capacity):
        return to_device_micro_batch(batch, with_seq_idx=False, static_max_seqlen=True,
                                     capacity=capacity, device=torch.device("cpu"),
                                     with_padding_mask=self.with_padding_mask)


def build_gpt(**moe):
    """A small GPT (hidden dropout on); ``moe``: MoE settings of its config."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    config = TransformerConfig(**(TINY_LAYER | dict(num_layers=2, hidden_size=HIDDEN,
                                                   hidden_dropout=0.1) | moe))
    spec = gpt_layer_spec("torch", num_experts=moe.get("num_moe_experts"))
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=TOKENS, position_embedding_type="none")


def micro_batches(iteration, count=2):
    """``count`` packed micro-batches of iteration ``iteration`` (one list per model chunk)."""
    data = MockPackedDataset(64, TOKENS, VOCAB, seed=7, doc_length_median=12)
    return [[collate_packed_rows([data[iteration * count + i]]) for i in range(count)]]


def schedule(forward_step, micro_batches, model):
    """megatron-core's schedule at PP = 1: forward, loss and backward per micro-batch."""
    data, losses = iter(micro_batches[0]), []
    for _ in micro_batches[0]:
        output, loss_func = forward_step(data, model)
        loss, num_tokens, report = loss_func(output)
        (loss / num_tokens).backward()
        losses.append(report)
    return losses


def train(model, runtime, iterations):
    """Iterations of zero grads, schedule, SGD step through ``runtime``; their stats."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forward_step = CPUForwardStep(with_seq_idx=False, static_max_seqlen=True)
    stats = []
    for iteration in range(iterations):
        with runtime.iteration(micro_batches(iteration), forward_step) as step:
            model.zero_grad(set_to_none=True)
            step.run(partial(schedule, model=model))
            optimizer.step()
        stats.append(step.stats)
    return stats


def corrupt_replays(model):
    """Zero the first layer's output whenever the running micro-batch uses graphs: a replay
    whose output buffer was overwritten, as a corrupted graph buffer would leave it."""
    def hook(module, args, output):
        plan = active_plan()
        if plan is None or not plan.uses_graphs:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = torch.zeros_like(hidden)
        return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden

    return model.decoder.layers[0].register_forward_hook(hook)


def test_check_of_a_healthy_model_agrees_and_leaves_training_unchanged(cpu_dist):
    plain = build_gpt()
    train(plain, GraphRuntime(LOCAL, [plain]), 4)

    model = build_gpt()
    runtime = GraphRuntime(LOCAL, [model], health_check=HealthCheckConfig(interval=2))
    stats = train(model, runtime, 4)
    # Iterations 2 (capture) and 4 (replay) were checked; dropout drew the same masks in
    # both passes (RNG restored), so eager against eager is bitwise equal.
    assert runtime.health_check.checks == 2 and runtime.health_check.divergences == 0
    assert [s.get("graph check rel diff") for s in stats] == [None, 0.0, None, 0.0]
    assert [s.get("eager health_check", 0) for s in stats] == [0, 1, 0, 1]
    assert stats[2]["graph checks"] == 1 and stats[3]["graph checks"] == 2
    assert stats[3]["graph check divergences"] == 0 and stats[3]["graph check (ms)"] >= 0
    assert stats[3]["graph fallbacks"] == 0  # the check's eager pass is no fallback
    assert runtime.eager_totals[Reason.HEALTH_CHECK] == 2
    assert not runtime.graphs_off
    # No trace: the same weights (RNG states, gradients and optimizer untouched), and the
    # gradients left zeroed.
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert all(p.grad is None for p in model.parameters())


def test_a_corrupted_replay_fires_and_warn_keeps_graphs(cpu_dist, capsys):
    model = build_gpt()
    runtime = GraphRuntime(LOCAL, [model], health_check=HealthCheckConfig(interval=2))
    corrupt_replays(model)
    stats = train(model, runtime, 4)
    assert runtime.health_check.divergences == 2 and stats[3]["graph check divergences"] == 2
    assert stats[3]["graph check rel diff"] > 0.01
    out = capsys.readouterr().out
    assert ("graph health check at iteration 2, rank 0: graph (layer, capacity 8, cp 1, slot 0) "
            "diverged from eager on micro-batch 0: loss replayed") in out
    assert "eager" in out and "grad norm replayed" in out and "tolerance 0.01" in out
    assert "training goes on with graphs (--cuda-graph-check-action warn)" in out
    assert not runtime.graphs_off
    assert all(plan.mode is Mode.REPLAY for plan in runtime.plan(micro_batches(9))[0])


def test_disable_turns_graphs_off_for_the_rest_of_the_run(cpu_dist, capsys):
    model = build_gpt()
    runtime = GraphRuntime(LOCAL, [model],
                           health_check=HealthCheckConfig(interval=2, action="disable"))
    corrupt_replays(model)
    stats = train(model, runtime, 6)
    assert runtime.graphs_off and runtime.health_check.checks == 1
    assert "CUDA graphs are off for the rest of the run" in capsys.readouterr().out
    # Every later micro-batch planned eager as disabled, counted; no further check.
    assert [s.get("eager disabled", 0) for s in stats] == [0, 0, 2, 2, 2, 2]
    assert [s.get("eager health_check", 0) for s in stats] == [0, 1, 0, 0, 0, 0]
    assert stats[5]["graph checks"] == 1 and stats[5]["graph check divergences"] == 1
    assert runtime.eager_totals[Reason.DISABLED] == 8
    assert {plan.reason for plan in runtime.plan(micro_batches(9))[0]} == {Reason.DISABLED}
    assert all(math.isfinite(p.abs().sum().item()) for p in model.parameters())


def test_without_a_graphed_micro_batch_nothing_is_compared(cpu_dist):
    """Every micro-batch overflows capacity 1: both passes run eager (every rank still runs
    two passes), nothing fires although replays would be corrupted."""
    model = build_gpt()
    runtime = GraphRuntime(replace(LOCAL, capacity=1, warmup_iterations=0), [model],
                           health_check=HealthCheckConfig(interval=1))
    corrupt_replays(model)
    forward_step = CPUForwardStep(with_seq_idx=False, static_max_seqlen=True)
    with runtime.iteration(micro_batches(0), forward_step) as step:
        step.run(partial(schedule, model=model))
    assert step.stats["eager overflow"] == 2 and step.stats["eager health_check"] == 1
    assert step.stats["graph check rel diff"] == 0.0
    assert runtime.health_check.divergences == 0


MOE = TINY_MOE | dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)




@pytest.mark.parametrize("guarded", [True, False])
def test_check_leaves_moe_losses_drop_counts_and_the_rerun_monitor_alone(cpu_moe, guarded):
    from megatron.packed_model.moe import packed_routers
    from megatron.packed_graphs.moe_rerun import MoEOverflowRerun

    model = build_gpt(**MOE)
    monitor = MoEOverflowRerun([model], max_micro_batches=4)
    runtime = GraphRuntime(replace(LOCAL, warmup_iterations=0), [model],
                           health_check=HealthCheckConfig(interval=1),
                           check_guards=[monitor.suspended] if guarded else [])
    forward_step = CPUForwardStep(with_seq_idx=False, static_max_seqlen=True,
                                  with_padding_mask=True)
    run = partial(schedule, model=model)
    with runtime.iteration(micro_batches(0), forward_step) as step:
        model.zero_grad(set_to_none=True)
        losses = step.run(run)
        monitor.after_forward_backward(losses, lambda eager: step.rerun(eager, run))
        tracker = {name: entry.values.clone() for name, entry in cpu_moe.metrics.items()}
        slots = [router.token_slots.clone() for router in packed_routers(model)]
    assert step.stats["eager health_check"] == 1 and runtime.health_check.checks == 1
    assert tracker and all(torch.equal(entry.values, tracker[name])
                           for name, entry in cpu_moe.metrics.items())
    assert all(torch.equal(router.token_slots, saved)
               for router, saved in zip(packed_routers(model), slots))
    # The monitor files the next iteration's micro-batches from position 0 again only if it
    # did not count the check's two passes.
    assert monitor._calls == ([0] if guarded else [2])
