"""Nemotron-H (``model_type`` nemotron_h): a hybrid stack of Mamba-2 ('M'), attention ('*',
no positional embedding), squared-ReLU MLP ('-') and MoE ('E') layers -> the fork's
``pretrain_mamba.py`` with the same --hybrid-layer-pattern.

Mapping (megatron-core's hybrid stack, one key per layer; each layer's pre-norm saved under
the linear after it, as Transformer Engine fuses it, except MoE's):

    backbone.embeddings                     embedding.word_embeddings (vocabulary padded)
    layers.N.norm ('M')                     decoder.layers.N.mixer.in_proj.layer_norm_weight
    layers.N.mixer.in_proj ('M')            decoder.layers.N.mixer.in_proj.weight.{z,x,B,C,dt}
    layers.N.mixer.conv1d.{weight,bias}     decoder.layers.N.mixer.conv1d.{weight,bias}.{x,B,C}
    layers.N.mixer.{A_log,D,dt_bias,norm,out_proj}   decoder.layers.N.mixer.<same>
    layers.N.norm ('*')                     decoder.layers.N.self_attention.linear_qkv
                                            .layer_norm_weight
    layers.N.mixer.{q,k,v}_proj             decoder.layers.N.self_attention.linear_qkv (fuse_qkv)
    layers.N.mixer.o_proj                   decoder.layers.N.self_attention.linear_proj
    layers.N.norm ('-')                     decoder.layers.N.mlp.linear_fc1.layer_norm_weight
    layers.N.mixer.{up,down}_proj ('-')     decoder.layers.N.mlp.linear_fc{1,2}
    layers.N.norm ('E')                     decoder.layers.N.pre_mlp_layernorm
    layers.N.mixer.gate(.e_score_correction_bias)   decoder.layers.N.mlp.router(.expert_bias)
    layers.N.mixer.experts.E.{up,down}_proj decoder.layers.N.mlp.experts.experts.linear_fc{1,2}[E]
    layers.N.mixer.shared_experts.*         decoder.layers.N.mlp.shared_experts.linear_fc{1,2}
    backbone.norm_f                         decoder.final_norm
    lm_head                                 output_layer

megatron-core saves the Mamba in_proj as its five sections and conv1d as three (so each
shards on its own at any TP); the Hugging Face tensors are their concatenation, in the same
[z, x, B, C, dt] order.
"""

import math

from megatron.packed_training.hf.config import HFConfig, refuse
from megatron.packed_training.hf.families import gpt
from megatron.packed_training.hf.families.deepseek_v3 import router_flags
from megatron.packed_training.hf.mapping import (
    Converted,
    LayerKind,
    ModelMapping,
    expert_rule,
    layer_rule,
    model_rule,
)
from megatron.packed_training.hf.transforms import FUSE_QKV, PAD_VOCAB, Dims, sections

MODEL_TYPES = ("nemotron_h",)
L = "backbone.layers.{layer}."
M = L + "mixer."
# transformers 5.x layer names (and the earlier 5.x spellings) -> Megatron pattern characters
LAYER_TYPES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
               "mlp": "-", "moe": "E"}
# megatron-core's MambaMixer fixes these (ssm/mamba_mixer.py): the gated norm's eps 1e-5, dt
# clamped to (0, inf), silu, conv bias on, no projection bias.
MAMBA_FIXED = {"mamba_hidden_act": "silu", "use_conv_bias": True, "mamba_proj_bias": False}
# conv_kernel is the mixer's d_conv (--mamba-conv-kernel-size): the widths causal-conv1d computes.
CONV_KERNELS = (2, 3, 4)


def pattern(config: HFConfig) -> str:
    """The Megatron --hybrid-layer-pattern: from ``layers_block_type`` (transformers 5) or
    the hub's ``hybrid_override_pattern``."""
    types = config.get("layers_block_type", "layer_types")
    if types is None:
        return config.require("hybrid_override_pattern")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        refuse("layers_block_type", unknown, f"the fork's hybrid stack builds "
                                             f"{', '.join(sorted(LAYER_TYPES))}")
    return "".join(LAYER_TYPES[kind] for kind in types)


