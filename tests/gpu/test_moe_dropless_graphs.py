"""Dropless MoE graphs (--moe-dropless-graphs) on the GPU (skipped without CUDA).

* torch's grouped GEMM over device offsets equals a matmul per group (output and both
  gradients); a group of zero rows (an expert without tokens) gets a zero weight gradient; a
  captured grouped GEMM replays new offsets bit for bit.
* A dropless MoE layer starts from megatron-core's SequentialMLP weights (same seed, the GPU's
  expert RNG tracker), runs forward and backward without a host sync, and computes what
  megatron-core's dropless alltoall layer computes (to bf16 rounding).
* One captured layer (forward and backward) replays any routing, balanced or all tokens on two
  experts, bit for bit like eager.
* Through the real schedule: replayed gradients equal eager per parameter (GPT-MoE and
  hybrid-MoE), and a replayed step makes no host sync.
* Training 50 steps (Megatron-LM's loop): dropless graphs follow megatron-core's eager
  dropless training (TE-free, the same initial weights), GPT-MoE and hybrid-MoE; on TE with
  grouped GEMM (local and TE graphs) they follow their own eager run; with a skewed router too.
  No micro-batch is rerun, no token dropped (the log's fraction is 0), and the only eager
  micro-batches are warm-up and segment-capacity overflow.
* Expert parallelism (2 GPUs): EP = 2 dropless graphs (the padded fixed-size exchange inside
  the graphs) follow megatron-core's eager dropless EP = 2 training.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.packed_training.extra_args import is_importable
from tests.gpu.capture import capture_without_host_sync, seam_replay_makes_no_host_sync
from tests.gpu.launch import (
    LAYER_GRAPHS,
    TINY_GPT_MOE,
    TINY_HYBRID_MOE,
    TRAIN,
    assert_moe_follows_eager,
    losses,
    run_training,
)

STEPS = 50
HIDDEN, EXPERTS, TOKENS, DOCS = 64, 8, 128, 96
DROPLESS_GRAPHS = ["--moe-dropless-graphs"]
RERUN_KEY = "eager moe_overflow_rerun"
DROPPED_KEY = "moe_dropped_token_fraction"
TE_FREE = ["--attention-backend", "local"]


def _flag_added() -> bool:
    from megatron.packed_training.arguments import build_parser

    return any("--moe-dropless-graphs" in a.option_strings for a in build_parser()._actions)


needs_flag = pytest.mark.skipif(not _flag_added(),
                                reason="--moe-dropless-graphs is not in the training parser")


# ---------------------------------------------------------------------------- grouped GEMM

def _grouped_operands(offsets):
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(96, 64, device="cuda", generator=generator).bfloat16().requires_grad_()
    weight = (0.1 * torch.randn(len(offsets), 48, 64, device="cuda", generator=generator)
              ).bfloat16().requires_grad_()
    return x, weight, torch.tensor(offsets, dtype=torch.int32, device="cuda")


def test_grouped_gemm_equals_a_matmul_per_group(dist):
    from megatron.packed_model.grouped_gemm import grouped_linear

    x, weight, offsets = _grouped_operands([8, 40, 48, 88])  # rows 88-95: the unused tail
    out = grouped_linear(x, weight, offsets)
    grad = torch.randn_like(out)
    grad[88:] = 0
    dx, dweight = torch.autograd.grad(out, (x, weight), grad)
    reference, starts = [], [0, 8, 40, 48]
    xf, wf = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    for g, (start, end) in enumerate(zip(starts, offsets.tolist())):
        reference.append(xf[start:end] @ wf[g].t())
    reference = torch.cat(reference)
    rdx, rdweight = torch.autograd.grad(reference, (xf, wf), grad[:88].float())
    torch.testing.assert_close(out[:88].float(), reference, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx[:88].float(), rdx[:88], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dweight.float(), rdweight, rtol=2e-2, atol=5e-2)


def test_an_expert_of_zero_rows_gets_a_zero_weight_gradient(dist):
    """The layout gives an expert without tokens one alignment unit of zero rows: its weight
    gradient is exactly zero (a group of no rows gets garbage on Blackwell, pytorch#172439)."""
    from megatron.packed_model.grouped_gemm import grouped_linear

    x, weight, offsets = _grouped_operands([32, 40, 72, 96])
    with torch.no_grad():
        x[32:40] = 0
    out = grouped_linear(x, weight, offsets)
    _, dweight = torch.autograd.grad(out, (x, weight), torch.randn_like(out))
    assert not dweight[1].any() and dweight[0].any() and dweight[2].any()


def test_a_captured_grouped_gemm_replays_new_offsets_bit_for_bit(dist):
    from megatron.packed_model.grouped_gemm import grouped_linear

    x, weight, offsets = _grouped_operands([24, 48, 72, 96])
    grad = torch.randn(96, 48, device="cuda").bfloat16()

    def step():
        out = grouped_linear(x, weight, offsets)
        return (out, *torch.autograd.grad(out, (x, weight), grad))

    graph, static = capture_without_host_sync(step, warmup=3)
    for ends in ([8, 16, 88, 96], [64, 72, 80, 88], [24, 48, 72, 96]):
        offsets.copy_(torch.tensor(ends, dtype=torch.int32))
        graph.replay()
        eager = step()
        rows = ends[-1]
        assert torch.equal(static[0][:rows], eager[0][:rows]), ends
        assert torch.equal(static[1][:rows], eager[1][:rows]), ends
        assert torch.equal(static[2], eager[2]), ends


# ---------------------------------------------------------------------------------- the layer

def _config(**overrides):
    from megatron.packed_training.config import PackedTransformerConfig

    settings = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_dropout_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
        bf16=True, params_dtype=torch.bfloat16)
    return PackedTransformerConfig(**(settings | overrides))


