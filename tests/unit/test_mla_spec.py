"""MLA layer specs (packed_graphs/mla.py, specs.py) on CPU.

Transformer Engine is absent here, so the TE provider itself is GPU-tested
(tests/gpu/test_mla_graphs.py); the wiring is checked over megatron-core's LocalSpecProvider.
"""

import pytest

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron.packed_graphs.layers import GraphSafeTransformerLayer
from megatron.packed_graphs.mla import (
    PackedMLASelfAttention,
    mla_attention_submodules,
    mla_self_attention_spec,
)
from megatron.packed_graphs.specs import gpt_layer_spec, hybrid_stack_spec


class _Provider(LocalSpecProvider):
    """megatron-core's local provider plus the plain ``linear`` TE's provider has (MLA's down
    projections take a column-parallel linear as well)."""

    def linear(self):
        return ColumnParallelLinear


def test_mla_spec_wires_the_provider_modules():
    provider = _Provider()
    spec = mla_self_attention_spec(provider)
    assert spec.module is PackedMLASelfAttention
    # V padding is the config's (mla_pad_v), not a second switch in the spec.
    assert spec.params == {"attn_mask_type": AttnMaskType.causal}
    sub = spec.submodules
    assert sub.linear_q_down_proj is provider.linear()
    assert sub.linear_kv_down_proj is provider.linear()
    assert sub.linear_q_proj is provider.column_parallel_linear()
    assert sub.core_attention is provider.core_attention()
    assert sub.linear_proj is provider.row_parallel_linear()
    # Up projections and latent norms are megatron-core's resolver's choice (qk_layernorm).
    assert sub.linear_q_up_proj is None and sub.linear_kv_up_proj is None
    assert sub.q_layernorm is IdentityOp and sub.kv_layernorm is IdentityOp


def test_mla_attention_half_keeps_its_input_norm():
    sub = mla_attention_submodules(_Provider(), "RMSNorm")
    assert sub.input_layernorm is not IdentityOp
    assert sub.self_attention.module is PackedMLASelfAttention


@pytest.mark.parametrize("backend", ["torch", "flash"])
def test_gpt_mla_spec_refuses_te_free_backends(backend):
    with pytest.raises(ValueError, match=f"--attention-backend is wrong: the TE-free {backend} attention.*only on "
                                         "Transformer Engine attention"):
        gpt_layer_spec(backend, multi_latent_attention=True)


def test_hybrid_mla_spec_refuses_te_free_backends():
    with pytest.raises(ValueError, match="--attention-backend is wrong: the TE-free torch attention"):
        hybrid_stack_spec("torch", multi_latent_attention=True)


def test_dense_specs_are_unchanged_by_default():
    spec = gpt_layer_spec("torch")
    assert spec.module is GraphSafeTransformerLayer
    assert spec.submodules.self_attention.module is not PackedMLASelfAttention


def test_unfused_rope_is_refused_at_build():
    config = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                  apply_rope_fusion=False)
    with pytest.raises(ValueError, match="MLA RoPE is wrong.*apply_rope_fusion False"):
        PackedMLASelfAttention(config, mla_self_attention_spec(_Provider()).submodules,
                               layer_number=1)