def mamba_kind(inner: int, group_state: int, heads: int) -> LayerKind:
    in_proj = sections("in_proj", [("z", inner), ("x", inner), ("B", group_state),
                                   ("C", group_state), ("dt", heads)])
    conv = sections("conv1d", [("x", inner), ("B", group_state), ("C", group_state)])
    rules = [layer_rule("mixer.in_proj.layer_norm_weight", L + "norm.weight")]
    rules += [layer_rule(f"mixer.in_proj.weight.{name}", M + "in_proj.weight", transform=t)
              for name, t in in_proj]
    rules += [layer_rule(f"mixer.conv1d.{param}.{name}", M + f"conv1d.{param}", transform=t)
              for param in ("weight", "bias") for name, t in conv]
    rules += [layer_rule(f"mixer.{name}", M + name)
              for name in ("A_log", "D", "dt_bias", "norm.weight", "out_proj.weight")]
    return LayerKind("mamba", tuple(rules), extra_states=("mixer.in_proj", "mixer.out_proj"))


def attention_kind() -> LayerKind:
    return LayerKind("attention", (
        layer_rule("self_attention.linear_qkv.layer_norm_weight", L + "norm.weight"),
        layer_rule("self_attention.linear_qkv.weight", M + "q_proj.weight", M + "k_proj.weight",
                   M + "v_proj.weight", transform=FUSE_QKV),
        layer_rule("self_attention.linear_proj.weight", M + "o_proj.weight"),
    ), extra_states=("self_attention.linear_qkv", "self_attention.linear_proj"))


def mlp_kind() -> LayerKind:
    return LayerKind("mlp", (
        layer_rule("mlp.linear_fc1.layer_norm_weight", L + "norm.weight"),
        layer_rule("mlp.linear_fc1.weight", M + "up_proj.weight"),
        layer_rule("mlp.linear_fc2.weight", M + "down_proj.weight"),
    ), extra_states=("mlp.linear_fc1", "mlp.linear_fc2"))


def moe_kind() -> LayerKind:
    e, s = M + "experts.{expert}.", M + "shared_experts."
    return LayerKind("moe", (
        layer_rule("pre_mlp_layernorm.weight", L + "norm.weight"),
        layer_rule("mlp.router.weight", M + "gate.weight"),
        layer_rule("mlp.router.expert_bias", M + "gate.e_score_correction_bias"),
        expert_rule("mlp.experts.experts.linear_fc1.weight", e + "up_proj.weight"),
        expert_rule("mlp.experts.experts.linear_fc2.weight", e + "down_proj.weight"),
        layer_rule("mlp.shared_experts.linear_fc1.weight", s + "up_proj.weight"),
        layer_rule("mlp.shared_experts.linear_fc2.weight", s + "down_proj.weight"),
    ), extra_states=("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"),
        expert_extra_states=("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"))


def _check(config: HFConfig, layers: str) -> None:
    if config.get("mlp_hidden_act", default="relu2") != "relu2":
        refuse("mlp_hidden_act", config.get("mlp_hidden_act"), "Nemotron-H converts with "
                                                               "squared ReLU (--squared-relu)")
    for name in ("attention_bias", "mlp_bias", "use_bias"):
        if config.get(name):
            refuse(name, True, "the fork's hybrid model is built with --disable-bias-linear")
    if config.get("residual_in_fp32"):
        refuse("residual_in_fp32", True, "the fork keeps the residual in the model dtype")
    if config.get("num_nextn_predict_layers"):
        refuse("num_nextn_predict_layers", config.get("num_nextn_predict_layers"),
               "multi-token-prediction layers are not converted")
    if "M" in layers:
        for name, value in MAMBA_FIXED.items():
            if config.get(name, default=value) != value:
                refuse(name, config.get(name), f"megatron-core's Mamba mixer uses {value}")
        if config.get("conv_kernel", default=4) not in CONV_KERNELS:
            refuse("conv_kernel", config.get("conv_kernel"), "causal-conv1d computes Mamba "
                   "convolutions of width 2, 3 or 4 (--mamba-conv-kernel-size)")
        eps = config.get("layer_norm_epsilon", "rms_norm_eps", default=1e-5)
        if eps != 1e-5:
            refuse("layer_norm_epsilon", eps, "megatron-core's Mamba gated norm uses 1e-5")
        low, high = config.get("time_step_limit", default=[0.0, math.inf])
        high = math.inf if isinstance(high, dict) else float(high)  # {"__float__": "Infinity"}
        if float(low) != 0.0 or high != math.inf:
            refuse("time_step_limit", [low, high], "megatron-core's Mamba mixer does not clamp "
                                                   "dt")
    if "E" in layers and config.get("moe_latent_size"):
        refuse("moe_latent_size", config.get("moe_latent_size"),
               "latent MoE projections are not built by the fork's MoE layers")


