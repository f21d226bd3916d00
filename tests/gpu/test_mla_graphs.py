"""Multi-latent attention on packed micro-batches, on the GPU (skipped without CUDA, and
without Transformer Engine: packed MLA runs on TE attention).

* The graph-safe yarn tables hold upstream's values; the TE spec builds packed MLA.
* A packed micro-batch attends like its documents run alone (per-document RoPE positions,
  V padding on and off), and the fused RoPE writes valid rows past the last boundary.
* A captured MLA forward + backward still reads valid RoPE tables after an eager micro-batch
  of another length grew them (the hazard of upstream's re-registered cos/sin cache).
* Training: eager == layer graphs (local and TE), chunk graphs, dynamic-CP graph banks
  (CP 1/2/4), for GPT, hybrid '+' layers and an MLA + MoE model.
"""

import pytest
import torch

pytest.importorskip("transformer_engine.pytorch",
                    reason="needs Transformer Engine (pip install -e '.[te]'): packed MLA runs "
                           "on TE attention")

from tests.gpu.capture import capture_without_host_sync  # noqa: E402
from tests.gpu.launch import (  # noqa: E402
    CHUNK_GRAPHS,
    LAYER_GRAPHS,
    TE,
    TE_GRAPHS,
    TRAIN,
    losses,
    run_training,
)

# Query head 32 + 32 = 64, value head 32: upstream pads V on THD (pad_value=True).
MLA = ["--multi-latent-attention", "--kv-lora-rank", "64", "--q-lora-rank", "96",
       "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "32", "--v-head-dim", "32",
       "--qk-layernorm", "--rotary-base", "50000", *TE]
TINY_MLA_GPT = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "1024",
                "--num-attention-heads", "4", "--swiglu", "--seq-length", "1024",
                "--max-position-embeddings", "1024", "--vocab-size", "1024",
                "--position-embedding-type", "rope", *MLA]
TINY_MLA_HYBRID = ["--hybrid-layer-pattern", "M+-M+-M-", "--hidden-size", "256",
                   "--num-attention-heads", "4", "--mamba-head-dim", "32",
                   "--mamba-num-groups", "2", "--mamba-state-dim", "64",
                   "--seq-length", "1024", "--max-position-embeddings", "1024",
                   "--vocab-size", "1024", "--position-embedding-type", "none", *MLA]
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128",
       "--moe-token-dispatcher-type", "alltoall",
       "--moe-shared-expert-intermediate-size", "256", "--moe-router-score-function", "sigmoid",
       "--moe-aux-loss-coeff", "0.01", "--moe-expert-capacity-factor", "1.0",
       "--moe-pad-expert-input-to-capacity", "--moe-grouped-gemm"]
SCRIPT = {"gpt": ("pretrain_gpt.py", TINY_MLA_GPT),
          "hybrid": ("pretrain_mamba.py", TINY_MLA_HYBRID),
          "moe": ("pretrain_gpt.py", TINY_MLA_GPT + MOE)}


# ------------------------------------------------------------------------ module level

def _model(extra=()):
    import pretrain_gpt
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import transformer_config_from_args

    # A bare model (no DDP, so no main_grad buffers): TE's linears must not fuse accumulation.
    args = parse_args(TINY_MLA_GPT + TRAIN + ["--train-iters", "1",
                                              "--no-gradient-accumulation-fusion", *extra],
                      model="gpt")
    config = transformer_config_from_args(args)
    torch.manual_seed(0)
    return pretrain_gpt.model_provider(args, config).cuda(), config


def _params(lengths, capacity, rows):
    from megatron.packed_graphs.capacity import pad_cu_seqlens
    from megatron.packed_graphs.packed_seq import PackedBatchParams

    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu = pad_cu_seqlens(cu, capacity).cuda()
    return PackedBatchParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=rows, max_seqlen_kv=rows)


def _attend(attention, hidden, params, grad=None):
    hidden = hidden.detach().clone().requires_grad_()
    out, _ = attention(hidden, None, packed_seq_params=params)
    if grad is None:
        return out, None
    return out, torch.autograd.grad(out, hidden, grad)[0]


