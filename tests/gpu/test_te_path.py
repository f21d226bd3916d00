"""Transformer Engine path on packed sequences (one GPU): TE THD attention without host syncs.

Skipped where Transformer Engine is not importable (`pip install -e ".[te]"`).
"""

import os

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch",
                         reason="needs Transformer Engine (pip install -e '.[te]')")

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.packed_model.attention import VarlenAttention  # noqa: E402
from megatron.packed_graphs.capacity import pad_cu_seqlens  # noqa: E402
from megatron.packed_graphs.packed_seq import PackedBatchParams  # noqa: E402
from megatron.packed_model.te_attention import PackedTEDotProductAttention  # noqa: E402
from tests.gpu.capture import capture_without_host_sync  # noqa: E402

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

    def step():
        static_out = te_attn(*static, None, AttnMaskType.causal, packed_seq_params=params)
        return static_out, torch.autograd.grad(static_out, static, grad_out)

    graph, (static_out, grads) = capture_without_host_sync(step)

    params.cu_seqlens_q.copy_(pad_cu_seqlens(
        torch.tensor([0, 7, 519, 520, 1024], dtype=torch.int32), capacity).cuda())
    graph.replay()
    eager_out = ref(q, k, v, None, packed_seq_params=params)
    eager_grads = torch.autograd.grad(eager_out, (q, k, v), grad_out)
    torch.testing.assert_close(static_out, eager_out, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


def test_te_spec_uses_packed_attention_and_fused_rope(dist):
    """The TE spec wires the sync-free core attention and the packed RoPE rotated by TE's
    fused kernel (PackedTESelfAttention)."""
    import pretrain_gpt
    from megatron.packed_model.te_attention import PackedTESelfAttention
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import transformer_config_from_args
    from tests.gpu.launch import TINY_GPT, TRAIN

    args = parse_args(TINY_GPT + TRAIN + ["--train-iters", "1", "--attention-backend", "auto"],
                      model="gpt")
    config = transformer_config_from_args(args)
    assert config.apply_rope_fusion
    model = pretrain_gpt.model_provider(args, config)
    attention = model.decoder.layers[0].self_attention
    assert type(attention) is PackedTESelfAttention
    assert isinstance(attention.core_attention, PackedTEDotProductAttention)


@pytest.mark.parametrize("interleaved", [False, True])
def test_te_rope_by_gather_equals_te_thd_rope(interleaved):
    """The TE spec's RoPE (a per-token table, TE's fused kernel over tokens) rotates every
    token as TE's THD RoPE kernel does, bit for bit, with capacity padding and the row's
    padding tail (a segment of its own, as the training step packs it)."""
    from megatron.core.extensions.transformer_engine import (
        fused_apply_rotary_pos_emb,
        fused_apply_rotary_pos_emb_thd,
    )

    torch.manual_seed(0)
    segments = [5, 17, 1, 40, 9, 8]  # documents, then the padding tail
    total = sum(segments)
    cu = pad_cu_seqlens(torch.tensor([0, *segments], dtype=torch.int32).cumsum(
        0, dtype=torch.int32), 12).cuda()
    positions = torch.cat([torch.arange(n) for n in segments]).cuda()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2, device="cuda").float() / DIM))
    angles = torch.outer(torch.arange(total, device="cuda").float(), inv_freq)
    if interleaved:
        freqs = torch.stack([angles, angles], dim=-1).flatten(-2)[:, None, None, :]
    else:
        freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [total, 1, 1, DIM]
    t = torch.randn(total, 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    thd = fused_apply_rotary_pos_emb_thd(t.squeeze(1), cu, freqs, interleaved=interleaved)
    gathered = fused_apply_rotary_pos_emb(t, freqs[positions], interleaved=interleaved)
    assert torch.equal(gathered.squeeze(1), thd)


TE_GRAPHS = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", "7",
             "--cuda-graph-warmup-steps", "2"]


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_te_graph_training_matches_te_eager(tmp_path, kind):
    """--cuda-graph-impl transformer_engine on packed data trains like TE eager over 50 steps,
    with over-capacity micro-batches (capacity 7) running eager inside the same iterations."""
    import statistics

    from tests.gpu.launch import TINY_GPT, TINY_HYBRID, TRAIN, losses, run_training

    script, model = ("pretrain_gpt.py", TINY_GPT) if kind == "gpt" else ("pretrain_mamba.py", TINY_HYBRID)
    # --te-rng-tracker: the tracker TE graphs switch on, so both runs initialise alike.
    common = model + TRAIN + ["--attention-backend", "auto", "--te-rng-tracker",
                              "--train-iters", "50", "--global-batch-size", "4"]
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


