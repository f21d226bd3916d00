"""DeepSeek-V3 (``model_type`` deepseek_v3): multi-latent attention with the latent RMSNorms
(q-LoRA, or as in Moonlight a plain query projection), MoE with sigmoid routing, an
expert-bias (aux-loss-free balancing), shared experts, group-limited routing and
``first_k_dense_replace`` dense layers first; YaRN RoPE.

Mapping (megatron-core's MLA in Transformer Engine's layout: each latent norm saved under
the up projection after it; the layer's input norm stays a module of its own):

    layers.N.input_layernorm                decoder.layers.N.input_layernorm
    layers.N.self_attn.q_a_proj             decoder.layers.N.self_attention.linear_q_down_proj
    layers.N.self_attn.q_a_layernorm        decoder.layers.N.self_attention.linear_q_up_proj
                                            .layer_norm_weight
    layers.N.self_attn.q_b_proj             decoder.layers.N.self_attention.linear_q_up_proj
    layers.N.self_attn.q_proj               decoder.layers.N.self_attention.linear_q_proj
                                            (no q-LoRA: instead of the three above)
    layers.N.self_attn.kv_a_proj_with_mqa   decoder.layers.N.self_attention.linear_kv_down_proj
    layers.N.self_attn.kv_a_layernorm       decoder.layers.N.self_attention.linear_kv_up_proj
                                            .layer_norm_weight
    layers.N.self_attn.kv_b_proj            decoder.layers.N.self_attention.linear_kv_up_proj
    layers.N.self_attn.o_proj               decoder.layers.N.self_attention.linear_proj
    layers.N.mlp.gate                       decoder.layers.N.mlp.router
    layers.N.mlp.gate.e_score_correction_bias  decoder.layers.N.mlp.router.expert_bias
    layers.N.mlp.shared_experts.*           decoder.layers.N.mlp.shared_experts.linear_fc{1,2}

(routed experts as in Qwen3-MoE; dense layers as Llama's MLP). Both layouts keep each
head's ``[nope, rope]`` query rows and ``[nope, v]`` key/value rows in the same order, and
both rotate DeepSeek's interleaved RoPE pairs (megatron-core's MLA RoPE is interleaved), so
every tensor maps unchanged. The multi-token-prediction layers a hub checkpoint carries are
left out (Megatron's --mtp-num-layers is not set).

Without q-LoRA (``q_lora_rank`` null: Moonlight) the launch line has no --q-lora-rank and the
query projection is a plain linear: the fork's MLA (packed_model/mla.py,
`DeepSeekMLASelfAttention`) builds it without the query norm megatron-core 0.19.2 fuses into
it under --qk-layernorm, so the checkpoint holds no ``linear_q_proj.layer_norm_weight``.

YaRN's ``original_max_position_embeddings``, ``beta_fast`` and ``beta_slow`` go to Megatron-LM's
--yarn-original-max-position-embeddings, --yarn-beta-fast and --yarn-beta-slow, which the fork
hands to megatron-core's MLA (packed_training/config.py).

Refused: FP8 checkpoints, routing or RoPE settings megatron-core computes differently, and
head sizes megatron-core's fused MLA RoPE kernel does not compile (not powers of two).
"""

from megatron.packed_training.hf.config import HFConfig, refuse
from megatron.packed_training.hf.families import gpt, moe
from megatron.packed_training.hf.mapping import Converted, LayerKind, ModelMapping, layer_rule
from megatron.packed_training.hf.transforms import Dims

MODEL_TYPES = ("deepseek_v3",)
A = gpt.HF_LAYER + "self_attn."

# rope_scaling's YaRN fields -> the Megatron-LM flags that carry them to megatron-core's MLA
# (the fork's config.py sets its MLATransformerConfig fields from them), and their defaults.
MLA_YARN_FLAGS = {"original_max_position_embeddings": ("--yarn-original-max-position-embeddings",
                                                       int, 4096),
                  "beta_fast": ("--yarn-beta-fast", float, 32.0),
                  "beta_slow": ("--yarn-beta-slow", float, 1.0)}
# The head sizes megatron-core's fused MLA RoPE kernels (Triton) take as tl.arange ranges:
# powers of two only, the RoPE width at least 4 (packed_model/mla_rope.py, FUSED_HEAD_SIZES).
MLA_POWER_OF_TWO_DIMS = (("qk_nope_head_dim", "--qk-head-dim", 1),
                         ("qk_rope_head_dim", "--qk-pos-emb-head-dim", 4),
                         ("v_head_dim", "--v-head-dim", 1))


