"""--optimizer-cuda-graph on one GPU (skipped without CUDA, tests/gpu/conftest.py).

* 30 steps of a warm-up + cosine schedule, in one process: the graphed optimizer step
  (captured at step 3) equals the same capturable optimizer stepped eager, bitwise: weights,
  gradient norm (clipping active on every other step), the loss of a fixed micro-batch; the
  learning rate and Adam's step count are the same tensors at every step and follow the
  schedule. Transformer Engine's FusedAdam and torch's AdamW, with and without the
  distributed optimizer. A replayed step makes no host sync.
* An optimizer state loaded after the capture lands in the captured tensors: the graphed
  step then repeats the steps after that state bitwise, as the eager one does.
* Training with the real script, eager optimizer against --optimizer-cuda-graph, model graphs
  off, local layer graphs and TE layer graphs: same loss and gradient norm (the capturable
  Adam kernels round like the default ones up to the noise of the attention backward), the
  logged learning rate is the schedule's at every step, the capture is logged once. A run
  saved (after the capture) and resumed continues the uninterrupted graphed curve, with and
  without the distributed optimizer.
"""

import copy
import math

import pytest
import torch

import pretrain_gpt
from megatron.core import optimizer as megatron_optimizer
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from megatron.packed_upstream.patches import apply_core_patches
from megatron.packed_graphs.optimizer_graph import EAGER_KEY, OptimizerGraph, inner_optimizers
from megatron.packed_training.arguments import parse_args
from megatron.packed_training.config import transformer_config_from_args
from megatron.packed_training.datasets.mock import MockPackedDataset
from megatron.packed_training.datasets.packing import collate_packed_rows
from megatron.packed_training.extra_args import is_importable
from megatron.packed_training.packed_step import masked_lm_loss, to_device_micro_batch
from megatron.training import global_vars
from megatron.training.training import (
    get_megatron_ddp_config,
    get_megatron_optimizer_config,
    get_optimizer_param_scheduler,
)
from tests.gpu.launch import TINY_GPT, TRAIN, losses, run_training, train_then_resume

STEPS = 30
SCHEDULE = ["--train-iters", str(STEPS), "--lr-warmup-iters", "5", "--lr-decay-style", "cosine"]
CAPTURE = ["--optimizer-cuda-graph", "--cuda-graph-warmup-steps", "2"]  # captured at step 3
HAS_TE = is_importable("transformer_engine")
ADAMS = [pytest.param("te", marks=pytest.mark.skipif(not HAS_TE, reason="needs Transformer "
                                                     "Engine (FusedAdam)")), "torch"]


def expected_lr(iteration: int) -> float:
    """SCHEDULE after ``iteration`` steps: --lr 1e-3 reached linearly over 5, cosine to
    --min-lr 1e-4 at 30 (tests/gpu/launch.TRAIN)."""
    if iteration <= 5:
        return 1e-3 * iteration / 5
    return 1e-4 + 0.5 * (1 + math.cos(math.pi * (iteration - 5) / (STEPS - 5))) * 9e-4


def use_adam(monkeypatch, adam: str) -> None:
    """megatron-core builds TE's FusedAdam when TE is installed; 'torch': its torch fallback."""
    if adam == "torch":
        monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", True)


def build_scheduler(args, optimizer):
    """Megatron-LM's learning-rate scheduler of ``args`` for ``optimizer`` (the one its
    training loop builds; it reads the global args, set for the call only)."""
    saved = global_vars._GLOBAL_ARGS
    global_vars.set_args(args)
    try:
        return get_optimizer_param_scheduler(optimizer)
    finally:
        global_vars.set_args(saved)


