"""Graph-safe MLA RoPE (packed_model/mla_rope.py) on CPU.

The fused kernel itself runs here too: megatron-core's Triton kernel under Triton's CPU
interpreter (``TRITON_INTERPRET=1``, a subprocess), so the torch mirror of its row -> table-row
map is checked against the kernel, including the read before the table that a row past the
last boundary makes.
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.packed_graphs.capacity import pad_cu_seqlens
from megatron.packed_model.mla import rope_params
from megatron.packed_model.mla_rope import (
    GraphSafeYarnRotaryEmbedding,
    cover_all_rows,
    fused_rope_table_rows,
    retired_tables,
)
from megatron.packed_graphs.packed_seq import build_packed_batch_params

YARN = dict(rotary_base=10000, scaling_factor=40.0, original_max_position_embeddings=4096,
            beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)


def cu(*bounds):
    return torch.tensor(bounds, dtype=torch.int32)


# ------------------------------------------------------------------ the row -> table-row map

def test_rows_past_the_last_boundary_read_before_the_table():
    assert fused_rope_table_rows(cu(0, 3, 5), 8).tolist() == [0, 1, 2, 0, 1, -1, -1, -1]


def test_zero_length_capacity_segments_are_skipped():
    padded = pad_cu_seqlens(cu(0, 3, 8), 6)  # [0, 3, 8, 8, 8, 8, 8]
    assert fused_rope_table_rows(padded, 8).tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


def test_the_tail_segment_covers_every_row():
    covered = cover_all_rows(pad_cu_seqlens(cu(0, 3, 5), 4), 8)
    assert covered.tolist() == [0, 3, 5, 5, 5, 8] and covered.dtype == torch.int32
    assert fused_rope_table_rows(covered, 8).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]


def test_the_tail_segment_is_empty_when_the_boundaries_cover_the_stream():
    full = pad_cu_seqlens(cu(0, 3, 8), 4)
    assert cover_all_rows(full, 8)[-2:].tolist() == [8, 8]
    assert torch.equal(fused_rope_table_rows(cover_all_rows(full, 8), 8),
                       fused_rope_table_rows(full, 8))


def test_context_parallel_rows_read_their_document_positions():
    # Documents of 8 and 4 positions over CP 2: rank r keeps chunks r and 3 - r of each.
    bounds = cu(0, 8, 12)
    rank0 = fused_rope_table_rows(bounds, 6, cp_size=2, cp_rank=0).tolist()
    rank1 = fused_rope_table_rows(bounds, 6, cp_size=2, cp_rank=1).tolist()
    assert rank0 == [0, 1, 6, 7, 0, 3]
    assert rank1 == [2, 3, 4, 5, 1, 2]


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_every_covered_row_reads_inside_a_stream_long_table(cp_size):
    """Hazards 1 and 2 together: with the tail segment, every row of any layout (documents,
    an uncovered tail, capacity padding) reads a table row in [0, rows * cp_size)."""
    generator = torch.Generator().manual_seed(0)
    rows = 64
    for _ in range(50):
        cuts = torch.randint(1, 8, (6,), generator=generator) * 2 * cp_size
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), cuts.cumsum(0)])
        bounds = bounds[bounds <= rows * cp_size].to(torch.int32)
        bounds = pad_cu_seqlens(bounds, 10)
        for rank in range(cp_size):
            read = fused_rope_table_rows(cover_all_rows(bounds, rows, cp_size), rows, cp_size,
                                         rank)
            assert read.min() >= 0 and read.max() < rows * cp_size


# ---------------------------------------------------------- the kernel in Triton's interpreter

_KERNEL_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import megatron.core.fusions.fused_mla_yarn_rope_apply as fused

    D, E, H = 4, 4, 2  # qk_head_dim, RoPE width, heads
    results = []
    for bounds, rows, cp_size, cp_rank in json.loads(sys.argv[1]):
        table_rows = rows * cp_size + 1
        # cos row r holds r + 1; the row before the table holds 0; sin is 0. The rotated
        # query then shows the table row each physical row read, plus 1.
        cos = torch.arange(table_rows + 1, dtype=torch.float32)[:, None].repeat(1, E)
        sin = torch.zeros(table_rows + 1, E)
        q = torch.zeros(rows, H, D + E)
        q[..., D::2] = 1.0
        bounds = torch.tensor(bounds, dtype=torch.int32)
        fused.rotary_fwd_q_kernel.fn[(rows, 1)](
            q, cos[1:], sin[1:], D, E, H, None, bounds.numel() - 1, bounds, q.stride(0),
            q.stride(1), cp_rank, cp_size, BLOCK_H=H)
        results.append((q[:, 0, D] - 1).to(torch.int64).tolist())
    print(json.dumps(results))
""")