@pytest.mark.parametrize("cpu_init", [False, True], ids=["device-init", "cpu-init"])
def test_graph_safe_tables_hold_upstream_yarn_values(dist, cpu_init):
    """Bit for bit, on CUDA: upstream MLA's own setting (frequencies computed on the GPU,
    whose fp32 power rounds unlike the CPU's) and use_cpu_initialization=True."""
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding

    from megatron.packed_model.mla_rope import GraphSafeYarnRotaryEmbedding

    yarn = dict(rotary_base=10000, scaling_factor=40.0, original_max_position_embeddings=4096,
                beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707,
                use_cpu_initialization=cpu_init)
    upstream = YarnRotaryEmbedding(64, **yarn)
    ours = GraphSafeYarnRotaryEmbedding(64, **yarn)
    for dtype in (torch.bfloat16, torch.float32):
        want = upstream.get_cached_cos_sin(3000, dtype=dtype, packed_seq=True)
        got = ours.get_cached_cos_sin(3000, dtype=dtype, packed_seq=True)
        for w, g in zip(want, got):
            assert g.is_cuda and g.is_contiguous() and g.dtype == w.dtype == dtype
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_te_spec_builds_packed_mla(dist):
    from megatron.packed_model.mla import PackedMLASelfAttention
    from megatron.packed_model.mla_rope import GraphSafeYarnRotaryEmbedding
    from megatron.packed_model.te_attention import PackedTEDotProductAttention

    model, config = _model()
    assert config.multi_latent_attention and config.apply_rope_fusion
    attention = model.decoder.layers[0].self_attention
    assert type(attention) is PackedMLASelfAttention and attention.pad_value
    assert isinstance(attention.core_attention, PackedTEDotProductAttention)
    assert isinstance(attention.rotary_pos_emb, GraphSafeYarnRotaryEmbedding)
    assert getattr(model, "rotary_pos_emb", None) is None  # MLA brings its own RoPE