class Run:
    """A tiny GPT (bf16, DDP), megatron-core's optimizer and Megatron-LM's scheduler, stepped
    through an `OptimizerGraph` (``capture_at`` None: always eager, same live tensors). The
    DDP and optimizer configs and the scheduler are Megatron-LM's, from the parsed args."""

    def __init__(self, args, capture_at, weights_from: "Run" = None, capturable=True):
        self.args = args
        config = transformer_config_from_args(args)
        self.model = DistributedDataParallel(
            config, get_megatron_ddp_config(args),
            Float16Module(config, pretrain_gpt.model_provider(args, config).cuda()))
        if weights_from is not None:
            for mine, theirs in zip(self.model.parameters(), weights_from.model.parameters()):
                mine.data.copy_(theirs.data)
        # The flag is the runtime's after parsing (args.packed_optimizer_graph); the config
        # asks megatron-core for capturable kernels as pretrain's does with it.
        optimizer_config, overrides = get_megatron_optimizer_config(args)
        optimizer_config.optimizer_cuda_graph = capturable
        self.optimizer = get_megatron_optimizer(optimizer_config, [self.model],
                                                config_overrides=overrides)
        self.scheduler = build_scheduler(args, self.optimizer)
        self.graph = (OptimizerGraph.for_optimizer(self.optimizer, capture_at) if capturable
                      else None)

    def step(self, step: int, batch):
        """Gradients of step ``step`` (a function of the weights), the optimizer step, the
        scheduler; returns (success, grad norm, loss of ``batch`` after the step)."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        write_gradients(self.model, step)
        success, grad_norm, _ = (self.graph or self.optimizer.step)()
        grad_norm = grad_norm.clone()  # graph-owned: the next replay overwrites it
        self.scheduler.step(increment=self.args.global_batch_size)
        return success, grad_norm, loss_of(self.model, batch)

    def learning_rates(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def step_counters(self):
        """Adam's step count tensors: per group (FusedAdam) or per parameter (torch)."""
        counters = []
        for inner in inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                if "step" in group:
                    counters.append(group["step"])
                counters += [inner.state[p]["step"] for p in group["params"]
                             if "step" in inner.state.get(p, {})]
        return counters


