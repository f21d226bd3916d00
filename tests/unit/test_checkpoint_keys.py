"""TE-free checkpoints use Transformer Engine's (and Megatron-LM's) tensor names.

TE fuses each norm into the linear after it and saves its weight as that linear's
``layer_norm_weight``; the TE-free spec keeps separate norms and maps their keys
(specs.te_checkpoint_keys). Checked on a real GPTModel's sharded state dict, on CPU."""

import pytest
import torch
import torch.nn.functional as F

from megatron.packed_graphs.specs import TE_FUSED_NORM_KEYS, gpt_layer_spec


def _keys(num_experts=None):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_dropout_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, num_moe_experts=num_experts,
        moe_router_topk=2 if num_experts else 2, moe_token_dispatcher_type="alltoall")
    torch.manual_seed(0)
    model = GPTModel(config, gpt_layer_spec("torch", num_experts=num_experts), vocab_size=128,
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


def test_moe_layers_keep_their_pre_mlp_norm_as_te_does(cpu_moe):
    keys = _keys(num_experts=4)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.pre_mlp_layernorm.weight" in keys


def test_the_te_spec_fuses_and_needs_no_map():
    from megatron.packed_graphs.specs import te_checkpoint_keys

    class Fusing:
        def fuse_layernorm_and_linear(self):
            return True

    assert te_checkpoint_keys(Fusing(), *TE_FUSED_NORM_KEYS) == {}