def _layer(dropless_graphs: bool):
    """A GPT MoE layer, megatron-core's dropless or --moe-dropless-graphs', from the same seeds
    (the graph-safe RNG tracker of the `dist` fixture, reseeded)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron.packed_graphs.specs import gpt_layer_spec
    from megatron.packed_training.initialize import set_seeds

    set_seeds(123, te_rng_tracker=is_importable("transformer_engine"))
    layer = build_module(gpt_layer_spec("torch", num_experts=EXPERTS),
                         config=_config(moe_dropless_graphs=dropless_graphs), layer_number=1)
    return layer.cuda()


def _inputs(uniform: bool = False, seed: int = 1):
    """bf16 ``[TOKENS, 1, HIDDEN]`` hidden states (documents, then a padding tail) and the
    padding mask; ``uniform``: every document token alike, so all pick the same two experts."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(TOKENS, 1, HIDDEN, device="cuda", generator=generator).bfloat16()
    if uniform:
        hidden[:DOCS] = hidden[0]
    return hidden, (torch.arange(TOKENS, device="cuda") >= DOCS).view(1, -1)


def test_the_layer_needs_no_host_sync_and_computes_megatrons_dropless_results(dist):
    from megatron.packed_model.moe_dropless import DroplessMoELayer

    upstream, ours = _layer(False), _layer(True)
    assert isinstance(ours.mlp, DroplessMoELayer)
    experts = upstream.mlp.experts.local_experts
    # The same initial weights as megatron-core's SequentialMLP (the expert RNG tracker).
    assert torch.equal(ours.mlp.experts.fc1_weight,
                       torch.stack([e.linear_fc1.weight for e in experts]))
    assert torch.equal(ours.mlp.experts.fc2_weight,
                       torch.stack([e.linear_fc2.weight for e in experts]))
    hidden, mask = _inputs()
    grad = torch.randn_like(hidden)
    grad[DOCS:] = 0

    def run(layer):
        x = hidden.clone().requires_grad_()
        out, _ = layer.mlp(x, padding_mask=mask)
        out.backward(grad)
        return out, x.grad, layer.mlp.router.weight.grad

    expected = run(upstream)  # megatron-core's dropless alltoall: reads counts on the host
    run(ours)  # once before the check: lazy set-up (kernels, handles) may copy to the device
    ours.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run(ours)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not got[0][DOCS:].any()  # padding is routed nowhere
    for value, reference in zip(got, expected):
        torch.testing.assert_close(value[:DOCS].float(), reference[:DOCS].float(),
                                   rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(
        ours.mlp.experts.fc1_weight.grad.float(),
        torch.stack([e.linear_fc1.weight.grad for e in experts]).float(), rtol=2e-2, atol=2e-3)


def test_a_captured_layer_replays_any_routing_bit_for_bit(dist):
    layer = _layer(True)
    static_hidden, mask = _inputs()
    grad = torch.randn_like(static_hidden)
    params = [p for p in layer.mlp.parameters() if p.requires_grad]

    def step():
        x = static_hidden.detach().requires_grad_()
        out, _ = layer.mlp(x, padding_mask=mask)
        return (out, *torch.autograd.grad(out, [x, *params], grad))

    graph, static = capture_without_host_sync(step, warmup=3)
    for uniform, seed in ((False, 2), (True, 3), (False, 4)):  # (True: two experts take all)
        static_hidden.copy_(_inputs(uniform, seed)[0])
        graph.replay()
        eager = step()
        for replayed, expected in zip(static, eager):
            assert torch.equal(replayed, expected), (uniform, seed)


# --------------------------------------------------------------- through the real schedule

@needs_flag
@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_replayed_gradients_equal_eager(dist, kind):
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    from tools.compare_graph_grads import compare_replay_with_eager

    aliasing, results = compare_replay_with_eager(
        kind, (TINY_GPT_MOE if kind == "gpt" else TINY_HYBRID_MOE) + DROPLESS_GRAPHS,
        capacity=32, micro_batches=2)
    delete_cuda_graphs()
    assert aliasing == []
    for case, (total, rows) in results.items():
        print(f"{kind} dropless MoE graphs: {case}: {total:.3e}")
        assert total < 1e-6, (case, rows[:3])


@needs_flag
def test_a_replayed_step_makes_no_host_sync(dist):
    loss = seam_replay_makes_no_host_sync(TINY_GPT_MOE + DROPLESS_GRAPHS + TRAIN + [
        "--train-iters", "4", "--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "32",
        "--cuda-graph-warmup-steps", "1"], "gpt", with_padding_mask=True)
    assert torch.isfinite(loss).item()


# ---------------------------------------------------------------------------------- training

def _train(tmp_path, kind, extra, name, nproc=1):
    script, model = (("pretrain_gpt.py", TINY_GPT_MOE) if kind == "gpt"
                     else ("pretrain_mamba.py", TINY_HYBRID_MOE))
    return run_training(script, model + TRAIN + ["--train-iters", str(STEPS),
                                                 "--global-batch-size", str(4 * nproc),
                                                 *extra], tmp_path, name=name, nproc=nproc)


def _assert_graphed_and_dropless(records, label):
    """Captured, replayed, nothing rerun or dropped; eager only for warm-up and overflow."""
    assert any(r.get("graph capture (s)") for r in records), label
    assert all(RERUN_KEY not in r for r in records), label
    assert all(r[DROPPED_KEY] == 0 for r in records), label  # the log's fraction, measured
    reasons = {key for r in records for key in r if key.startswith("eager ")}
    assert reasons <= {"eager warmup", "eager overflow"}, reasons
    replayed = sum(4 - r.get("graph fallbacks", 0) for r in records[3:])
    assert replayed > (STEPS - 3) * 4 // 2, replayed  # most micro-batches replay


def _assert_follows(eager, graphs, label):
    assert len(eager) == len(graphs) == STEPS
    dnorm = max(abs(e["grad_norm"] - g["grad_norm"]) / e["grad_norm"]
                for e, g in zip(eager, graphs))
    print(f"{label}: max relative d grad-norm {dnorm:.2e}")
    assert_moe_follows_eager(eager, graphs, label)
    assert dnorm < 2e-2, (losses(eager), losses(graphs))


@needs_flag
@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_dropless_graphs_train_like_megatron_eager_dropless(tmp_path, kind):
    """TE-free, so megatron-core's experts are SequentialMLP over local linears: the run with
    --moe-dropless-graphs starts from the same weights."""
    eager = _train(tmp_path, kind, TE_FREE, "eager_dropless")
    graphs = _train(tmp_path, kind, TE_FREE + DROPLESS_GRAPHS + LAYER_GRAPHS, "dropless_graphs")
    _assert_graphed_and_dropless(graphs, kind)
    _assert_follows(eager, graphs, f"{kind} dropless graphs vs megatron-core eager dropless")


@needs_flag
@pytest.mark.skipif(not is_importable("transformer_engine"), reason="needs Transformer Engine")
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_te_grouped_gemm_dropless_graphs_train_like_their_eager_run(tmp_path, impl):
    te = ["--attention-backend", "auto", "--moe-grouped-gemm", "--te-rng-tracker"]
    graphs_flags = [*LAYER_GRAPHS]
    graphs_flags[graphs_flags.index("--cuda-graph-impl") + 1] = impl
    eager = _train(tmp_path, "gpt", te + DROPLESS_GRAPHS, "eager")
    graphs = _train(tmp_path, "gpt", te + DROPLESS_GRAPHS + graphs_flags, "graphs")
    _assert_graphed_and_dropless(graphs, impl)
    _assert_follows(eager, graphs, f"TE grouped GEMM, {impl} graphs")


@needs_flag
def test_a_skewed_router_replays_every_micro_batch_dropless(tmp_path):
    skew = ["--moe-router-skew", "0.4"]  # 8 experts, top-2: 0.4 of the slots to expert 0
    eager = _train(tmp_path, "gpt", TE_FREE + skew, "eager_skewed")
    graphs = _train(tmp_path, "gpt", TE_FREE + skew + DROPLESS_GRAPHS + LAYER_GRAPHS,
                    "dropless_graphs_skewed")
    _assert_graphed_and_dropless(graphs, "skewed")
    _assert_follows(eager, graphs, "skewed router")


@needs_flag
@pytest.mark.gpus(2)
@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_expert_parallel_dropless_graphs_train_like_megatron_eager_dropless(tmp_path, kind):
    """EP = 2 over two data-parallel ranks, four experts each: the counts and the fixed-size
    blocks cross in equal-split all-to-alls inside the graphs; megatron-core's eager dropless
    EP = 2 run (all-to-all-v, sizes read on the host) is the reference."""
    ep = TE_FREE + ["--expert-model-parallel-size", "2"]
    eager = _train(tmp_path, kind, ep, "eager_dropless_ep2", nproc=2)
    graphs = _train(tmp_path, kind, ep + DROPLESS_GRAPHS + LAYER_GRAPHS, "dropless_graphs_ep2",
                    nproc=2)
    _assert_graphed_and_dropless(graphs, f"{kind} EP=2")
    _assert_follows(eager, graphs, f"{kind} EP=2 dropless graphs vs megatron-core eager dropless")