@torch.no_grad()  # fp32 parameters: param.float() is the parameter itself
def write_gradients(model, step: int) -> None:
    """Deterministic gradients that depend on the weights; global norm 2 on odd steps (clipped
    by --clip-grad 1.0), 0.5 on even ones."""
    generator = torch.Generator(device="cuda").manual_seed(step)
    grads = [param.float() * 0.01 + 1e-3 * torch.randn(param.shape, generator=generator,
                                                       device="cuda")
             for param in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    target = 2.0 if step % 2 else 0.5
    for param, grad in zip(model.parameters(), grads):
        param.main_grad.copy_(grad * (target / norm))


def fixed_batch(args):
    data = MockPackedDataset(4, args.seq_length, args.vocab_size, seed=3, doc_length_median=128)
    return to_device_micro_batch(collate_packed_rows([data[0]]), with_seq_idx=False,
                                 static_max_seqlen=True)


@torch.no_grad()
def loss_of(model, mb):
    output = model(mb.tokens, mb.position_ids, None, labels=mb.labels,
                   packed_seq_params=mb.params)
    loss, tokens, _ = masked_lm_loss(mb.loss_mask, output)
    return loss / tokens


def parse(*extra):
    apply_core_patches()  # sync-free clipping below TE 2.14, as pretrain applies it
    return parse_args(TINY_GPT + TRAIN + SCHEDULE + ["--optimizer-cuda-graph", *extra],
                      model="gpt")


def assert_same_weights(a: Run, b: Run, step: int):
    different = [name for (name, x), y in zip(a.model.named_parameters(), b.model.parameters())
                 if not torch.equal(x, y)]
    assert different == [], (step, different[:5])


@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed"])
@pytest.mark.parametrize("adam", ADAMS)
def test_graphed_step_equals_the_eager_step_bitwise(dist, monkeypatch, adam, distributed):
    use_adam(monkeypatch, adam)
    args = parse(*(["--use-distributed-optimizer"] if distributed else []))
    eager = Run(args, capture_at=None)
    graphed = Run(args, capture_at=3, weights_from=eager)
    batch = fixed_batch(args)
    rates, counters, clipped = graphed.learning_rates(), None, 0
    for step in range(1, STEPS + 1):
        if step == 10:  # a replay, the binding check and the scheduler's fill: no host sync
            graphed.model.zero_grad_buffer()
            graphed.optimizer.zero_grad()
            write_gradients(graphed.model, step)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                result = graphed.graph()
                graphed.scheduler.step(increment=args.global_batch_size)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            graphed_result = (result[0], result[1].clone(), loss_of(graphed.model, batch))
        else:
            graphed_result = graphed.step(step, batch)
        eager_result = eager.step(step, batch)
        assert eager_result[0] is True and graphed_result[0] is True
        assert torch.equal(eager_result[1], graphed_result[1]), (step, eager_result[1],
                                                                 graphed_result[1])
        assert torch.equal(eager_result[2], graphed_result[2]), (step, eager_result[2],
                                                                 graphed_result[2])
        assert_same_weights(eager, graphed, step)
        clipped += eager_result[1].item() > 1.0
        # Learning rate: the same tensors, filled with the schedule's value.
        assert all(now is then for now, then in zip(graphed.learning_rates(), rates))
        for lr in graphed.learning_rates():
            assert lr.item() == pytest.approx(expected_lr(step), rel=1e-6), step
        # Adam's step count: the same tensors, counting every step (replays included).
        if counters is None:
            counters = graphed.step_counters()
            assert counters and all(c.is_cuda for c in counters)
        assert all(now is then for now, then in zip(graphed.step_counters(), counters))
        assert all(int(c.reshape(-1)[0].item()) == step for c in counters), step
        if step < 3:
            assert graphed.graph.graph is None
            assert graphed.graph.statistics() == {EAGER_KEY: 1}
        elif step == 3:
            stats = graphed.graph.statistics()
            assert graphed.graph.graph is not None and stats["optimizer graph capture (s)"] > 0
            assert "optimizer graph memory (MiB)" in stats
        else:
            assert graphed.graph.statistics() == {}
    assert clipped == STEPS // 2  # clipping active on the odd steps, not on the even ones


@pytest.mark.parametrize("adam", ADAMS)
def test_state_loaded_after_capture_lands_in_the_captured_tensors(dist, monkeypatch, adam):
    use_adam(monkeypatch, adam)
    args = parse()
    eager = Run(args, capture_at=None)
    graphed = Run(args, capture_at=3, weights_from=eager)
    batch = fixed_batch(args)
    for step in range(1, 11):
        for run in (eager, graphed):
            run.step(step, batch)
    saved = {id(run): (copy.deepcopy(run.optimizer.state_dict()), run.scheduler.state_dict(),
                       [p.detach().clone() for p in run.model.parameters()])
             for run in (eager, graphed)}
    first = [graphed.step(step, batch) for step in range(11, 16)]
    for run in (eager, graphed):  # back to the state after step 10, as a resume loads it
        state, schedule, weights = saved[id(run)]
        run.optimizer.load_state_dict(copy.deepcopy(state))  # binds fresh tensors
        run.scheduler = build_scheduler(args, run.optimizer)
        run.scheduler.load_state_dict(schedule)
        for param, weight in zip(run.model.parameters(), weights):
            param.data.copy_(weight)
    for step, before in zip(range(11, 16), first):
        reference, again = eager.step(step, batch), graphed.step(step, batch)
        # The graph replays on the loaded state: what it computed from that state before,
        # and what the eager step computes from it.
        for result in (before, reference):
            assert torch.equal(result[1], again[1]) and torch.equal(result[2], again[2]), step
    assert_same_weights(eager, graphed, 15)
    assert graphed.graph.steps == 20 and graphed.graph.graph is not None


def test_an_optimizer_without_capturable_kernels_is_refused(dist):
    args = parse()
    run = Run(args, capture_at=None, capturable=False)
    with pytest.raises(ValueError, match="built without capturable kernels. Build it from "
                                         r"OptimizerConfig\(optimizer_cuda_graph=True\)"):
        OptimizerGraph.for_optimizer(run.optimizer, 3)


# -- training with the real script -------------------------------------------------------------

MODEL_GRAPHS = {
    "none": [],
    "local": ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "32"],
    "te": ["--attention-backend", "auto", "--cuda-graph-impl", "transformer_engine",
           "--cuda-graph-max-packed-seqs", "32"],
}


