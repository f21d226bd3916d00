"""Transformer Engine path on packed sequences (one GPU): TE THD attention without host syncs.

Skipped where Transformer Engine is not importable (docs/te-on-device.md installs it).
"""

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch",
                         reason="needs Transformer Engine (docs/te-on-device.md)")

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.packed_graphs.attention import VarlenAttention  # noqa: E402
from megatron.packed_graphs.capacity import pad_cu_seqlens  # noqa: E402
from megatron.packed_graphs.packed_seq import PackedBatchParams  # noqa: E402
from megatron.packed_graphs.te_attention import PackedTEDotProductAttention  # noqa: E402

HEADS, GROUPS, DIM = 8, 4, 64


def _attention_pair():
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=DIM, bf16=True,
                               params_dtype=torch.bfloat16, attention_dropout=0.0)
    te_attn = PackedTEDotProductAttention(config, layer_number=1,
                                          attn_mask_type=AttnMaskType.causal,
                                          attention_type="self").cuda()
    ref = VarlenAttention(config, 1, AttnMaskType.causal, "self", backend="torch")
    return te_attn, ref


def _params(lengths, capacity, total):
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu = pad_cu_seqlens(cu, capacity).cuda()
    return PackedBatchParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=total, max_seqlen_kv=total)


def test_te_thd_attention_matches_varlen_and_captures(dist):
    """TE THD attention equals PyTorch's varlen attention on capacity-padded cu_seqlens, and a
    forward + backward captures in a CUDA graph and replays new documents without a host sync."""
    torch.manual_seed(0)
    total, capacity = 1024, 16
    te_attn, ref = _attention_pair()
    q = torch.randn(total, HEADS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, GROUPS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, GROUPS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    params = _params([100, 300, 24, 600], capacity, total)

    out = te_attn(q, k, v, None, AttnMaskType.causal, packed_seq_params=params)
    expected = ref(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)

    # Capture fwd + bwd against static inputs; then replay another document layout.
    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn_like(out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (cuDNN plans, workspaces)
        for _ in range(2):
            te_attn(*static, None, AttnMaskType.causal, packed_seq_params=params).backward(grad_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            static_out = te_attn(*static, None, AttnMaskType.causal, packed_seq_params=params)
            grads = torch.autograd.grad(static_out, static, grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    params.cu_seqlens_q.copy_(pad_cu_seqlens(
        torch.tensor([0, 7, 519, 520, 1024], dtype=torch.int32), capacity).cuda())
    graph.replay()
    eager_out = ref(q, k, v, None, packed_seq_params=params)
    eager_grads = torch.autograd.grad(eager_out, (q, k, v), grad_out)
    torch.testing.assert_close(static_out, eager_out, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


def test_te_spec_uses_packed_attention_and_fused_rope(dist):
    """The TE spec wires the sync-free core attention and megatron-core's fused-RoPE attention."""
    import pretrain_gpt
    from megatron.core.transformer.attention import SelfAttention
    from megatron.training.arguments import parse_args
    from megatron.training.config import transformer_config_from_args
    from tests.gpu.launch import TINY_GPT, TRAIN

    args = parse_args(TINY_GPT + TRAIN + ["--train-iters", "1", "--attention-backend", "te"],
                      model="gpt")
    config = transformer_config_from_args(args)
    assert config.apply_rope_fusion
    model = pretrain_gpt.model_provider(args, config)
    attention = model.decoder.layers[0].self_attention
    assert type(attention) is SelfAttention
    assert isinstance(attention.core_attention, PackedTEDotProductAttention)


TE_GRAPHS = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", "7",
             "--cuda-graph-warmup-steps", "2"]


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_te_graph_training_matches_te_eager(tmp_path, kind):
    """--cuda-graph-impl transformer_engine on packed data trains like TE eager over 50 steps,
    with over-capacity micro-batches (capacity 7) running eager inside the same iterations."""
    import statistics

    from tests.gpu.launch import TINY_GPT, TINY_HYBRID, TRAIN, losses, run_training

    script, model = ("pretrain_gpt.py", TINY_GPT) if kind == "gpt" else ("pretrain_mamba.py", TINY_HYBRID)
    common = model + TRAIN + ["--attention-backend", "te", "--train-iters", "50",
                              "--global-batch-size", "4"]
    eager = run_training(script, common, tmp_path, name="te_eager")
    graphs = run_training(script, common + TE_GRAPHS, tmp_path, name="te_graphs")

    assert [r["cuda graphs"] for r in graphs[:2]] == ["warmup", "warmup"]
    captured = graphs[2]
    layers = 4 if kind == "gpt" else 8
    assert captured["graphs captured"] == 2 * layers and captured["graph memory (MiB)"] > 0
    fallbacks = sum(r["graph fallbacks"] for r in graphs[2:])
    assert 0 < fallbacks < 48 * 4 // 2, fallbacks  # both paths run
    dloss = max(abs(e["lm_loss"] - g["lm_loss"]) for e, g in zip(eager, graphs))
    dnorm = max(abs(e["grad_norm"] - g["grad_norm"]) / e["grad_norm"] for e, g in zip(eager, graphs))
    print(f"TE impl {kind}: max |dloss| {dloss:.2e}, max rel |dgrad norm| {dnorm:.2e}, "
          f"fallbacks {fallbacks}, capture {captured['graph capture (s)']} s")
    assert dloss < 5e-3 and dnorm < 0.02, (dloss, dnorm, losses(eager), losses(graphs))
    assert statistics.mean(losses(graphs)[-5:]) < statistics.mean(losses(graphs)[:5]) - 1.0
