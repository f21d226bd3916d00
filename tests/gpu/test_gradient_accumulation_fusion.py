"""--gradient-accumulation-fusion (Megatron-LM's default) on a Transformer Engine model.

Without apex, TE's linears accumulate their weight gradients into DDP's ``main_grad``
themselves, megatron-core's own linears (the output layer) unfused:

* the built model fuses exactly there;
* replayed layer graphs (local and TE) give eager's per-parameter gradients, over accumulated
  micro-batches (a TE replay runs no Python, so DDP must not add TE's placeholder gradient);
* fused training matches unfused eager training, eager and under layer, TE and
  full-iteration graphs.
"""

import pytest

from megatron.core.transformer.cuda_graphs import delete_cuda_graphs
from megatron.packed_training.extra_args import is_importable
from tests.gpu.launch import TINY_GPT, TINY_HYBRID, TRAIN, losses, run_training
from tools.compare_graph_grads import compare_replay_with_eager

pytestmark = pytest.mark.skipif(not is_importable("transformer_engine"),
                                reason="needs Transformer Engine (its linears fuse)")

TE_MODEL = ["--attention-backend", "auto"]


def test_te_linears_fuse_and_megatron_core_linears_do_not(dist):
    import pretrain_gpt
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.packed_upstream.patches import apply_core_patches
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import transformer_config_from_args
    from tools.compare_graph_grads import model_defaults

    apply_core_patches()
    args = parse_args(model_defaults("gpt", TINY_GPT) + TINY_GPT + TE_MODEL + [
        "--mock-data", "--sft", "--bf16", "--lr", "1e-4", "--train-iters", "1",
        "--micro-batch-size", "1", "--global-batch-size", "1"], model="gpt")
    assert args.gradient_accumulation_fusion
    config = transformer_config_from_args(args)
    model = pretrain_gpt.model_provider(args, config)
    te_linears = [m for m in model.modules() if hasattr(m, "fuse_wgrad_accumulation")]
    own_linears = [m for m in model.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(te_linears) >= 4 * 4 and all(m.fuse_wgrad_accumulation for m in te_linears)
    assert model.output_layer in own_linears
    fused_own = [m for m in own_linears if m.gradient_accumulation_fusion]
    assert fused_own == [] or is_importable("fused_weight_gradient_mlp_cuda"), fused_own


@pytest.mark.parametrize("impl,granularity", [("local", "layer"), ("transformer_engine", "layer")])
@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_replayed_fused_gradients_equal_eager(dist, kind, impl, granularity):
    _, results = compare_replay_with_eager(
        kind, (TINY_GPT if kind == "gpt" else TINY_HYBRID) + TE_MODEL, capacity=32,
        micro_batches=2, impl=impl, granularity=granularity)
    delete_cuda_graphs()
    for case, (total, rows) in results.items():
        print(f"{kind} {impl} fused: {case}: {total:.3e}")
        # A placeholder gradient added by DDP, or TE's warm-up left in main_grad, is O(1).
        assert total < 1e-6, (case, rows[:3])


GRAPH_RUNS = {
    "layer": ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "7",
              "--cuda-graph-warmup-steps", "2"],
    "te": ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", "7",
           "--cuda-graph-warmup-steps", "2"],
    "full_iteration": ["--cuda-graph-impl", "full_iteration", "--cuda-graph-max-packed-seqs",
                       "32", "--cuda-graph-warmup-steps", "2"],
}


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_fused_training_matches_unfused_eager(tmp_path, kind):
    script, model = ("pretrain_gpt.py", TINY_GPT) if kind == "gpt" else ("pretrain_mamba.py", TINY_HYBRID)
    # Graphs on TE attention switch TE's RNG tracker on, full-iteration graphs DDP's NaN
    # check off: every run takes both, so runs differ in the graph and fusion flags only.
    common = model + TRAIN + TE_MODEL + ["--te-rng-tracker", "--no-check-for-nan-in-loss-and-grad",
                                         "--train-iters", "20", "--global-batch-size", "4"]
    unfused = run_training(script, common + ["--no-gradient-accumulation-fusion"], tmp_path,
                           name="unfused")
    runs = {"eager": run_training(script, common, tmp_path, name="fused_eager")}
    log = (tmp_path / "fused_eager.log").read_text()
    assert "gradient accumulation fusion on in Transformer Engine's linears" in log
    for name, flags in GRAPH_RUNS.items():
        runs[name] = run_training(script, common + flags, tmp_path, name=f"fused_{name}")
    # Same seed and data. Fused accumulation adds the bf16 weight gradient in fp32 inside
    # TE's GEMM instead of after it: the curves agree to rounding; a placeholder gradient
    # added once would move the grad norm by O(1) at the first replayed iteration.
    for name, run in runs.items():
        dloss = max(abs(u["lm_loss"] - f["lm_loss"]) for u, f in zip(unfused, run))
        dnorm = max(abs(u["grad_norm"] - f["grad_norm"]) / u["grad_norm"]
                    for u, f in zip(unfused, run))
        print(f"{kind} fused {name} vs unfused eager: max |dloss| {dloss:.2e}, "
              f"max rel |dgrad norm| {dnorm:.2e}")
        assert len(run) == len(unfused) == 20
        assert dloss < 5e-3 and dnorm < 0.02, (name, dloss, dnorm, losses(unfused), losses(run))
