"""--optimizer-cuda-graph on the CPU: the flag (its refusals: tests/unit/test_extra_args.py)
and the capturable optimizer the seam asks megatron-core for, the live schedule tensors
(learning rate filled in place by Megatron-LM's scheduler, Adam's step count, a checkpoint
loaded after capture copied into the captured tensors), eager steps counted in the runtime's
statistics. Capture and replay themselves run on the GPU (tests/gpu/test_optimizer_graph.py).
"""

import copy
import math
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from megatron.packed_graphs.optimizer_graph import (
    EAGER_KEY,
    OptimizerGraph,
    StepTensors,
    capture_iteration,
)
from megatron.packed_graphs.plan import GraphRuntimeConfig
from megatron.packed_graphs.runtime import GraphRuntime
from megatron.packed_training import extra_args
from megatron.packed_training.arguments import build_parser, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
        "--train-iters", "30", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "5",
        "--lr-decay-style", "cosine", "--global-batch-size", "2", "--mock-data",
        "--attention-backend", "local"]


def validate(*extra):
    """The validated args of BASE plus ``extra`` (TE, flash-attn and apex not importable)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(extra_args, "is_importable", lambda package: False)
        patch.delenv("WORLD_SIZE", raising=False)
        return parse_args(BASE + [str(x) for x in extra])


@pytest.fixture(scope="module")
def with_graph():
    """BASE with --optimizer-cuda-graph, parsed once (copy before changing it)."""
    return validate("--optimizer-cuda-graph")


def expected_lr(iteration: int) -> float:
    """BASE's schedule after ``iteration`` steps: linear warm-up over 5, cosine to 1e-4 at 30."""
    if iteration <= 5:
        return 1e-3 * iteration / 5
    return 1e-4 + 0.5 * (1 + math.cos(math.pi * (iteration - 5) / 25)) * 9e-4