@pytest.mark.parametrize("graphs", ["none", "local", pytest.param("te", marks=pytest.mark.skipif(
    not HAS_TE, reason="needs Transformer Engine"))])
def test_training_with_the_optimizer_graph_matches_the_eager_optimizer(tmp_path, graphs):
    common = (TINY_GPT + TRAIN + SCHEDULE + ["--global-batch-size", "2",
                                             "--cuda-graph-warmup-steps", "2"]
              + MODEL_GRAPHS[graphs])
    eager = run_training("pretrain_gpt.py", common, tmp_path, name="eager")
    graphed = run_training("pretrain_gpt.py", common + ["--optimizer-cuda-graph"], tmp_path,
                           name="graphed")
    assert [r.get(EAGER_KEY) for r in graphed[:4]] == [1, 1, None, None]
    captures = [r["iteration"] for r in graphed if "optimizer graph capture (s)" in r]
    assert captures == [3] and graphed[2]["optimizer graph capture (s)"] > 0
    assert not any(EAGER_KEY in r for r in eager)
    for record in eager + graphed:  # the schedule at every step, no re-capture needed
        assert record["learning_rate"] == pytest.approx(expected_lr(record["iteration"]),
                                                        rel=1e-6)
    dloss = max(abs(e["lm_loss"] - g["lm_loss"]) for e, g in zip(eager, graphed))
    dnorm = max(abs(e["grad_norm"] - g["grad_norm"]) / e["grad_norm"]
                for e, g in zip(eager, graphed))
    print(f"model graphs {graphs}: max |dloss| {dloss:.2e}, max rel |dgrad norm| {dnorm:.2e}")
    assert dloss < 5e-3 and dnorm < 0.02, (dloss, dnorm, losses(eager), losses(graphed))


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]],
                         ids=["optimizer", "distributed"])
def test_resume_with_the_optimizer_graph_continues_the_uninterrupted_run(tmp_path, optimizer):
    """With the distributed optimizer and TE's FusedAdam the save merges the groups' step
    counts (numbers in the checkpoint: OptimizerGraph.install)."""
    common = TINY_GPT + TRAIN + CAPTURE + optimizer + [
        "--global-batch-size", "4", "--train-iters", "20", "--lr-warmup-iters", "3"]
    full = run_training("pretrain_gpt.py", common, tmp_path, name="full")
    # Saves at 5 (after the capture at 3) and at 10, then stops.
    first, second = train_then_resume("pretrain_gpt.py", common, tmp_path, save_interval=5,
                                      exit_interval=10)
    assert [r["iteration"] for r in second] == list(range(11, 21))
    # The resumed process warms up and captures again: its third step.
    assert [r.get(EAGER_KEY) for r in second[:3]] == [1, 1, None]
    assert "optimizer graph capture (s)" in second[2]
    # A save after the capture leaves the graphed run alone; the resumed curve is the
    # uninterrupted one, up to FlashAttention's non-deterministic backward accumulation.
    for resumed, reference in zip(first[5:] + second, full[5:]):
        assert abs(resumed["lm_loss"] - reference["lm_loss"]) < 2e-3, (resumed, reference)
        assert resumed["learning_rate"] == pytest.approx(reference["learning_rate"], rel=1e-6)
