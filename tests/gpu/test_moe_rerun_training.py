"""--moe-capacity-overflow rerun on the GPU (skipped without CUDA, tests/gpu/conftest.py).

* A captured drop-and-pad MoE layer counts, on replay, the slots it dropped and its peak
  expert load into the monitor's buffer; its eager forward makes no host sync.
* Under `dropless_moe` a drop-and-pad layer computes what a dropless layer computes (the
  same upstream dropless alltoall path): output and gradients bitwise; afterwards it runs
  drop-and-pad again.
* Training (GPT-MoE, hybrid-MoE; EP=2 on two GPUs): layer graphs with drop-and-pad and
  reruns match eager dropless training over 50 steps (loss from the metrics file, grad norm
  from Megatron-LM's log line), with overflowing micro-batches rerun; no token stays dropped;
  the measured loads (--moe-router-load-file) feed tools/capacity_advisor.py.
"""

import pytest
import torch

from tests.gpu.launch import (
    DROP_AND_PAD,
    LAYER_GRAPHS,
    TINY_GPT_MOE,
    TINY_HYBRID_MOE,
    TRAIN,
    losses,
    run_training,
)

RERUN_KEY = "eager moe_overflow_rerun"  # the graph runtime's count, in each metrics record
DROPPED_KEY = "moe_dropped_token_fraction"  # the runtime's log, with an expert capacity
STEPS = 50
HIDDEN, EXPERTS, TOKENS, DOCS = 64, 8, 128, 96


def _moe_layer(**capacity):
    import torch.nn.functional as F

    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.packed_graphs.specs import gpt_layer_spec

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_dropout_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01, **capacity)
    torch.manual_seed(0)
    return build_module(gpt_layer_spec("torch", num_experts=EXPERTS), config=config,
                        layer_number=1).cuda()