def mla_kind(q_lora: bool = True) -> LayerKind:
    """Input norm + MLA, with q-LoRA (down projection, latent norm, up projection) or without
    (one plain query projection, no norm)."""
    s = "self_attention."
    if q_lora:
        query = (
            layer_rule(s + "linear_q_down_proj.weight", A + "q_a_proj.weight"),
            layer_rule(s + "linear_q_up_proj.layer_norm_weight", A + "q_a_layernorm.weight"),
            layer_rule(s + "linear_q_up_proj.weight", A + "q_b_proj.weight"))
        query_linears = ("linear_q_down_proj", "linear_q_up_proj")
    else:
        query = (layer_rule(s + "linear_q_proj.weight", A + "q_proj.weight"),)
        query_linears = ("linear_q_proj",)
    return LayerKind("mla" if q_lora else "mla_no_q_lora", (
        layer_rule("input_layernorm.weight", gpt.HF_LAYER + "input_layernorm.weight"),
        *query,
        layer_rule(s + "linear_kv_down_proj.weight", A + "kv_a_proj_with_mqa.weight"),
        layer_rule(s + "linear_kv_up_proj.layer_norm_weight", A + "kv_a_layernorm.weight"),
        layer_rule(s + "linear_kv_up_proj.weight", A + "kv_b_proj.weight"),
        layer_rule(s + "linear_proj.weight", A + "o_proj.weight"),
    ), extra_states=tuple(s + name for name in (*query_linears, "linear_kv_down_proj",
                                                "linear_kv_up_proj", "linear_proj")))


def rope_flags(config: HFConfig) -> dict:
    """MLA's RoPE: always megatron-core's YaRN (the fork's graph-safe MLA RoPE is the fused
    YaRN kernel); without rope_scaling a factor of 1, which rotates as plain RoPE."""
    if not config.get("rope_interleave", default=True):
        refuse("rope_interleave", False, "megatron-core's MLA rotates DeepSeek's interleaved "
                                         "RoPE pairs only")
    flags = {"--rope-type": "yarn", "--rotary-base": gpt.rotary_base(config)}
    scaling = config.rope_scaling()
    if scaling is None:
        return {**flags, "--rotary-scaling-factor": 1.0}
    if scaling["rope_type"] != "yarn":
        refuse("rope_scaling.rope_type", scaling["rope_type"], "MLA converts YaRN or plain RoPE")
    for name, (flag, kind, default) in MLA_YARN_FLAGS.items():
        flags[flag] = kind(scaling.get(name) if scaling.get(name) is not None else default)
    return {**flags, "--rotary-scaling-factor": float(scaling["factor"]),
            "--mscale": float(scaling.get("mscale", 1.0)),
            "--mscale-all-dim": float(scaling.get("mscale_all_dim", 0.0))}


def mla_head_flags(config: HFConfig) -> dict:
    """--qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim; refused where megatron-core's fused
    MLA RoPE kernel, the only one packed MLA runs, does not compile for the size."""
    flags = {}
    for name, flag, least in MLA_POWER_OF_TWO_DIMS:
        size = config.require(name)
        if size < least or size & (size - 1):
            refuse(name, size, f"{flag} must be a power of two (at least {least}) for "
                               f"megatron-core's fused MLA RoPE kernel (Triton), which packed "
                               f"MLA needs; this checkpoint's attention cannot be trained here")
        flags[flag] = size
    return flags