def adam():
    """A CPU AdamW over two parameter groups, the second without weight decay (megatron-core's
    ``wd_mult``, which its scheduler multiplies in)."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))
    groups = [{"params": [weight]}, {"params": [bias], "weight_decay": 0.0, "wd_mult": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01, foreach=False)


def step(optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()


# -- the flag ----------------------------------------------------------------------------------

def test_flag_is_off_by_default_and_asks_megatron_core_for_capturable_kernels(
        with_graph, restored_training_loop):
    loop = restored_training_loop

    from megatron.packed_upstream.training_loop import route_training_loop

    assert build_parser().parse_args(BASE).optimizer_cuda_graph is False  # off by default
    args = copy.deepcopy(with_graph)
    # The runtime's flag; Megatron-LM's loop is shown none, so it wraps no optimizer graph of
    # its own and its optimizer config is not capturable.
    assert args.packed_optimizer_graph is True and args.optimizer_cuda_graph is False
    assert not loop.get_megatron_optimizer_config(args)[0].optimizer_cuda_graph
    # The seam asks megatron-core for capturable kernels (lr and step count on the device).
    route_training_loop(lambda model, optimizer, scheduler: None,
                        capturable_optimizer=args.packed_optimizer_graph)
    assert loop.get_megatron_optimizer_config(args)[0].optimizer_cuda_graph
    assert args.optimizer_cuda_graph is False  # still off for upstream's own wrapper


@pytest.mark.parametrize("extra", [
    ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "16"],
    ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "16",
     "--cuda-graph-granularity", "chunk"],
    ["--use-distributed-optimizer", "--bf16", "--cuda-graph-warmup-steps", "0"],
    [],  # model graphs off
])
def test_flag_goes_with_every_granularity(extra):
    # What the flag refuses (fp16, --log-num-zeros-in-grad, MoE without the distributed
    # optimizer): extra_args.check_optimizer_graph, tests/unit/test_extra_args.py.
    assert validate("--optimizer-cuda-graph", *extra).packed_optimizer_graph


def test_the_capture_comes_after_the_warm_up_and_never_first():
    assert capture_iteration(3) == 4
    assert capture_iteration(1) == 2
    assert capture_iteration(0) == 2  # the first step creates Adam's state
    with pytest.raises(ValueError, match="capture step is wrong: 1. Capture at step 2 or later"):
        OptimizerGraph(lambda: None, [], capture_at=1)


# -- live schedule values ----------------------------------------------------------------------

def test_the_scheduler_fills_the_bound_learning_rate_tensors_in_place(monkeypatch, with_graph):
    from megatron.training import global_vars
    from megatron.training.training import get_optimizer_param_scheduler

    optimizer = adam()
    StepTensors([optimizer]).make_live()
    rates = [group["lr"] for group in optimizer.param_groups]
    assert all(torch.is_tensor(lr) and lr.dtype == torch.float32 for lr in rates)
    # Megatron-LM's scheduler, built from the run's args as pretrain() builds it.
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", copy.deepcopy(with_graph))
    scheduler = get_optimizer_param_scheduler(optimizer)
    for iteration in range(1, 31):
        step(optimizer, iteration)
        scheduler.step(increment=2)  # the global batch size, as train_step does
        for group, lr in zip(optimizer.param_groups, rates):
            assert group["lr"] is lr  # the object a captured step reads
            assert lr.item() == pytest.approx(expected_lr(iteration), rel=1e-6, abs=1e-12)
        # A constant weight decay (--weight-decay-incr-style constant, the default).
        assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]


def test_torch_adam_counts_steps_in_a_tensor_it_updates_in_place():
    optimizer = adam()
    StepTensors([optimizer]).make_live()
    step(optimizer, 0)
    counters = [optimizer.state[p]["step"] for g in optimizer.param_groups for p in g["params"]]
    for seed in range(1, 5):
        step(optimizer, seed)
    now = [optimizer.state[p]["step"] for g in optimizer.param_groups for p in g["params"]]
    assert all(counter is tensor for counter, tensor in zip(counters, now))  # same objects
    assert [c.item() for c in counters] == [5.0, 5.0]


def test_a_group_step_count_from_a_checkpoint_becomes_the_bound_tensor():
    """FusedAdam (TE, apex) keeps one step count per group; a checkpoint gives it back as a
    number or a CPU tensor, which must land in the tensor the optimizer increments."""
    optimizer = adam()
    tensors = StepTensors([optimizer])
    optimizer.param_groups[0]["step"] = 7
    tensors.make_live()
    counter = optimizer.param_groups[0]["step"]
    assert torch.is_tensor(counter) and counter.dtype == torch.int32 and counter.tolist() == [7]
    optimizer.param_groups[0]["step"] = torch.tensor([9], dtype=torch.int32)
    tensors.make_live()
    assert optimizer.param_groups[0]["step"] is counter and counter.tolist() == [9]


def test_a_checkpoint_loaded_after_capture_is_copied_into_the_captured_tensors():
    optimizer = adam()
    tensors = StepTensors([optimizer])
    tensors.make_live()
    for seed in range(3):
        step(optimizer, seed)
    saved = copy.deepcopy(optimizer.state_dict())
    tensors.record()  # what a capture now reads by address
    weight = optimizer.param_groups[0]["params"][0]
    captured = dict(optimizer.state[weight])
    lr = optimizer.param_groups[0]["lr"]
    for seed in range(3, 6):
        step(optimizer, seed)
    lr.fill_(5e-4)
    assert tensors.restore() is False  # nothing rebound: a replay reads them as they are

    optimizer.load_state_dict(saved)  # torch binds fresh tensors
    assert optimizer.state[weight]["exp_avg"] is not captured["exp_avg"]
    assert tensors.restore() is True
    for name, tensor in captured.items():
        assert optimizer.state[weight][name] is tensor
        assert torch.equal(tensor, saved["state"][0][name])
    assert optimizer.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(1e-3)
    assert tensors.restore() is False
    step(optimizer, 6)  # the optimizer goes on in the captured tensors
    assert optimizer.state[weight]["step"] is captured["step"] and captured["step"].item() == 4


def test_a_weight_decay_changed_after_capture_is_refused():
    optimizer = adam()
    tensors = StepTensors([optimizer])
    step(optimizer, 0)
    tensors.record()
    optimizer.param_groups[1]["weight_decay"] = 0.1
    with pytest.raises(RuntimeError, match="weight decay of parameter group 1 changed after"):
        tensors.restore()


def test_a_checkpoint_holds_the_live_values_as_numbers(monkeypatch, with_graph):
    """Transformer Engine's capturable FusedAdam keeps one step-count tensor per parameter
    group. megatron-core's distributed optimizer merges the groups' counts in a set at every
    save and asserts one value, which two tensor objects never are (both hold 3 here). The
    installed graph hands the save numbers and keeps the bound tensors."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))
    inner = torch.optim.AdamW([{"params": [weight]}, {"params": [bias], "weight_decay": 0.0}],
                              lr=1e-3, weight_decay=0.01, capturable=True)
    for group in inner.param_groups:  # FusedAdam(capturable=True) after three steps
        group["step"] = torch.tensor([3], dtype=torch.int32)
    # megatron-core's DistributedOptimizer around it, with its own state_dict (building the
    # real one needs CUDA), chained as get_megatron_optimizer returns it.
    part = SimpleNamespace(optimizer=inner, grad_scaler=None)
    part.state_dict = partial(distrib_optimizer.DistributedOptimizer.state_dict, part)
    optimizer = ChainedOptimizer([part])
    optimizer.step = lambda: (True, None, 0)
    with pytest.raises(AssertionError, match="steps"):
        part.state_dict()  # upstream on its own
    from megatron.packed_training.config import graph_settings_from_args

    settings = graph_settings_from_args(with_graph)
    assert settings.optimizer_graph and OptimizerGraph.install(
        replace(settings, optimizer_graph=False), optimizer, None) is None
    OptimizerGraph.install(settings, optimizer, GraphRuntime(GraphRuntimeConfig()))
    live = [(group["lr"], group["step"]) for group in inner.param_groups]
    assert all(torch.is_tensor(lr) for lr, _ in live)
    # A save reaches the part's own state_dict (the sentinels below), and so does this.
    for state in (part.state_dict(), optimizer.state_dict()):
        groups = state["optimizer"]["param_groups"]
        assert [group["step"] for group in groups] == [3, 3]
        assert all(type(group["lr"]) is float and group["lr"] == pytest.approx(1e-3)
                   for group in groups)
    # The optimizer goes on with the tensors a captured step reads.
    assert all(group["lr"] is lr and group["step"] is step
               for group, (lr, step) in zip(inner.param_groups, live))


