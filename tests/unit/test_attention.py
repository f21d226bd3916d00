"""TE-free attention: backend selection, specs, the reference kernel, sync-free RoPE, a CPU GPT."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.packed_model import attention
from megatron.packed_model.attention import (
    PackedSelfAttention,
    VarlenAttention,
    apply_rotary_per_token,
    reference_varlen_attention,
    resolve_attention_backend,
)
from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_graphs.specs import gpt_layer_spec
from megatron.packed_model.providers import VarlenSpecProvider, backend_provider


def _installed(monkeypatch, te=False, flash=False):
    monkeypatch.setattr(attention, "is_te_available", lambda: te)
    monkeypatch.setattr(attention, "is_flash_attn_available", lambda: flash)


@pytest.mark.parametrize("te,flash,expected", [(False, False, "torch"), (False, True, "flash"),
                                               (True, True, "te"), (True, False, "te")])
def test_auto_prefers_te_then_flash_then_torch(monkeypatch, te, flash, expected):
    _installed(monkeypatch, te, flash)
    assert resolve_attention_backend("auto") == expected


def test_explicit_backend_without_its_package_is_an_error(monkeypatch):
    _installed(monkeypatch)
    with pytest.raises(ValueError, match=r"needs Transformer Engine.*pip install \.\[te\]"):
        resolve_attention_backend("te")
    with pytest.raises(ValueError, match=r"varlen attention needs flash-attn"):
        resolve_attention_backend("flash")
    with pytest.raises(ValueError, match="--attention-backend is wrong: 'sdpa'"):
        resolve_attention_backend("sdpa")
    assert resolve_attention_backend("torch") == "torch"


def test_te_free_gpt_spec_uses_varlen_attention_and_separate_norms():
    spec = gpt_layer_spec("flash")
    attn = spec.submodules.self_attention
    assert attn.module is PackedSelfAttention
    assert attn.submodules.core_attention.module is VarlenAttention
    assert attn.submodules.core_attention.params == {"backend": "flash"}
    # No fused norm+linear without TE: the norms are separate modules in front.
    assert spec.submodules.input_layernorm.__name__ != "IdentityOp"
    assert spec.submodules.pre_mlp_layernorm.__name__ != "IdentityOp"
    assert isinstance(backend_provider("torch"), VarlenSpecProvider)


def _dense_causal_block_attention(q, k, v, cu, scale):
    """Block-diagonal causal mask over the whole packed sequence, for comparison."""
    t = q.shape[0]
    doc = torch.zeros(t, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        doc[s:e] = i
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_reference_varlen_attention_matches_block_causal_mask():
    torch.manual_seed(0)
    cu = torch.tensor([0, 4, 4, 11, 16], dtype=torch.int32)
    q, k, v = torch.randn(16, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    out = reference_varlen_attention(q, k, v, cu, scale=1 / math.sqrt(8))
    torch.testing.assert_close(out, _dense_causal_block_attention(q, k, v, cu, 1 / math.sqrt(8)))


def test_per_token_rope_equals_megatron_thd_rope(cpu_dist):
    """Our gather-at-position RoPE == megatron-core's (host-syncing) unfused THD RoPE."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    t = torch.randn(sum(lengths), 4, 16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    angles = torch.outer(torch.arange(max(lengths)).float(), inv_freq)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [max_s, 1, 1, d]
    positions = torch.cat([torch.arange(n) for n in lengths])
    ours = apply_rotary_per_token(t.unsqueeze(1), freqs[positions]).squeeze(1)
    upstream = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=torch.distributed.group.WORLD)
    torch.testing.assert_close(ours, upstream)


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_per_token_rope_on_a_cp_rank_equals_megatron_thd_rope_with_cp(cpu_dist, cp_rank):
    """Under CP each rank keeps its tokens' document-local positions (``position_ids`` are
    split like the tokens), so the gathered RoPE needs no CP size or rank: it rotates a
    rank's tokens as megatron-core's THD RoPE does given the CP size and rank (the rule TE's
    fused THD kernel follows too)."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
    from megatron.packed_model.context_parallel import thd_partition_index

    torch.manual_seed(0)
    cp, lengths = 2, [8, 4, 12, 0]  # segments padded to multiples of 2 * cp; a capacity slot
    total = sum(lengths)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    t = torch.randn(total, 4, 16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    # Longer than the stream: upstream then maps each document from position 0.
    angles = torch.outer(torch.arange(total + 8).float(), inv_freq)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    index = thd_partition_index(cu, total, cp, cp_rank)
    local = t[index]
    ours = apply_rotary_per_token(local.unsqueeze(1), freqs[positions[index]]).squeeze(1)
    group = SimpleNamespace(size=lambda: cp, rank=lambda: cp_rank)
    upstream = _apply_rotary_pos_emb_thd(local, cu, freqs, cp_group=group)
    torch.testing.assert_close(ours, upstream)


def test_packed_self_attention_rotates_queries_and_keys_with_its_rotate_hook(cpu_dist):
    """Subclasses choose the rotation kernel (the TE spec's is TE's fused one): `rotate`
    gets the queries and keys with the gathered per-token table."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        use_cpu_initialization=True, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0)
    spec = gpt_layer_spec("torch").submodules.self_attention
    calls = []

    class Spy(PackedSelfAttention):
        def rotate(self, t, freqs):
            calls.append((tuple(t.shape), tuple(freqs.shape)))
            return super().rotate(t, freqs)

    spec = dataclasses.replace(spec, module=Spy)  # the layer specs are shared: no mutation
    attn = build_module(spec, config=config, layer_number=1)
    lengths = [3, 5]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    params = build_packed_batch_params(cu, positions, max(lengths), with_seq_idx=False)
    freqs = torch.randn(8, 1, 1, config.kv_channels)
    attn(torch.randn(8, 1, config.hidden_size), None, rotary_pos_emb=freqs,
         packed_seq_params=params)
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    assert calls == [((8, 1, heads, dim), (8, 1, 1, dim)), ((8, 1, groups, dim), (8, 1, 1, dim))]


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_cpu_gpt_packed_forward_equals_documents_alone(cpu_dist, qk_layernorm):
    """A tiny GPTModel on CPU: packing 3 documents changes no document's logits, with and
    without a norm on each head's query and key (--qk-layernorm, per token)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_dropout_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=qk_layernorm)
    model = GPTModel(config, gpt_layer_spec("torch", qk_layernorm=qk_layernorm), vocab_size=128,
                     max_sequence_length=64, position_embedding_type="none")
    attention = model.decoder.layers[0].self_attention
    assert (attention.q_layernorm is not None) == qk_layernorm
    if qk_layernorm:  # one norm per head width, of the model's kind
        assert attention.q_layernorm.weight.shape == attention.k_layernorm.weight.shape == (16,)
        assert "RMSNorm" in type(attention.q_layernorm).__name__
    docs = [torch.randint(1, 128, (n,)) for n in (5, 9, 3)]

    def logits(parts):
        tokens = torch.cat(parts).view(1, -1)
        pos = torch.cat([torch.arange(len(p)) for p in parts]).view(1, -1)
        cu = torch.tensor([0] + [len(p) for p in parts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        params = build_packed_batch_params(cu, pos, max(len(p) for p in parts), with_seq_idx=False)
        return model(tokens, pos, None, packed_seq_params=params)

    packed = logits(docs)
    alone = torch.cat([logits([d]) for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    packed.float().sum().backward()
    assert model.embedding.word_embeddings.weight.grad.abs().sum() > 0
    if qk_layernorm:
        assert attention.q_layernorm.weight.grad.abs().sum() > 0


def test_varlen_attention_rejects_what_it_cannot_run(cpu_dist):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               attention_dropout=0.1, use_cpu_initialization=True)
    with pytest.raises(ValueError, match="--attention-dropout is wrong for the varlen backends: 0.1"):
        VarlenAttention(config, 1, AttnMaskType.causal, "self")
    config.attention_dropout = 0.0
    with pytest.raises(ValueError, match="causal masks only"):
        VarlenAttention(config, 1, AttnMaskType.no_mask, "self")
    core = VarlenAttention(config, 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="packed \\(THD\\) batches only"):
        core(torch.zeros(4, 4, 8), torch.zeros(4, 4, 8), torch.zeros(4, 4, 8), None)
