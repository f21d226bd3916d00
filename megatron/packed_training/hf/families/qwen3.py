"""Qwen3 dense (``model_type`` qwen3): Llama's layout plus an RMSNorm on each query and key
head before RoPE (``q_norm`` / ``k_norm`` -> Megatron's --qk-layernorm), GQA with a head
size of its own (--kv-channels), tied embeddings in the small models.

Mapping: Llama's (families/llama.py) plus

    layers.N.self_attn.q_norm               decoder.layers.self_attention.q_layernorm
    layers.N.self_attn.k_norm               decoder.layers.self_attention.k_layernorm
"""

from megatron.packed_training.hf.config import HFConfig
from megatron.packed_training.hf.families import gpt
from megatron.packed_training.hf.mapping import Converted, ModelMapping

MODEL_TYPES = ("qwen3",)


def describe(config: HFConfig) -> Converted:
    gpt.check_plain_transformer(config)
    gpt.no_rope_scaling(config)
    dims = gpt.attention_dims(config)
    flags = gpt.gpt_flags(config, dims, config.require("intermediate_size"), qk_layernorm=True)
    layers = config.require("num_hidden_layers")
    kind = gpt.attention_kind(qk_layernorm=True) + gpt.swiglu_mlp_kind()
    mapping = ModelMapping(dims=dims, model_rules=gpt.model_rules(config.tied_embeddings()),
                           layers=[kind] * layers, stacked=True,
                           ignored=gpt.ignored(config.tied_embeddings()))
    return Converted("qwen3", "pretrain_gpt.py", flags, mapping)