@pytest.mark.parametrize("pad_value", [True, False])
def test_packed_mla_attends_like_documents_alone(dist, pad_value):
    """Rows of each document in a packed micro-batch (capacity-padded, padding tail as a
    segment) get the output and input gradient of that document run alone: RoPE positions
    restart per document, attention stays inside it. ``pad_value=False`` (V not padded to
    the query head size) must agree where TE has a kernel for it."""
    model, _ = _model()
    attention = model.decoder.layers[0].self_attention
    attention.pad_value = pad_value
    lengths, rows, capacity = [100, 300, 60, 52], 512, 8
    hidden = torch.randn(rows, 1, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(rows, 1, 256, device="cuda", dtype=torch.bfloat16)
    try:
        out, dhidden = _attend(attention, hidden, _params(lengths, capacity, rows), grad)
    except (RuntimeError, ValueError) as error:
        if pad_value:
            raise
        pytest.skip(f"TE has no THD kernel for unequal query and value head sizes: {error}")
    start = 0
    for length in lengths:
        rows_of = slice(start, start + length)
        alone, dalone = _attend(attention, hidden[rows_of], _params([length], capacity, length),
                                grad[rows_of])
        torch.testing.assert_close(out[rows_of], alone, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dhidden[rows_of], dalone, rtol=5e-2, atol=5e-2)
        start += length


def test_fused_rope_writes_valid_rows_past_the_last_boundary(dist):
    """The fused kernel over boundaries that stop short of the stream, with the zero-valid
    tail segment appended: every row is rotated by its table row (torch reference)."""
    from megatron.core.fusions.fused_mla_yarn_rope_apply import fused_apply_mla_rope_for_q

    from megatron.packed_model.mla_rope import (
        GraphSafeYarnRotaryEmbedding,
        cover_all_rows,
        fused_rope_table_rows,
    )

    rows, heads, nope, rope_dim = 256, 4, 32, 32
    rope = GraphSafeYarnRotaryEmbedding(rope_dim, rotary_base=10000)
    cos, sin = rope.get_cached_cos_sin(rows, dtype=torch.float32, packed_seq=True)
    bounds = cover_all_rows(torch.tensor([0, 100, 180, 180], dtype=torch.int32).cuda(), rows)
    q = torch.randn(rows, heads, nope + rope_dim, device="cuda")
    got = fused_apply_mla_rope_for_q(q.clone(), cos, sin, nope, rope_dim, bounds, 0, 1)
    read = fused_rope_table_rows(bounds, rows)
    assert read.min() >= 0
    x = q[..., nope:]
    x1, x2 = x[..., 0::2], x[..., 1::2]  # the kernel de-interleaves, then rotates halves
    c, s = cos[read, 0], sin[read, 0]
    half = rope_dim // 2
    left = x1 * c[:, :, :half] - x2 * s[:, :, :half]
    right = x2 * c[:, :, half:] + x1 * s[:, :, half:]
    torch.testing.assert_close(got[..., nope:], torch.cat([left, right], dim=-1))
    torch.testing.assert_close(got[..., :nope], q[..., :nope])


def test_graph_reads_valid_tables_after_a_longer_eager_micro_batch(dist):
    """Capture an MLA forward + backward, run an eager micro-batch 4x as long (its RoPE table
    is longer: a new table, the captured one retired, not freed), churn the allocator, then
    replay with new documents: the replay equals eager on the same input."""
    model, _ = _model(["--rotary-base", "40000"])  # RoPE tables no other test has built
    attention = model.decoder.layers[0].self_attention
    rows, capacity = 512, 8
    params = _params([100, 300, 112], capacity, rows)
    static = torch.randn(rows, 1, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, 1, 256, device="cuda", dtype=torch.bfloat16)

    def step():
        out, _ = attention(static, None, packed_seq_params=params)
        return out, torch.autograd.grad(out, static, grad)[0]

    graph, (static_out, static_grad) = capture_without_host_sync(step)

    table = attention.rotary_pos_emb.table_rows(torch.bfloat16)
    long_hidden = torch.randn(4 * rows, 1, 256, device="cuda", dtype=torch.bfloat16)
    _attend(attention, long_hidden, _params([1500, 548], capacity, 4 * rows))
    assert attention.rotary_pos_emb.table_rows(torch.bfloat16) > table  # the table grew
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(32)]

    layout = [7, 400, 1, 104]
    new_params = _params(layout, capacity, rows)
    params.cu_seqlens_q.copy_(new_params.cu_seqlens_q)
    new_hidden = torch.randn(rows, 1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        static.copy_(new_hidden)
    graph.replay()
    eager_out, eager_grad = _attend(attention, new_hidden, new_params, grad)
    torch.cuda.synchronize()
    del junk
    assert torch.isfinite(static_out).all() and torch.isfinite(static_grad).all()
    torch.testing.assert_close(static_out, eager_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(static_grad, eager_grad, rtol=5e-2, atol=5e-2)


def test_capture_refuses_a_missing_table(dist):
    from megatron.packed_model.mla_rope import GraphSafeYarnRotaryEmbedding

    rope = GraphSafeYarnRotaryEmbedding(32, rotary_base=777)  # no table built yet
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="MLA RoPE table too short under CUDA graph capture"):
        with torch.cuda.graph(graph):
            rope.get_cached_cos_sin(64, dtype=torch.bfloat16, packed_seq=True)


# ------------------------------------------------------------------------------ training

def _compare(eager, graphs, what, tolerance=5e-3, norm_tolerance=2e-2):
    dloss = max(abs(e - g) for e, g in zip(losses(eager), losses(graphs)))
    dnorm = max(abs(e["grad_norm"] - g["grad_norm"]) / e["grad_norm"]
                for e, g in zip(eager, graphs))
    print(f"{what}: max |dloss| {dloss:.2e}, max grad-norm rel diff {dnorm:.2e}")
    assert all(g["lm_loss"] == g["lm_loss"] for g in graphs)  # no NaN
    assert dloss < tolerance, (losses(eager), losses(graphs))
    assert dnorm < norm_tolerance, ([r["grad_norm"] for r in eager],
                                    [r["grad_norm"] for r in graphs])


STEPS = 20


def _training(kind):
    script, model = SCRIPT[kind]
    return script, model + TRAIN + ["--train-iters", str(STEPS), "--global-batch-size", "4"]


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    """One eager reference per model kind, shared by that kind's graph variants (the same
    flags, so the same run): three eager runs instead of seven."""
    runs = {}

    def run(kind):
        if kind not in runs:
            script, common = _training(kind)
            runs[kind] = run_training(script, common, tmp_path_factory.mktemp(f"mla_{kind}"),
                                      name=f"{kind}_eager")
        return runs[kind]
    return run


@pytest.mark.parametrize("kind, graphs", [
    ("gpt", "local"), ("gpt", "te"), ("gpt", "chunk"), ("hybrid", "local"), ("hybrid", "te"),
    ("moe", "local"), ("moe", "te"),
])
def test_mla_graphs_train_like_eager(tmp_path, eager_run, kind, graphs):
    """20 steps (2 eager warm-up, then replays): layer graphs (local and TE impl) and chunk
    graphs replay MLA layers with eager's loss and grad norm, over-capacity micro-batches
    included (capacity 16)."""
    script, common = _training(kind)
    flags = {"local": LAYER_GRAPHS, "te": TE_GRAPHS, "chunk": CHUNK_GRAPHS}[graphs]
    eager = eager_run(kind)
    graphed = run_training(script, common + flags, tmp_path, name=f"{kind}_{graphs}")
    assert graphed[2]["graph capture (s)"] > 0
    _compare(eager, graphed, f"MLA {kind}, {graphs} graphs")
    assert losses(eager)[-1] < losses(eager)[0] - 0.5


@pytest.mark.parametrize("kind, sizes, ranks", [
    pytest.param("gpt", (2,), 2, marks=pytest.mark.gpus(2)),
    pytest.param("gpt", (1, 2), 2, marks=pytest.mark.gpus(2)),
    pytest.param("hybrid", (1, 2), 2, marks=pytest.mark.gpus(2)),
    pytest.param("gpt", (1, 2, 4), 4, marks=pytest.mark.gpus(4)),
])
def test_mla_dynamic_cp_graph_banks(tmp_path, kind, sizes, ranks):
    """Dynamic CP (refused by megatron-core 0.19.2 for MLA): banks of TE layer graphs per CP
    size, each captured with its own max_seqlen, train like eager over mixed CP sizes; every
    bank replays the RoPE tables it captured while later banks grow them."""
    script, model = SCRIPT[kind]
    common = model + TRAIN + [
        "--train-iters", "40", "--global-batch-size", str(2 * ranks),
        "--mock-doc-length-median", "192", "--mock-doc-length-sigma", "1.2",
        "--dynamic-cp-sizes", *map(str, sizes)]
    eager = run_training(script, common, tmp_path, nproc=ranks, name=f"{kind}_dcp_eager")
    graphs = run_training(script, common + ["--cuda-graph-impl", "transformer_engine",
                                            "--cuda-graph-max-packed-seqs", "8",
                                            "--cuda-graph-warmup-steps", "2"],
                          tmp_path, nproc=ranks, name=f"{kind}_dcp_graphs")
    used = {int(part.split("x")[0]) for r in graphs for part in r["cp micro-batches"].split()}
    assert used == set(sizes), used
    for size in sizes:
        assert graphs[2][f"graph memory cp{size} (MiB)"] > 0
    _compare(eager, graphs, f"MLA {kind} dynamic CP {sizes} on {ranks} ranks")


@pytest.mark.gpus(2)
def test_mla_static_context_parallelism_trains_like_one_rank(tmp_path):
    """CP 2 (the fused RoPE over the whole stream's CP-padded boundaries) follows CP 1.

    Under CP the packer pads every document to a multiple of 2 x CP, so a row can hold fewer
    documents than at CP 1 (with the default seed the fourth row loses its last document and
    the curves part there). Seed 4 packs all 20 rows alike at CP 1 and 2, and the test
    checks that first."""
    script, model = SCRIPT["gpt"]
    common = model + TRAIN + ["--train-iters", "20", "--global-batch-size", "1", "--seed", "4"]
    one = run_training(script, common, tmp_path, name="cp1")
    two = run_training(script, common + ["--context-parallel-size", "2"], tmp_path, nproc=2,
                       name="cp2")
    docs = [[r["docs per micro-batch"] for r in run] for run in (one, two)]
    assert docs[0] == docs[1], f"CP 1 and CP 2 packed other documents: {docs}"
    # CP 2 sums each document's attention in another order (bf16): the losses stay within
    # 5e-3, single-iteration grad norms part by up to 2.4% (measured on an H200).
    _compare(one, two, "MLA CP 2 vs CP 1", tolerance=2e-2, norm_tolerance=5e-2)
