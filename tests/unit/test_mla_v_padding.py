"""V padding of packed MLA (``--mla-pad-v``, ``PackedMLASelfAttention.pad_value``) on CPU.

`PackedMLASelfAttention` is built from the config the flags give, over megatron-core's local
linears and, as its core attention, exact causal attention per document (SDPA: it takes a
value head size other than the query's, as TE's cuDNN attention does on THD). TE's own
attention is GPU-tested (tests/gpu/test_mla_graphs.py, V padded or not).
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from megatron.packed_model.mla import PackedMLASelfAttention, mla_self_attention_spec
from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_training import extra_args
from megatron.packed_training.arguments import parse_args
from megatron.packed_training.config import PackedMLATransformerConfig, transformer_config_from_args
from megatron.packed_upstream import model_layers

HEADS, QK, ROPE, V = 4, 16, 8, 16  # query head 24, value head 16: upstream pads V to 24


class _Provider(LocalSpecProvider):
    def linear(self):
        return ColumnParallelLinear


class DocumentAttention(torch.nn.Module):
    """Causal attention inside each packed document, any value head size; records the value
    head size of every call. ``[T, H, Dqk]``, ``[T, H, Dqk]``, ``[T, H, Dv]`` -> ``[T, H * Dv]``."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.hidden_size_per_attention_head_v = v_channels  # upstream widens it while padding
        self.value_widths = []

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                packed_seq_params=None, **kwargs):
        self.value_widths.append(value.shape[-1])
        out = query.new_zeros(*query.shape[:2], value.shape[-1])
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
                out[start:end] = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale).transpose(0, 1)
        return out.reshape(out.shape[0], -1)


def _config(*extra):
    """The MLA config the command line gives (TE and triton counted as importable)."""
    argv = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", str(HEADS),
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--attention-backend", "auto",
            "--multi-latent-attention", "--kv-lora-rank", "32", "--qk-head-dim", str(QK),
            "--qk-pos-emb-head-dim", str(ROPE), "--v-head-dim", str(V), *extra]
    return transformer_config_from_args(parse_args(argv))


@pytest.fixture
def te_importable(monkeypatch):
    from megatron.packed_model import attention

    monkeypatch.setattr(extra_args, "is_importable",
                        lambda package: package in ("transformer_engine", "triton"))
    monkeypatch.setattr(attention, "is_te_available", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _attention(config, monkeypatch):
    # megatron-core's MLA builds its yarn table on the current CUDA device; here on the host.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config.use_cpu_initialization = True
    model_layers.megatron_core_linears_unfused_without_apex()  # as the fork's model builders
    spec = mla_self_attention_spec(_Provider())
    submodules = dataclasses.replace(spec.submodules, core_attention=DocumentAttention,
                                     linear_q_up_proj=ColumnParallelLinear,
                                     linear_kv_up_proj=ColumnParallelLinear)
    return PackedMLASelfAttention(config, submodules, layer_number=1, **spec.params)


@pytest.mark.parametrize("flag,pad", [((), True), (("--mla-pad-v", "always"), True),
                                      (("--mla-pad-v", "never"), False)])
def test_the_flag_reaches_the_config(te_importable, flag, pad):
    assert _config(*flag).mla_pad_v is pad


@pytest.mark.parametrize("pad", [True, False])
def test_the_attention_takes_its_padding_from_the_config(te_importable, cpu_dist, monkeypatch,
                                                         pad):
    config = _config("--mla-pad-v", "always" if pad else "never")
    assert _attention(config, monkeypatch).pad_value is pad


def test_unpadded_v_attends_like_padded_v(te_importable, cpu_dist, monkeypatch):
    """The same packed query, key and value through both settings: the core attention sees V
    at the query head size (padded) or its own (not), the layer's output is the same, and the
    core attention's value head size is restored after a padded call."""
    attention = _attention(_config(), monkeypatch)
    core = attention.core_attention
    rows = 40
    torch.manual_seed(0)
    query, key = torch.randn(rows, HEADS, QK + ROPE), torch.randn(rows, HEADS, QK + ROPE)
    value = torch.randn(rows, HEADS, V)
    cu = torch.tensor([0, 12, 30, 40], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in (12, 18, 10)])
    params = build_packed_batch_params(cu, positions, rows, with_seq_idx=False)

    outputs = {}
    for pad in (True, False):
        attention.pad_value = pad
        out = attention._run_core_attention(query, key, value, None, packed_seq_params=params)
        outputs[pad] = out.reshape(rows, -1)
    assert core.value_widths == [QK + ROPE, V]
    assert core.hidden_size_per_attention_head_v == V
    assert outputs[False].shape == (rows, HEADS * V)
    torch.testing.assert_close(outputs[True], outputs[False])


def test_the_mla_config_is_the_forks_class_with_its_fields(te_importable):
    config = _config("--mla-pad-v", "never")
    assert isinstance(config, PackedMLATransformerConfig)
    assert dataclasses.replace(config).mla_pad_v is False