def router_flags(config: HFConfig, experts: int) -> dict:
    topk = config.require("num_experts_per_tok")
    if config.get("scoring_func", default="sigmoid") != "sigmoid":
        refuse("scoring_func", config.get("scoring_func"), "DeepSeek-V3 routes with sigmoid "
                                                           "scores")
    if config.get("topk_method", default="noaux_tc") != "noaux_tc":
        refuse("topk_method", config.get("topk_method"),
               "megatron-core's expert-bias routing is DeepSeek-V3's noaux_tc")
    if topk > 1 and not config.get("norm_topk_prob", default=True):
        refuse("norm_topk_prob", False, "megatron-core renormalises sigmoid top-k weights")
    flags = {"--moe-router-topk": topk, "--moe-router-score-function": "sigmoid",
             "--moe-router-enable-expert-bias": True,
             "--moe-router-topk-scaling-factor": float(config.get("routed_scaling_factor",
                                                                  default=1.0)),
             "--moe-router-dtype": "fp32"}
    groups, group_topk = config.get("n_group", default=1), config.get("topk_group", default=1)
    if groups > 1:
        if experts % groups or topk // group_topk != 2:
            refuse("topk_group", group_topk,
                   f"megatron-core scores an expert group by its top num_experts_per_tok / "
                   f"topk_group = {topk // group_topk} experts, DeepSeek-V3 by its top 2")
        flags.update({"--moe-router-num-groups": groups, "--moe-router-group-topk": group_topk})
    return flags


def describe(config: HFConfig) -> Converted:
    if config.get("quantization_config"):
        refuse("quantization_config", config.get("quantization_config").get("quant_method"),
               "the converter reads bf16 / fp32 checkpoints; dequantize the FP8 weights first "
               "(DeepSeek's fp8_cast_bf16.py)")
    gpt.check_plain_transformer(config)
    q_lora = config.get("q_lora_rank")  # None: no q-LoRA, Megatron-LM's --q-lora-rank default
    layers = config.require("num_hidden_layers")
    heads = config.require("num_attention_heads")
    experts = config.require("n_routed_experts", "num_local_experts", "num_experts")
    first_dense = config.get("first_k_dense_replace", default=0)
    pattern = [layer >= first_dense for layer in range(layers)]
    moe_ffn = config.require("moe_intermediate_size")
    dims = Dims(hidden_size=config.require("hidden_size"), num_attention_heads=heads,
                vocab_size=config.require("vocab_size"))
    flags = {
        "--num-layers": layers, "--hidden-size": dims.hidden_size,
        "--num-attention-heads": heads, "--ffn-hidden-size": config.require("intermediate_size"),
        "--multi-latent-attention": True,
        **({} if q_lora is None else {"--q-lora-rank": q_lora}),
        "--kv-lora-rank": config.require("kv_lora_rank"),
        **mla_head_flags(config), "--qk-layernorm": True,
        "--swiglu": True, "--normalization": "RMSNorm",
        "--norm-epsilon": config.get("rms_norm_eps", default=1e-6),
        "--disable-bias-linear": True, "--position-embedding-type": "rope",
        **rope_flags(config),
        "--max-position-embeddings": config.require("max_position_embeddings"),
        "--untie-embeddings-and-output-weights": not config.tied_embeddings(default=False),
        "--attention-dropout": 0.0, "--hidden-dropout": 0.0,
        "--num-experts": experts, "--moe-ffn-hidden-size": moe_ffn,
        **router_flags(config, experts),
        "--moe-router-load-balancing-type": "seq_aux_loss",
        "--moe-aux-loss-coeff": config.get("aux_loss_alpha", default=0.0001),
        "--moe-token-dispatcher-type": "alltoall",
    }
    shared = config.get("n_shared_experts", default=0)
    if shared:
        flags["--moe-shared-expert-intermediate-size"] = shared * moe_ffn
    flags.update(moe.layer_freq_flag(pattern))
    attention = mla_kind(q_lora=q_lora is not None)
    moe_layer = attention + moe.moe_kind(expert_bias="mlp.gate.e_score_correction_bias",
                                         shared_experts="mlp.shared_experts" if shared else None)
    dense_layer = attention + gpt.swiglu_mlp_kind()
    kinds = [moe_layer if is_moe else dense_layer for is_moe in pattern]
    mtp = config.get("num_nextn_predict_layers", default=0)
    ignored = {**gpt.ignored(config.tied_embeddings(default=False)),
               **{rf"^model\.layers\.{layers + i}\.": "a multi-token-prediction layer (not "
                                                      "converted)" for i in range(mtp)}}
    mapping = ModelMapping(dims=dims,
                           model_rules=gpt.model_rules(config.tied_embeddings(default=False)),
                           layers=kinds, num_experts=experts, stacked=len(set(kinds)) == 1,
                           ignored=ignored)
    notes = ["multi-latent attention runs on Transformer Engine attention only (the packed "
             "MLA needs TE's fused YaRN RoPE)"]
    return Converted("deepseek_v3", "pretrain_gpt.py", flags, mapping, notes)
