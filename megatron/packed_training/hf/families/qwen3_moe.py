"""Qwen3-MoE (``model_type`` qwen3_moe): Qwen3's attention (q / k norms, GQA) with MoE MLPs:
a softmax router over ``num_experts`` (transformers 5: ``num_local_experts``) SwiGLU
experts, top-k; the top-k weights renormalised when ``norm_topk_prob`` (Megatron's default
top-k softmax) or not (--moe-router-pre-softmax). Layers listed in ``mlp_only_layers``, or
off the ``decoder_sparse_step`` grid, are dense (--moe-layer-freq).

Mapping: Qwen3's attention (families/qwen3.py) and, per MoE layer,

    layers.N.post_attention_layernorm       decoder.layers.pre_mlp_layernorm
    layers.N.mlp.gate                       decoder.layers.mlp.router
    layers.N.mlp.experts.E.{gate,up}_proj   decoder.layers.mlp.experts.experts.linear_fc1[E]
                                            (fuse_gate_up)
    layers.N.mlp.experts.E.down_proj        decoder.layers.mlp.experts.experts.linear_fc2[E]

(dense layers as Llama's MLP). The experts are per-expert tensors on disk in both layouts.
"""

from megatron.packed_training.hf.config import HFConfig, refuse
from megatron.packed_training.hf.families import gpt, moe
from megatron.packed_training.hf.mapping import Converted, ModelMapping

MODEL_TYPES = ("qwen3_moe",)


def is_moe_layer(config: HFConfig, layer: int, experts: int) -> bool:
    """transformers' Qwen3MoeDecoderLayer rule."""
    step = config.get("decoder_sparse_step", default=1)
    return (layer not in (config.get("mlp_only_layers", default=[]))
            and experts > 0 and (layer + 1) % step == 0)


def describe(config: HFConfig) -> Converted:
    gpt.check_plain_transformer(config)
    gpt.no_rope_scaling(config)
    if config.get("shared_expert_intermediate_size"):
        refuse("shared_expert_intermediate_size", config.get("shared_expert_intermediate_size"),
               "Qwen3-MoE has no shared experts; this config is not a Qwen3-MoE model")
    dims = gpt.attention_dims(config)
    experts = config.require("num_local_experts", "num_experts")
    layers = config.require("num_hidden_layers")
    pattern = [is_moe_layer(config, i, experts) for i in range(layers)]
    dense_ffn = config.get("intermediate_size") if not all(pattern) else None
    flags = gpt.gpt_flags(config, dims, dense_ffn, qk_layernorm=True)
    flags.update({
        "--num-experts": experts,
        "--moe-ffn-hidden-size": config.require("moe_intermediate_size"),
        "--moe-router-topk": config.require("num_experts_per_tok"),
        "--moe-router-score-function": "softmax",
        "--moe-router-pre-softmax": not config.get("norm_topk_prob", default=False),
        "--moe-router-load-balancing-type": "aux_loss",
        "--moe-aux-loss-coeff": config.get("router_aux_loss_coef", default=0.001),
        "--moe-token-dispatcher-type": "alltoall",
    })
    flags.update(moe.layer_freq_flag(pattern))
    attention = gpt.attention_kind(qk_layernorm=True)
    kinds = [attention + (moe.moe_kind() if is_moe else gpt.swiglu_mlp_kind())
             for is_moe in pattern]
    mapping = ModelMapping(dims=dims, model_rules=gpt.model_rules(config.tied_embeddings()),
                           layers=kinds, num_experts=experts, stacked=len(set(kinds)) == 1,
                           ignored=gpt.ignored(config.tied_embeddings()))
    notes = ["experts are saved once for both sequential and grouped experts: add "
             "--moe-grouped-gemm (Transformer Engine) to train with grouped GEMMs"]
    return Converted("qwen3_moe", "pretrain_gpt.py", flags, mapping, notes)