def _inputs(uniform: bool):
    """``[TOKENS, 1, HIDDEN]`` hidden states (documents then padding) and the padding mask;
    ``uniform``: every document token alike, so all pick the same two experts."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(TOKENS, 1, HIDDEN, device="cuda", generator=generator)
    if uniform:
        hidden[:DOCS] = hidden[0]
    mask = (torch.arange(TOKENS, device="cuda") >= DOCS).view(1, -1)
    return hidden, mask


# Capacity ceil(128 x 2 / 8 x 2.0) = 64: the 96 uniform document tokens overflow it, varied
# ones (about 24 per expert) do not.
FACTOR_2 = dict(moe_expert_capacity_factor=2.0, moe_pad_expert_input_to_capacity=True)


def test_captured_layer_counts_overflow_on_replay_without_host_sync(dist):
    layer = _moe_layer(**FACTOR_2)
    counter = torch.zeros(2, dtype=torch.int64, device="cuda")
    layer.mlp.router.overflow_counter = counter
    static_hidden, mask = _inputs(uniform=False)
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer.mlp(static_hidden, padding_mask=mask)  # eager drop-and-pad: no host sync
        finally:
            torch.cuda.set_sync_debug_mode("default")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer.mlp(static_hidden, padding_mask=mask)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer.mlp(static_hidden, padding_mask=mask)
    for uniform, overflows in ((False, False), (True, True), (False, False)):
        static_hidden.copy_(_inputs(uniform)[0])
        counter.zero_()
        graph.replay()
        dropped, peak = counter.tolist()
        assert (dropped > 0) == overflows, (uniform, dropped, peak)
        if uniform:
            assert peak == DOCS and dropped == 2 * (DOCS - 64)


def test_dropless_scope_computes_what_a_dropless_layer_computes(dist):
    from megatron.packed_model.moe import dropless_moe

    layer, dropless = _moe_layer(**FACTOR_2), _moe_layer()
    dropless.load_state_dict(layer.state_dict())
    hidden, mask = _inputs(uniform=True)

    def run(module):
        x = hidden.clone().requires_grad_()
        out, _ = module.mlp(x, padding_mask=mask)
        out[:DOCS].float().square().sum().backward()
        grads = [None if p.grad is None else p.grad.clone() for p in module.mlp.parameters()]
        module.zero_grad(set_to_none=True)
        return out.detach(), x.grad, grads

    expected = run(dropless)
    dropping = run(layer)
    with dropless_moe(layer):
        scoped = run(layer)
    assert not torch.equal(dropping[0][:DOCS], expected[0][:DOCS])  # the capacity bites
    assert torch.equal(scoped[0][:DOCS], expected[0][:DOCS])
    assert torch.equal(scoped[1][:DOCS], expected[1][:DOCS])
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(scoped[2], expected[2]))
    again = run(layer)  # drop-and-pad again, as before the scope
    assert layer.mlp.token_dispatcher.drop_and_pad
    assert torch.equal(again[0], dropping[0])


def _train(tmp_path, kind, extra, name, nproc=1):
    script, model = (("pretrain_gpt.py", TINY_GPT_MOE) if kind == "gpt"
                     else ("pretrain_mamba.py", TINY_HYBRID_MOE))
    return run_training(script, model + TRAIN + ["--train-iters", str(STEPS),
                                                 "--global-batch-size", str(4 * nproc),
                                                 *extra], tmp_path, name=name, nproc=nproc)


def _compare(eager, rerun, label):
    dloss = max(abs(e["lm_loss"] - r["lm_loss"]) for e, r in zip(eager, rerun))
    dnorm = max(abs(e["grad_norm"] - r["grad_norm"]) / e["grad_norm"]
                for e, r in zip(eager, rerun))
    reruns = sum(r.get(RERUN_KEY, 0) for r in rerun)
    print(f"{label}: {reruns} micro-batches rerun in {STEPS} steps; max |dloss| {dloss:.2e}, "
          f"max relative d grad-norm {dnorm:.2e}")
    assert len(eager) == len(rerun) == STEPS
    assert reruns > 0  # overflowing micro-batches were part of the run
    # No token stays dropped: the runtime's dropped-slot fraction (with an expert capacity,
    # in every record) is 0.
    assert all(r[DROPPED_KEY] == 0 for r in rerun)
    # Tolerance as the dense graph tests (eager max_seqlen differs from the static one; the
    # graphed micro-batches lay drop-and-pad rows out differently from dropless dispatch).
    assert dloss < 5e-3 and dnorm < 2e-2, (losses(eager), losses(rerun))


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_graphs_with_reruns_match_eager_dropless_training(tmp_path, kind):
    loads = tmp_path / "loads.json"
    eager = _train(tmp_path, kind, [], "eager_dropless")
    rerun = _train(tmp_path, kind, DROP_AND_PAD + LAYER_GRAPHS + [
        "--moe-capacity-overflow", "rerun", "--moe-router-load-file", str(loads)], "rerun")
    _compare(eager, rerun, f"{kind} MoE")
    assert rerun[2]["graph capture (s)"] > 0  # the graphs were captured and replayed
    from tools.capacity_advisor import read_router_loads, recommend_capacity_factor

    measured = read_router_loads(str(loads))
    assert measured.tokens_per_rank == 1024 and measured.peak_loads.size == 4 * STEPS
    factor, capacity, rate = recommend_capacity_factor(measured, 0.01)
    print(f"{kind}: suggested factor {factor} (capacity {capacity}, overflow {rate:.2%})")
    assert rate <= 0.01
    # Micro-batches overflowed at 1.0, so holding all of them takes more.
    assert recommend_capacity_factor(measured, 0.0)[0] > 1.0


@pytest.mark.gpus(2)
def test_expert_parallel_reruns_match_eager_dropless_training(tmp_path):
    """EP = 2: the overflow read is all-reduced, so both ranks rerun the same positions and
    their expert all-to-alls agree on the dispatch (dropless or drop-and-pad)."""
    ep = ["--expert-model-parallel-size", "2"]
    eager = _train(tmp_path, "gpt", ep, "eager_dropless_ep2", nproc=2)
    rerun = _train(tmp_path, "gpt", ep + DROP_AND_PAD + LAYER_GRAPHS + [
        "--moe-capacity-overflow", "rerun"], "rerun_ep2", nproc=2)
    _compare(eager, rerun, "EP=2 GPT MoE")
