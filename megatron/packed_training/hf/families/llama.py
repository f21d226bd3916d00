"""Llama 3.x (``model_type`` llama): GQA attention, SwiGLU MLP, RMSNorm, RoPE with the
Llama 3 frequency scaling of Llama 3.1 / 3.2 / 3.3 (Megatron's --use-rope-scaling).

Mapping (Hugging Face -> megatron-core GPT, Transformer Engine names):

    model.embed_tokens                      embedding.word_embeddings (vocabulary padded)
    layers.N.input_layernorm                decoder.layers.self_attention.linear_qkv
                                            .layer_norm_weight
    layers.N.self_attn.{q,k,v}_proj         decoder.layers.self_attention.linear_qkv (fuse_qkv)
    layers.N.self_attn.o_proj               decoder.layers.self_attention.linear_proj
    layers.N.post_attention_layernorm       decoder.layers.mlp.linear_fc1.layer_norm_weight
    layers.N.mlp.{gate,up}_proj             decoder.layers.mlp.linear_fc1 (fuse_gate_up)
    layers.N.mlp.down_proj                  decoder.layers.mlp.linear_fc2
    model.norm                              decoder.final_layernorm
    lm_head                                 output_layer (untied models only)
"""

from megatron.packed_training.hf.config import HFConfig, refuse
from megatron.packed_training.hf.families import gpt
from megatron.packed_training.hf.mapping import Converted, ModelMapping

MODEL_TYPES = ("llama",)

# megatron-core's RotaryEmbedding applies Llama 3 scaling with these fixed (rope_utils:
# _apply_scaling); a checkpoint with other values would rotate differently.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def rope_scaling_flags(config: HFConfig) -> dict:
    """{} for plain RoPE; --use-rope-scaling for Llama 3 scaling with Megatron's constants."""
    scaling = config.rope_scaling()
    if scaling is None:
        return {}
    if scaling["rope_type"] != "llama3":
        refuse("rope_scaling.rope_type", scaling["rope_type"],
               "Llama converts plain RoPE or llama3 scaling (Megatron's --use-rope-scaling)")
    for name, value in LLAMA3_FIXED.items():
        if float(scaling.get(name, value)) != value:
            refuse(f"rope_scaling.{name}", scaling.get(name),
                   f"Megatron's --use-rope-scaling fixes it at {value:g}")
    return {"--use-rope-scaling": True, "--rope-scaling-factor": float(scaling["factor"])}


def describe(config: HFConfig) -> Converted:
    gpt.check_plain_transformer(config)
    dims = gpt.attention_dims(config)
    flags = gpt.gpt_flags(config, dims, config.require("intermediate_size"))
    flags.update(rope_scaling_flags(config))
    layers = config.require("num_hidden_layers")
    kind = gpt.attention_kind() + gpt.swiglu_mlp_kind()
    mapping = ModelMapping(dims=dims, model_rules=gpt.model_rules(config.tied_embeddings()),
                           layers=[kind] * layers, stacked=True,
                           ignored=gpt.ignored(config.tied_embeddings()))
    return Converted("llama", "pretrain_gpt.py", flags, mapping)