def _kernel_reads(cases):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT, json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise AssertionError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_mirror_matches_the_triton_kernel():
    pytest.importorskip("triton")
    cases = [
        ([0, 3, 5], 8, 1, 0),                  # rows past the end: the read before the table
        ([0, 3, 5, 5, 5, 8], 8, 1, 0),         # capacity padding + the tail segment
        ([0, 3, 8, 8, 8], 8, 1, 0),            # the training layout: padding tail is a segment
        ([0, 8, 12, 12], 6, 2, 0),             # CP 2, rank 0
        ([0, 8, 12, 12], 6, 2, 1),             # CP 2, rank 1
        ([0, 8, 12], 8, 2, 1),                 # CP 2, rows past the end
    ]
    kernel = _kernel_reads(cases)
    for (bounds, rows, cp_size, cp_rank), reads in zip(cases, kernel):
        mirror = fused_rope_table_rows(cu(*bounds), rows, cp_size, cp_rank).tolist()
        assert reads == mirror, (bounds, cp_size, cp_rank)
    assert -1 in kernel[0] and -1 not in kernel[1]


# ------------------------------------------------------------------- graph-safe yarn tables

def _reference_yarn(dim, rows, *, rotary_base, scaling_factor, original_max_position_embeddings,
                    beta_fast, beta_slow, mscale, mscale_all_dim):
    """DeepSeek's yarn, written out: blend interpolated and original frequencies over a
    linear ramp between the channels of beta_slow and beta_fast rotations."""
    def channel(rotations):
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rotary_base))
    low = max(math.floor(channel(beta_fast)), 0)
    high = min(math.ceil(channel(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    original = 1.0 / rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = original / scaling_factor * ramp + original * (1 - ramp)
    attention = lambda m: 0.1 * m * math.log(scaling_factor) + 1.0
    scale = attention(mscale) / attention(mscale_all_dim)
    angles = torch.outer(torch.arange(rows, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scale, angles.sin() * scale


def test_tables_hold_yarn_values():
    rope = GraphSafeYarnRotaryEmbedding(64, **YARN)
    cos, sin = rope.get_cached_cos_sin(300, dtype=torch.float32, packed_seq=True)
    ref_cos, ref_sin = _reference_yarn(64, 300, **YARN)
    assert cos.shape == (300, 1, 1, 64) and cos.is_contiguous() and sin.is_contiguous()
    torch.testing.assert_close(cos[:, 0, 0], ref_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0, 0], ref_sin, rtol=1e-5, atol=1e-5)


@pytest.fixture
def upstream_on_the_host(monkeypatch):
    """megatron-core's YarnRotaryEmbedding building on the CPU: it puts its frequencies and
    tables on ``torch.cuda.current_device()``."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


MOONLIGHT_ROPE = dict(rotary_base=50000)  # no yarn scaling: concentration factor 1


@pytest.mark.parametrize("settings", [YARN, MOONLIGHT_ROPE], ids=["yarn", "moonlight"])
@pytest.mark.parametrize("on_host", [False, True], ids=["device-init", "cpu-init"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tables_are_upstreams_bit_for_bit(upstream_on_the_host, settings, on_host, dtype):
    """Same constructor arguments, same device: the same cos and sin bits (dtype, shape,
    concentration factor, channel order); tests/gpu/test_mla_graphs.py checks it on CUDA."""
    upstream = YarnRotaryEmbedding(64, use_cpu_initialization=on_host, **settings)
    ours = GraphSafeYarnRotaryEmbedding(64, use_cpu_initialization=on_host, **settings)
    want = upstream.get_cached_cos_sin(3000, dtype=dtype, packed_seq=True)
    got = ours.get_cached_cos_sin(3000, dtype=dtype, packed_seq=True)
    for w, g in zip(want, got):
        assert g.shape == w.shape == (3000, 1, 1, 64) and g.dtype == w.dtype == dtype
        assert g.is_contiguous() and torch.equal(g, w)


class _OpDevices(TorchDispatchMode):
    """Records (op, output device) of every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.seen.append((func.overloadpacket, out.device))
        return out


@pytest.mark.parametrize("on_host", [False, True])
def test_frequencies_are_computed_on_the_device_upstream_computes_them_on(on_host):
    """megatron-core's MLA builds its yarn RoPE with ``use_cpu_initialization=False``: the
    frequencies' fp32 power runs on the GPU, whose rounding differs from the CPU's (a unit in
    the last place of one frequency moves cos by 2e-4 at position 3000). So a table on
    another device ('meta' stands for the GPU here) computes its power there, and copies the
    host frequencies only under ``use_cpu_initialization=True``."""
    rope = GraphSafeYarnRotaryEmbedding(32, use_cpu_initialization=on_host,
                                        **{**YARN, "rotary_base": 34567})
    assert rope.inv_freq_extra.device.type == "cpu"  # building touches no GPU either way
    with _OpDevices() as ops:
        rope.get_cached_cos_sin(16, dtype=torch.float32, packed_seq=True,
                                device=torch.device("meta"))
    powers = {device.type for op, device in ops.seen if op is torch.ops.aten.pow}
    assert powers == (set() if on_host else {"meta"})
    assert all(device.type == "meta" for _, device in ops.seen if not on_host)


def test_the_constructor_takes_upstreams_arguments_positionally_too():
    rope = GraphSafeYarnRotaryEmbedding(32, 1.0, False, None, 10000.0, True, 40.0)
    assert rope.frequencies_on_host and rope.scaling_factor == 40.0
    assert not GraphSafeYarnRotaryEmbedding(32, rotary_base=10000.0).frequencies_on_host


def test_scaling_factor_one_is_plain_rope():
    rope = GraphSafeYarnRotaryEmbedding(16, rotary_base=50000, scaling_factor=1.0)
    cos, _ = rope.get_cached_cos_sin(10, dtype=torch.float32, packed_seq=True)
    inv_freq = 1.0 / 50000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    torch.testing.assert_close(cos[:, 0, 0, :8], torch.outer(torch.arange(10.0), inv_freq).cos())


def test_a_table_is_never_replaced_under_a_reader():
    """The hazard of upstream's cache: a longer or differently typed request must leave the
    tensors handed out earlier alive and unchanged (a captured graph reads them)."""
    rope = GraphSafeYarnRotaryEmbedding(32, **{**YARN, "rotary_base": 12345})  # tables of its own
    first_cos, first_sin = rope.get_cached_cos_sin(100, dtype=torch.bfloat16, packed_seq=True)
    kept = first_cos.clone(), first_sin.clone()
    again, _ = rope.get_cached_cos_sin(64, dtype=torch.bfloat16, packed_seq=True)
    assert again.data_ptr() == first_cos.data_ptr()  # same storage, no rebuild
    longer, _ = rope.get_cached_cos_sin(5000, dtype=torch.bfloat16, packed_seq=True)
    rope.get_cached_cos_sin(100, dtype=torch.float32, packed_seq=False)
    assert longer.data_ptr() != first_cos.data_ptr()
    assert any(cos.data_ptr() == first_cos.data_ptr() for cos, _ in retired_tables())
    assert torch.equal(first_cos, kept[0]) and torch.equal(first_sin, kept[1])
    assert torch.equal(longer[:100], first_cos)  # a row's value does not depend on the length
    assert rope.table_rows(torch.bfloat16) == 8192 and rope.table_rows(torch.float32) == 128


def test_layers_with_the_same_settings_share_tables():
    settings = {**YARN, "rotary_base": 23456}
    one = GraphSafeYarnRotaryEmbedding(32, **settings)
    two = GraphSafeYarnRotaryEmbedding(32, **settings)
    other = GraphSafeYarnRotaryEmbedding(32, **{**settings, "scaling_factor": 4.0})
    cos = one.get_cached_cos_sin(50, dtype=torch.float32, packed_seq=True)[0]
    assert two.get_cached_cos_sin(50, dtype=torch.float32, packed_seq=True)[0].data_ptr() == \
        cos.data_ptr()
    assert not torch.equal(other.get_cached_cos_sin(50, dtype=torch.float32, packed_seq=True)[0],
                           cos)


def test_tables_survive_casting_the_module():
    rope = GraphSafeYarnRotaryEmbedding(32, **YARN)
    cos, _ = rope.get_cached_cos_sin(16, dtype=torch.float32, packed_seq=True)
    rope.to(torch.bfloat16)  # what Float16Module does to the model
    assert rope.get_cached_cos_sin(16, dtype=torch.float32, packed_seq=True)[0].data_ptr() == \
        cos.data_ptr()


def test_offsets_are_refused():
    rope = GraphSafeYarnRotaryEmbedding(32, **YARN)
    with pytest.raises(ValueError, match="MLA RoPE offset is wrong: 3"):
        rope.get_cached_cos_sin(16, offset=3, packed_seq=True)


class _TwoRankGroup:
    """Stands in for a CP process group of two ranks (only its size is read)."""

    def size(self):
        return 2


def test_unpacked_data_under_cp_is_refused():
    rope = GraphSafeYarnRotaryEmbedding(32, cp_group=_TwoRankGroup(), **YARN)
    with pytest.raises(ValueError, match="unpacked data with context parallelism"):
        rope.get_cached_cos_sin(16, packed_seq=False)
    assert rope.get_cached_cos_sin(16, packed_seq=True)[0].shape[0] == 16


# ------------------------------------------------------------------ the params RoPE reads

def test_rope_params_cover_the_stream_and_leave_attention_alone():
    bounds = pad_cu_seqlens(cu(0, 3, 5), 4)
    params = build_packed_batch_params(bounds, torch.arange(8), max_seqlen=5,
                                       with_seq_idx=False)
    params.local_cp_size = 1
    rope = rope_params(params, rows=8, cp_size=1)
    assert rope.cu_seqlens_q_padded.tolist() == [0, 3, 5, 5, 5, 8]
    assert rope.cu_seqlens_kv_padded is rope.cu_seqlens_q_padded
    assert (rope.max_seqlen_q, rope.max_seqlen_kv, rope.local_cp_size) == (8, 8, None)
    # The micro-batch's own params (what attention reads) are untouched.
    assert params.cu_seqlens_q_padded is None and params.local_cp_size == 1
    assert params.max_seqlen_q == 5 and rope.cu_seqlens_q is params.cu_seqlens_q


def test_rope_params_prefer_the_cp_padded_boundaries():
    bounds = cu(0, 8, 12, 12)
    params = build_packed_batch_params(cu(0, 5, 9, 9), torch.arange(6), max_seqlen=12,
                                       with_seq_idx=False)
    params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = bounds
    rope = rope_params(params, rows=6, cp_size=2)
    assert rope.cu_seqlens_q_padded.tolist() == [0, 8, 12, 12, 12]
    assert rope.max_seqlen_q == 12


def test_rope_params_pass_unpacked_params_through():
    assert rope_params(None, rows=8, cp_size=1) is None


# ------------------------------------------- what the subclasses rely on in megatron-core 0.19.2

def test_upstream_mla_rope_reads_what_rope_params_set(cpu_dist, monkeypatch):
    """`PackedMLASelfAttention` steers upstream's RoPE through the params it hands to
    ``get_query_key_value_tensors``: upstream's fused RoPE kernels (spied on here) get the
    padded boundaries, the cos/sin of ``get_cached_cos_sin`` at the ``max_seqlen`` pair (the
    table length) and the CP group's rank and size; ``local_cp_size``, which upstream refuses,
    is stripped. If upstream reads anything else, this fails and the subclass needs another
    look. The attention is tests/unit/test_mla_v_padding.py's, built on CPU."""
    import copy
    from types import SimpleNamespace

    from megatron.core.transformer import multi_latent_attention as upstream

    from megatron.packed_model import attention as packed_attention
    from megatron.packed_training import extra_args
    from tests.unit.test_mla_v_padding import _attention, _config

    monkeypatch.setattr(extra_args, "is_importable",
                        lambda package: package in ("transformer_engine", "triton"))
    monkeypatch.setattr(packed_attention, "is_te_available", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    attention = _attention(_config("--no-gradient-accumulation-fusion"), monkeypatch)
    assert attention.config.apply_rope_fusion
    reads, tables = [], []

    def fused_q(q, cos, sin, qk_dim, rope_dim, cu_seqlens, cp_rank, cp_size):
        reads.append(("q", cos, sin, cu_seqlens, cp_rank, cp_size))
        return q

    def fused_kv(kv, k_pos, cos, sin, rope_dim, qk_dim, v_dim, cu_seqlens, cp_rank, cp_size):
        reads.append(("kv", cos, sin, cu_seqlens, cp_rank, cp_size))
        return kv, kv

    monkeypatch.setattr(upstream, "fused_apply_mla_rope_for_q", fused_q)
    monkeypatch.setattr(upstream, "fused_apply_mla_rope_for_kv", fused_kv)
    table = attention.rotary_pos_emb.get_cached_cos_sin

    def cached_cos_sin(seq_len, **kwargs):
        tables.append((seq_len, table(seq_len, **kwargs)))
        return tables[-1][1]

    monkeypatch.setattr(attention.rotary_pos_emb, "get_cached_cos_sin", cached_cos_sin)
    monkeypatch.setattr(attention, "pg_collection", copy.copy(attention.pg_collection))
    attention.pg_collection.cp = SimpleNamespace(rank=lambda: 1, size=lambda: 2)  # of two
    rows = 40
    params = build_packed_batch_params(torch.tensor([0, 12, 30], dtype=torch.int32),
                                       torch.cat([torch.arange(12), torch.arange(18)]), rows,
                                       with_seq_idx=False)
    params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = cu(0, 16, 32)
    params.local_cp_size = 1
    hidden = torch.randn(rows, 1, attention.config.hidden_size)
    with pytest.raises(AssertionError, match="hybrid_context_parallel"):
        upstream.MLASelfAttention.get_query_key_value_tensors(attention, hidden,
                                                              packed_seq_params=params)
    attention.get_query_key_value_tensors(hidden, packed_seq_params=params)
    (length, (cos, sin)), = tables
    assert length == 2 * rows  # the whole stream: rows x CP size
    covered = rope_params(params, rows, 2).cu_seqlens_q_padded
    assert covered.tolist() == [0, 16, 32, 80]
    assert [read[0] for read in reads] == ["q", "kv"]
    for _, read_cos, read_sin, cu_seqlens, cp_rank, cp_size in reads:
        assert read_cos is cos and read_sin is sin and torch.equal(cu_seqlens, covered)
        assert (cp_rank, cp_size) == (1, 2)


def test_upstream_cos_sin_cache_is_still_re_registered(upstream_on_the_host):
    """The hazard `GraphSafeYarnRotaryEmbedding` exists for: upstream replaces its cos/sin
    buffers (new tensors: a captured graph would read the old ones) when the length grows or
    the dtype or packing mode changes."""
    upstream = YarnRotaryEmbedding(64, use_cpu_initialization=True, **YARN)
    upstream.get_cached_cos_sin(100, dtype=torch.float32, packed_seq=True)
    kept = (upstream.cos_cached, upstream.sin_cached)
    upstream.get_cached_cos_sin(50, dtype=torch.float32, packed_seq=True)
    assert upstream.cos_cached is kept[0] and upstream.sin_cached is kept[1]  # shorter: kept
    for seq_len, dtype, packed_seq in ((200, torch.float32, True), (200, torch.bfloat16, True),
                                       (200, torch.bfloat16, False)):
        upstream.get_cached_cos_sin(seq_len, dtype=dtype, packed_seq=packed_seq)
        now = (upstream.cos_cached, upstream.sin_cached)
        assert now[0] is not kept[0] and now[1] is not kept[1], (seq_len, dtype, packed_seq)
        assert dict(upstream.named_buffers())["cos_cached"] is now[0]  # a registered buffer
        kept = now
