"""MoE layers shared by the MoE families: megatron-core's MoELayer names (router, routed
experts with the expert as an axis, shared experts) and the --moe-layer-freq pattern.

A routed expert's SwiGLU fc1 is ``[gate; up]`` as in a dense MLP. Megatron's sequential
experts (SequentialMLP) and Transformer Engine's grouped experts (TEGroupedMLP,
--moe-grouped-gemm) save under the same keys (``mlp.experts.experts.linear_fc1.weight``
with the expert axis), so one checkpoint serves both.
"""

from megatron.packed_training.hf.families.gpt import HF_LAYER
from megatron.packed_training.hf.mapping import LayerKind, expert_rule, layer_rule
from megatron.packed_training.hf.transforms import FUSE_GATE_UP


def moe_kind(norm: str = "post_attention_layernorm", router: str = "mlp.gate.weight",
             expert_bias: str | None = None, shared_experts: str | None = None) -> LayerKind:
    """Pre-MLP norm (kept separate: MoE fuses no norm) + router (+ expert bias) + routed
    SwiGLU experts ``mlp.experts.{expert}.{gate,up,down}_proj`` (+ shared experts, one
    SwiGLU MLP under ``shared_experts``)."""
    e = HF_LAYER + "mlp.experts.{expert}."
    rules = [layer_rule("pre_mlp_layernorm.weight", HF_LAYER + norm + ".weight"),
             layer_rule("mlp.router.weight", HF_LAYER + router)]
    if expert_bias:
        rules.append(layer_rule("mlp.router.expert_bias", HF_LAYER + expert_bias))
    rules += [expert_rule("mlp.experts.experts.linear_fc1.weight", e + "gate_proj.weight",
                          e + "up_proj.weight", transform=FUSE_GATE_UP),
              expert_rule("mlp.experts.experts.linear_fc2.weight", e + "down_proj.weight")]
    extra = ()
    if shared_experts:
        s = HF_LAYER + shared_experts + "."
        rules += [layer_rule("mlp.shared_experts.linear_fc1.weight", s + "gate_proj.weight",
                             s + "up_proj.weight", transform=FUSE_GATE_UP),
                  layer_rule("mlp.shared_experts.linear_fc2.weight", s + "down_proj.weight")]
        extra = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
    return LayerKind("moe", tuple(rules), extra_states=extra,
                     expert_extra_states=("mlp.experts.experts.linear_fc1",
                                          "mlp.experts.experts.linear_fc2"))


def layer_freq_flag(is_moe: list[bool]) -> dict:
    """``--moe-layer-freq`` for a per-layer MoE pattern: nothing when every layer is MoE (the
    default 1), else the list in the compact form Megatron's parser evaluates
    (``([0]*3+[1]*58)``: digits, brackets, ``*`` and ``+`` only)."""
    if all(is_moe):
        return {}
    runs, previous = [], None
    for flag in (int(x) for x in is_moe):
        if flag == previous:
            runs[-1][1] += 1
        else:
            runs.append([flag, 1])
        previous = flag
    return {"--moe-layer-freq": "(" + "+".join(f"[{flag}]*{count}" for flag, count in runs) + ")"}
