"""MLA layer specs (packed_model/mla.py, packed_graphs/specs.py) on CPU.

Transformer Engine is absent here, so the TE provider itself is GPU-tested
(tests/gpu/test_mla_graphs.py); the wiring is checked over megatron-core's LocalSpecProvider.
"""

import pytest
import torch

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron.packed_graphs.layers import GraphSafeTransformerLayer
from megatron.packed_model.mla import (
    PackedMLASelfAttention,
    mla_attention_submodules,
    mla_self_attention_spec,
    query_norm_fused,
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


# ------------------------------------------------------------- no q-LoRA: no query norm

def _no_q_lora_config(**overrides):
    return MLATransformerConfig(**{
        "num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "q_lora_rank": None,
        "kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16,
        "qk_layernorm": True, "normalization": "RMSNorm", "rope_type": "yarn",
        "apply_rope_fusion": True, "use_cpu_initialization": True, **overrides})


def _resolved(cls, config, submodules) -> dict:
    """``cls``'s Q/KV norm resolution for ``config`` and ``submodules``, without building the
    projections (Transformer Engine's modules cannot be built here)."""
    attention = cls.__new__(cls)
    torch.nn.Module.__init__(attention)
    attention.config = config
    return attention._resolve_qk_norm_config(submodules)


def test_without_q_lora_the_te_spec_resolves_a_plain_query_projection():
    """The fork's TE spec: without q-LoRA, linear_q_proj is TE's plain column-parallel linear
    while the key/value latent norm stays fused into linear_kv_up_proj. megatron-core 0.19.2's
    own MLASelfAttention fuses a query norm into linear_q_proj: when this fails, upstream
    changed and `DeepSeekMLASelfAttention` may be dropped."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TELayerNormColumnParallelLinear,
    )
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    config = _no_q_lora_config()
    submodules = mla_self_attention_spec(TESpecProvider()).submodules
    ours = _resolved(PackedMLASelfAttention, config, submodules)
    assert ours["linear_q_proj"] is TEColumnParallelLinear
    assert ours["linear_kv_up_proj"] is TELayerNormColumnParallelLinear
    assert ours["q_layernorm"] is IdentityOp and ours["kv_layernorm"] is IdentityOp

    upstream = _resolved(MLASelfAttention, config, submodules)
    assert upstream["linear_q_proj"] is TELayerNormColumnParallelLinear
    assert query_norm_fused(config, submodules, upstream)
    # with q-LoRA both resolve alike (the q latent norm fused into linear_q_up_proj)
    lora = _no_q_lora_config(q_lora_rank=32)
    assert (_resolved(PackedMLASelfAttention, lora, submodules)
            == _resolved(MLASelfAttention, lora, submodules))


def test_without_q_lora_packed_mla_builds_a_plain_query_projection(cpu_dist, monkeypatch):
    """Built on CPU (local linears, the latent norm a module of its own as in the CPU
    converter tests): the query projection is the spec's plain linear, its only weight the
    projection's."""
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from tests.unit.hf_tiny import _mla_core_attention

    # megatron-core's yarn RoPE asks for torch.cuda.current_device() at build
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config = _no_q_lora_config(attention_dropout=0.0)
    provider = _Provider()
    submodules = MLASelfAttentionSubmodules(
        linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
        linear_kv_down_proj=ColumnParallelLinear, linear_kv_up_proj=ColumnParallelLinear,
        core_attention=ModuleSpec(module=_mla_core_attention(), params={"backend": "torch"}),
        linear_proj=provider.row_parallel_linear(),
        q_layernorm=IdentityOp, kv_layernorm=WrappedTorchNorm)
    attention = PackedMLASelfAttention(config, submodules, layer_number=1,
                                       attn_mask_type=AttnMaskType.causal)
    assert type(attention.linear_q_proj) is ColumnParallelLinear
    assert [name for name, _ in attention.linear_q_proj.named_parameters()] == ["weight"]
    assert attention.linear_q_proj.weight.shape == (4 * (16 + 8), 64)
    assert not hasattr(attention, "q_layernorm") and not hasattr(attention, "linear_q_up_proj")
    assert isinstance(attention.kv_layernorm, torch.nn.Module)
    # fp8 with the input norm recomputed: the query projection reads the norm's output too
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    monkeypatch.setattr(multi_latent_attention, "set_save_original_input",  # None without TE
                        transformer_engine.set_save_original_input)
    for linear in (attention.linear_q_proj, attention.linear_kv_down_proj):
        linear.save_original_input = False  # the attribute TE's linears have
    attention.set_for_recompute_input_layernorm()
    assert attention.linear_q_proj.save_original_input
    assert attention.linear_kv_down_proj.save_original_input
    # megatron-core's resolver asks for its fused norm + linear here instead
    fused = QKNormConfigResolver(config, submodules).resolve()["linear_q_proj"]
    assert fused is not ColumnParallelLinear and query_norm_fused(config, submodules,
                                                                  {"linear_q_proj": fused})