def test_upstream_saves_through_the_parts_own_state_dict():
    """Sentinels for the above, run on stand-ins: a chain of one hands the save to its part's
    sharded_state_dict, and the distributed optimizer's sharded_state_dict calls its own
    state_dict (whose step-count assertion the test above runs). The install wraps each part's
    state_dict, chained or not."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    def part_save(model_sharded_state_dict, is_loading, **kwargs):
        return "the part's save", model_sharded_state_dict, is_loading, kwargs

    chain = SimpleNamespace(chained_optimizers=[SimpleNamespace(sharded_state_dict=part_save)])
    assert ChainedOptimizer.sharded_state_dict(chain, {"model": 1}, False, metadata={}) == (
        "the part's save", {"model": 1}, False, {"metadata": {}})

    class Saved(Exception):
        pass

    def state_dict():
        raise Saved

    distributed = SimpleNamespace(ddp_config=SimpleNamespace(use_megatron_fsdp=False),
                                  state_dict=state_dict)
    with pytest.raises(Saved):
        DistributedOptimizer.sharded_state_dict(distributed, {}, is_loading=False)


# -- statistics --------------------------------------------------------------------------------

def test_eager_steps_are_counted_in_training_iterations_only():
    optimizer = adam()

    def megatron_step():  # megatron-core's return value: (success, grad norm, zeros)
        optimizer.step()
        return True, None, 0

    graph = OptimizerGraph(megatron_step, [optimizer], capture_at=None)
    runtime = GraphRuntime(GraphRuntimeConfig())  # model graphs off
    runtime.add_statistics(graph.statistics)
    batches = [[{"num_segments": 2, "num_documents": 2}]]
    for iteration in range(1, 4):
        with runtime.iteration(batches, forward_step=None) as it:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = torch.full_like(param, 0.1 * iteration)
            assert graph() == (True, None, 0)
        assert it.stats[EAGER_KEY] == 1 and graph.steps == iteration
    with runtime.iteration(batches, forward_step=None, training=False) as it:
        pass
    assert EAGER_KEY not in it.stats
    assert graph.graph is None and graph.statistics() == {}
