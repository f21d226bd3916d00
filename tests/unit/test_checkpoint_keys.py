"""TE-free checkpoints use Transformer Engine's (and Megatron-LM's) tensor names.

TE fuses each norm into the linear after it and saves its weight as that linear's
``layer_norm_weight``; the TE-free spec keeps separate norms and maps their keys
(providers.te_checkpoint_keys). Where TE's spec has a norm module of its own, the TE-free norm
saves the empty ``_extra_state`` TE's does (providers.TELayoutNorm): Megatron-LM's loader asks
for it. Checked on a real GPTModel's sharded state dict, on CPU; tests/gpu/test_te_path.py
compares the TE and TE-free models' keys whole."""

import torch
import torch.nn.functional as F

from megatron.packed_graphs.specs import gpt_layer_spec
from megatron.packed_model.providers import TE_FUSED_NORM_KEYS


def _keys(num_experts=None, qk_layernorm=False):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_dropout_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, num_moe_experts=num_experts, qk_layernorm=qk_layernorm,
        moe_router_topk=2 if num_experts else 2, moe_token_dispatcher_type="alltoall")
    torch.manual_seed(0)
    model = GPTModel(config, gpt_layer_spec("torch", num_experts=num_experts,
                                                 qk_layernorm=qk_layernorm), vocab_size=128,
                     max_sequence_length=64, position_embedding_type="rope")
    # The checkpoint's names are the sharded tensors' keys (the dict keys stay module paths).
    return {value.key for value in model.sharded_state_dict().values() if hasattr(value, "key")}


def test_dense_layers_save_their_norms_under_te_names(cpu_dist):
    keys = _keys()  # the layers are one stacked tensor per name (the layer is an axis)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys
    assert not {"decoder.layers.input_layernorm.weight",
                "decoder.layers.pre_mlp_layernorm.weight"} & keys
    assert "decoder.final_layernorm.weight" in keys
    # fused norms save nothing of their own: their linear's _extra_state is TE's
    assert not [key for key in keys if "layernorm" in key and key.endswith("_extra_state")]


def test_moe_layers_keep_their_pre_mlp_norm_as_te_does(cpu_moe):
    keys = _keys(num_experts=4)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.pre_mlp_layernorm.weight" in keys
    assert "decoder.layers.pre_mlp_layernorm._extra_state" in keys


def test_qk_norms_save_the_extra_state_te_norms_have(cpu_dist):
    keys = _keys(qk_layernorm=True)
    assert {"decoder.layers.self_attention.q_layernorm._extra_state",
            "decoder.layers.self_attention.k_layernorm._extra_state"} <= keys
    assert "decoder.layers.self_attention.linear_qkv.layer_norm__extra_state" not in keys


def test_a_te_layout_norm_is_megatron_cores_torch_norm(cpu_dist):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.packed_model.providers import TELayoutNorm

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               normalization="RMSNorm")
    norm = TELayoutNorm(config=config, hidden_size=8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    x = torch.randn(3, 8)
    assert torch.equal(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-6))
    assert "_extra_state" in norm.state_dict() and norm.state_dict()["_extra_state"] is None


def test_the_te_spec_fuses_and_needs_no_map():
    from megatron.packed_model.providers import te_checkpoint_keys

    class Fusing:
        def fuse_layernorm_and_linear(self):
            return True

    assert te_checkpoint_keys(Fusing(), *TE_FUSED_NORM_KEYS) == {}