def _capture(fn):
    """Capture ``fn`` in a CUDA graph (after a warm-up run on a side stream); re-raise errors."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def test_te_patch_zero_fill_captures_where_te_statement_cannot():
    """TE 2.11's THD P2P backward zero-fill (``dq[cu_seqlens_padded[-1]:].fill_(0)``) cannot be
    captured: slicing by a device tensor reads it on the host. te_patches' replacement can,
    and sets the same rows to zero on replay with new boundaries."""
    import sys

    sys.path.insert(0, "te_patches")
    try:
        from thd_context_parallel import zero_rows_from
    finally:
        sys.path.remove("te_patches")
    grad = torch.ones(64, 4, 8, device="cuda")
    end = torch.tensor([0, 40], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="capture|synchroniz|not permitted"):
        _capture(lambda: grad[end[-1]:].fill_(0))
    torch.cuda.synchronize()
    grad.fill_(1)
    graph = _capture(lambda: zero_rows_from(grad, end[-1]))
    grad.fill_(1)
    end[-1] = 24
    graph.replay()
    assert grad[:24].eq(1).all() and grad[24:].eq(0).all()


def test_te_patch_transforms_the_installed_te_module(tmp_path):
    """With te_patches on PYTHONPATH the installed TE 2.11 loads its context-parallel module
    through the transform (the three zero-fills replaced), without it unchanged."""
    import os
    import subprocess
    import sys

    # The transformed module runs our helper in AttnFuncWithCPAndKVP2P.backward (the source
    # file on disk, which inspect would show, stays TE's own).
    probe = ("from transformer_engine.pytorch.attention.dot_product_attention "
             "import context_parallel as cp; names = cp.AttnFuncWithCPAndKVP2P.backward.__code__.co_names; "
             "print('patched' if '_te_patch_zero_rows_from' in names else 'unpatched')")
    base = os.environ.get("PYTHONPATH", "")
    out = {}
    for name, path in (("on", f"{os.path.abspath('te_patches')}:{base}"), ("off", base)):
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": path}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = proc.stdout.strip().splitlines()[-1]
    assert out == {"on": "patched", "off": "unpatched"}


@pytest.mark.parametrize("kind, cp", [pytest.param("gpt", 2, marks=pytest.mark.gpus(2)),
                                      pytest.param("hybrid", 2, marks=pytest.mark.gpus(2)),
                                      pytest.param("gpt", 4, marks=pytest.mark.gpus(4))])
def test_cp_graphs_match_cp_eager(tmp_path, kind, cp):
    """GPT and hybrid with CP = 2 / 4 on packed data (TE P2P ring attention; Mamba through
    megatron-core's all-to-all CP): TE-impl and local-impl graphs train like CP eager, with
    fallbacks; CP eager learns.

    Not compared with CP = 1: CP pads every document to a multiple of 2 * cp, so fewer
    documents fit a row and the data differ."""
    import statistics

    from tests.gpu.launch import TINY_GPT, TINY_HYBRID, TRAIN, losses, run_training

    script, model = {"gpt": ("pretrain_gpt.py", TINY_GPT),
                     "hybrid": ("pretrain_mamba.py", TINY_HYBRID)}[kind]
    common = model + TRAIN + ["--attention-backend", "auto", "--te-rng-tracker",
                                 "--train-iters", "30", "--global-batch-size", "4",
                                 "--context-parallel-size", str(cp)]
    eager = run_training(script, common, tmp_path, nproc=cp, name=f"{kind}_cp{cp}_eager")
    te_graphs = run_training(script, common + TE_GRAPHS, tmp_path, nproc=cp,
                             name=f"{kind}_cp{cp}_te_graphs")
    local_graphs = run_training(script, common + [
        "--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "7",
        "--cuda-graph-warmup-steps", "2"], tmp_path, nproc=cp, name=f"{kind}_cp{cp}_local_graphs")
    assert statistics.mean(losses(eager)[-5:]) < statistics.mean(losses(eager)[:5]) - 1.0
    for name, run in (("te", te_graphs), ("local", local_graphs)):
        dloss = max(abs(e - g) for e, g in zip(losses(eager), losses(run)))
        fallbacks = sum(r["graph fallbacks"] for r in run[2:])
        print(f"{kind} CP{cp} {name} graphs vs eager: max |dloss| {dloss:.2e}, fallbacks {fallbacks}")
        assert dloss < 5e-3, (name, losses(eager), losses(run))
        assert 0 < fallbacks < 28 * 4 // 2, (name, fallbacks)


@pytest.mark.parametrize("kind, flags", [
    ("gpt", ["--qk-layernorm"]),
    ("gpt-moe", ["--qk-layernorm"]),
    ("hybrid", []),
    ("hybrid-moe", []),
])
def test_te_and_te_free_models_save_the_same_checkpoint(dist, kind, flags):
    """The TE and the TE-free model of one launch line shard the same tensors (same keys and
    shapes) and the same ``_extra_state`` objects, so each backend loads the other's
    checkpoint and Megatron-LM's TE spec loads the TE-free one (it asks for every norm's
    ``_extra_state``: providers.TELayoutNorm)."""
    from tests.gpu.launch import (
        NVTE_ATTENTION_VARIABLES,
        TINY_GPT,
        TINY_GPT_MOE,
        TINY_HYBRID,
        TINY_HYBRID_MOE,
        TRAIN,
    )
    from tests.unit.hf_tiny import build_fork_model, parse_fork_args
    from tests.unit.test_hf_convert import _model_layout

    if kind.startswith("hybrid"):
        pytest.importorskip("mamba_ssm", reason="needs mamba-ssm for the hybrid model")
    model_flags = {"gpt": TINY_GPT, "gpt-moe": TINY_GPT_MOE, "hybrid": TINY_HYBRID,
                   "hybrid-moe": TINY_HYBRID_MOE}[kind] + flags
    script = kind.partition("-")[0]
    layouts = {}
    for backend in ("auto", "local"):
        for name in NVTE_ATTENTION_VARIABLES:
            os.environ.pop(name, None)  # the first model wrote its backend's (conftest.py)
        args = parse_fork_args(model_flags + ["--attention-backend", backend], script,
                               training=TRAIN + ["--train-iters", "1"])
        layouts[backend] = _model_layout(build_fork_model(args, script))
    (te_tensors, te_objects), (free_tensors, free_objects) = layouts["auto"], layouts["local"]
    assert free_tensors == te_tensors
    assert free_objects == te_objects, (sorted(te_objects - free_objects),
                                        sorted(free_objects - te_objects))