def describe(config: HFConfig) -> Converted:
    layers = pattern(config)
    _check(config, layers)
    hidden = config.require("hidden_size")
    heads = config.require("num_attention_heads")
    groups = config.get("num_key_value_heads", default=heads)
    head_dim = config.get("head_dim", "attention_head_dim", default=hidden // heads)
    dims = Dims(hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                head_dim=head_dim, vocab_size=config.require("vocab_size"))
    flags = {"--hybrid-layer-pattern": layers, "--hidden-size": hidden,
             "--num-attention-heads": heads}
    if groups != heads:
        flags.update({"--group-query-attention": True, "--num-query-groups": groups})
    if head_dim != hidden // heads:
        flags["--kv-channels"] = head_dim
    flags["--ffn-hidden-size"] = config.require("intermediate_size")
    kinds = {"*": attention_kind(), "-": mlp_kind()}
    # Given even without 'M' layers: Megatron-LM checks the Mamba sizes of every hybrid run.
    mamba_heads, mamba_head_dim = (config.require("mamba_num_heads"),
                                   config.require("mamba_head_dim"))
    state, mamba_groups = config.require("ssm_state_size"), config.require("n_groups")
    flags.update({"--mamba-num-heads": mamba_heads, "--mamba-head-dim": mamba_head_dim,
                  "--mamba-state-dim": state, "--mamba-num-groups": mamba_groups})
    kinds["M"] = mamba_kind(mamba_heads * mamba_head_dim, mamba_groups * state, mamba_heads)
    conv_kernel = config.get("conv_kernel", default=4)
    if "M" in layers and conv_kernel != 4:
        flags["--mamba-conv-kernel-size"] = int(conv_kernel)
    flags.update({"--squared-relu": True, "--normalization": "RMSNorm",
                  "--norm-epsilon": config.get("layer_norm_epsilon", "rms_norm_eps",
                                               default=1e-5),
                  "--disable-bias-linear": True, "--position-embedding-type": "none",
                  "--max-position-embeddings": config.require("max_position_embeddings"),
                  "--untie-embeddings-and-output-weights": not config.tied_embeddings(False),
                  "--attention-dropout": 0.0, "--hidden-dropout": 0.0})
    experts = 0
    if "E" in layers:
        experts = config.require("n_routed_experts", "num_local_experts", "num_experts")
        flags.update({"--num-experts": experts,
                      "--moe-ffn-hidden-size": config.require("moe_intermediate_size"),
                      "--moe-shared-expert-intermediate-size": config.get(
                          "moe_shared_expert_intermediate_size",
                          default=config.require("intermediate_size")),
                      **router_flags(config, experts),
                      "--moe-router-load-balancing-type": "seq_aux_loss",
                      "--moe-aux-loss-coeff": config.get("router_aux_loss_coef",
                                                         default=0.0001),
                      "--moe-token-dispatcher-type": "alltoall"})
        kinds["E"] = moe_kind()
    tied = config.tied_embeddings(default=False)
    model_rules = [model_rule("embedding.word_embeddings.weight", "backbone.embeddings.weight",
                              transform=PAD_VOCAB),
                   model_rule("decoder.final_norm.weight", "backbone.norm_f.weight")]
    if not tied:
        model_rules.append(model_rule("output_layer.weight", "lm_head.weight",
                                      transform=PAD_VOCAB))
    mapping = ModelMapping(dims=dims, model_rules=tuple(model_rules),
                           layers=[kinds[char] for char in layers], num_experts=experts,
                           stacked=False, model_extra_states=("output_layer",),
                           ignored=gpt.ignored(tied))
    notes = ["the Mamba layers need mamba-ssm and causal-conv1d (pip install .[mamba])"]
    return Converted("nemotron_h", "pretrain_mamba.py", flags, mapping, notes)
