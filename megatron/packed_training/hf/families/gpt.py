"""What the Llama-like families share: the Hugging Face ``model.layers.{layer}.self_attn`` /
``mlp`` names, megatron-core's GPT names in Transformer Engine's layout (each RMSNorm saved
under the linear after it as ``layer_norm_weight``), and the GPT launch flags.
"""

from megatron.packed_training.hf.config import ConversionError, HFConfig, refuse
from megatron.packed_training.hf.mapping import LayerKind, layer_rule, model_rule
from megatron.packed_training.hf.transforms import FUSE_GATE_UP, FUSE_QKV, PAD_VOCAB, Dims

HF_LAYER = "model.layers.{layer}."


def attention_kind(qk_layernorm: bool = False) -> LayerKind:
    """Input norm + GQA self-attention (fused QKV), with per-head q / k norms (Qwen3)."""
    a = HF_LAYER + "self_attn."
    rules = [
        layer_rule("self_attention.linear_qkv.layer_norm_weight",
                   HF_LAYER + "input_layernorm.weight"),
        layer_rule("self_attention.linear_qkv.weight",
                   a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                   transform=FUSE_QKV),
        layer_rule("self_attention.linear_proj.weight", a + "o_proj.weight"),
    ]
    if qk_layernorm:
        rules += [layer_rule("self_attention.q_layernorm.weight", a + "q_norm.weight"),
                  layer_rule("self_attention.k_layernorm.weight", a + "k_norm.weight")]
    return LayerKind("attention", tuple(rules),
                     extra_states=("self_attention.linear_qkv", "self_attention.linear_proj"))


def swiglu_mlp_kind() -> LayerKind:
    """Pre-MLP norm + SwiGLU MLP (gate and up fused into linear_fc1)."""
    m = HF_LAYER + "mlp."
    return LayerKind("mlp", (
        layer_rule("mlp.linear_fc1.layer_norm_weight",
                   HF_LAYER + "post_attention_layernorm.weight"),
        layer_rule("mlp.linear_fc1.weight", m + "gate_proj.weight", m + "up_proj.weight",
                   transform=FUSE_GATE_UP),
        layer_rule("mlp.linear_fc2.weight", m + "down_proj.weight"),
    ), extra_states=("mlp.linear_fc1", "mlp.linear_fc2"))


def model_rules(tied: bool) -> tuple:
    """Embedding (vocabulary padded), final norm and, untied, the output layer."""
    rules = [model_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight",
                        transform=PAD_VOCAB),
             model_rule("decoder.final_layernorm.weight", "model.norm.weight")]
    if not tied:
        rules.append(model_rule("output_layer.weight", "lm_head.weight", transform=PAD_VOCAB))
    return tuple(rules)


def ignored(tied: bool) -> dict:
    """What a Hugging Face checkpoint may hold that the model does not use: RoPE tables
    saved by older transformers, and a tied model's copy of its embedding."""
    left_out = {r"\.rotary_emb\.inv_freq$": "RoPE frequencies, which the model computes"}
    if tied:
        left_out[r"^lm_head\.weight$"] = "the output layer is the embedding (tie_word_embeddings)"
    return left_out


def attention_dims(config: HFConfig) -> Dims:
    hidden = config.require("hidden_size")
    heads = config.require("num_attention_heads")
    groups = config.get("num_key_value_heads", default=heads)
    if heads % groups:
        refuse("num_key_value_heads", groups,
               f"it must divide num_attention_heads ({heads}) for grouped-query attention")
    head_dim = config.get("head_dim", default=hidden // heads)
    return Dims(hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                head_dim=head_dim, vocab_size=config.require("vocab_size"))


def check_plain_transformer(config: HFConfig, activation: str = "silu") -> None:
    """Refuse what the fork's GPT spec does not build: other activations, biases, sliding
    windows."""
    act = config.get("hidden_act", "hidden_activation", default=activation)
    if act != activation:
        refuse("hidden_act", act, f"this family converts with {activation} (SwiGLU) only")
    for name in ("attention_bias", "mlp_bias"):
        if config.get(name):
            refuse(name, True, "the fork's GPT model is built with --disable-bias-linear "
                               "(Megatron's --add-bias-linear would add biases to every linear)")
    if config.get("use_sliding_window") and config.get("sliding_window"):
        refuse("use_sliding_window", True, "sliding-window attention is not built by the "
                                           "fork's packed attention")


def gpt_flags(config: HFConfig, dims: Dims, ffn_hidden_size: int | None,
              qk_layernorm: bool = False) -> dict:
    """The GPT model flags every Llama-like family shares (RoPE scaling excluded)."""
    flags = {
        "--num-layers": config.require("num_hidden_layers"),
        "--hidden-size": dims.hidden_size,
        "--num-attention-heads": dims.num_attention_heads,
    }
    if ffn_hidden_size is not None:
        flags["--ffn-hidden-size"] = ffn_hidden_size
    if dims.num_query_groups != dims.num_attention_heads:
        flags["--group-query-attention"] = True
        flags["--num-query-groups"] = dims.num_query_groups
    if dims.head_dim != dims.hidden_size // dims.num_attention_heads:
        flags["--kv-channels"] = dims.head_dim
    flags.update({
        "--swiglu": True,
        "--normalization": "RMSNorm",
        "--norm-epsilon": config.get("rms_norm_eps", default=1e-6),
        "--disable-bias-linear": True,
        "--position-embedding-type": "rope",
        "--rotary-base": rotary_base(config),
        "--max-position-embeddings": config.require("max_position_embeddings"),
    })
    if qk_layernorm:
        flags["--qk-layernorm"] = True
    if not config.tied_embeddings():
        flags["--untie-embeddings-and-output-weights"] = True
    # Hugging Face checkpoints are trained without dropout in these layers; the fork's
    # TE-free attention refuses attention dropout.
    flags["--attention-dropout"] = 0.0
    flags["--hidden-dropout"] = 0.0
    return flags


def rotary_base(config: HFConfig) -> int:
    theta = config.rope_theta()
    if theta != int(theta):
        raise ConversionError(f"config.json rope_theta is {theta}: Megatron's --rotary-base "
                              "takes an integer")
    return int(theta)


def no_rope_scaling(config: HFConfig) -> None:
    scaling = config.rope_scaling()
    if scaling is not None:
        refuse("rope_scaling", scaling, "this family converts plain RoPE only (no "
                                        "rope_scaling / rope_parameters.rope_type)")
