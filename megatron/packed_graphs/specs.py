"""Layer specs for packed-sequence GPT and hybrid Mamba-Transformer models.

A spec places the graph-safe layers (layers.py) around the packed model's modules
(packed_model/), composed from a backend provider (packed_model/providers.py: which linear /
norm / attention classes to use) instead of boolean switches. Each provider names its
self-attention class (``provider.self_attention``).

Where the provider does not fuse the norm into the following linear, the spec places a
separate norm module in front (``input_layernorm`` / ``pre_mlp_layernorm`` / Mamba ``norm``).

MoE (``num_experts``): the MLP is megatron-core's MoELayer from its own builder for the
provider (SequentialMLP experts over the provider's linears; TEGroupedMLP with TE and
``moe_grouped_gemm``), with the packed router `moe.PackedTopKRouter`; the norm in front is
always a separate module (MoE does not fuse it). The layer is `layers.GraphSafeMoELayer`
(megatron-core's MoETransformerLayer), in GPT and hybrid models alike. With the config's
``moe_dropless_graphs`` (``--moe-dropless-graphs``) the MoE builder makes it dropless with
static shapes (moe_dropless.py), its experts one grouped GEMM per linear (moe_experts.py).

MLA (``multi_latent_attention``, TE only): the self-attention is `mla.PackedMLASelfAttention`
(megatron-core's MLA with graph-safe fused yarn RoPE) behind a separate input norm; in hybrid
models it is the '+' layer.
"""

import functools

from megatron.core.models.backends import BackendSpecProvider
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.transformer.attention import SelfAttentionSubmodules

from megatron.packed_graphs.layers import (
    GraphSafeHybridStack,
    GraphSafeMambaLayer,
    GraphSafeMLPLayer,
    GraphSafeMoELayer,
    GraphSafeTransformerLayer,
)
from megatron.packed_model.hybrid_stack import PackedHybridStackSubmodules
from megatron.packed_model.mla import mla_attention_submodules
from megatron.packed_model.providers import (
    own_norm,
    norm_and_linear,
    backend_provider,
    te_checkpoint_keys,
)
from megatron.packed_model.moe import moe_mlp_spec


def attention_layer_spec(provider: BackendSpecProvider, normalization: str,
                         qk_layernorm: bool = False) -> ModuleSpec:
    """A TransformerLayer holding only causal self-attention (the hybrid '*' layer);
    ``qk_layernorm``: a norm on each head's query and key (Qwen3, OLMo 2), of the model's
    ``normalization`` kind. It must match the config's ``qk_layernorm``: megatron-core's
    SelfAttention refuses a spec norm the config turned off."""
    norm, linear_qkv = norm_and_linear(provider, normalization)
    qk_norm = own_norm(provider, normalization, for_qk=True) if qk_layernorm else None
    return ModuleSpec(
        module=GraphSafeTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=provider.self_attention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear_qkv,
                    core_attention=provider.core_attention(),
                    linear_proj=provider.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=te_checkpoint_keys(provider, "input_layernorm."),
        ),
    )


def _mlp_spec(provider: BackendSpecProvider, normalization: str):
    """(norm in front, MLP builder). The MLP enters as megatron-core's ``as_mlp_submodule``
    builder, the form TransformerLayer calls directly (a ``ModuleSpec(MLP)`` is rewrapped
    in place, with a warning per layer)."""
    norm, linear_fc1 = norm_and_linear(provider, normalization)
    mlp = functools.partial(
        MLP.as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=linear_fc1, linear_fc2=provider.row_parallel_linear()),
    )
    return norm, mlp


def _moe_spec(provider: BackendSpecProvider, normalization: str, num_experts: int,
              grouped_gemm: bool):
    """(norm in front, MoE builder)."""
    return own_norm(provider, normalization), moe_mlp_spec(provider, num_experts, grouped_gemm)


def moe_layer_spec(provider: BackendSpecProvider, normalization: str, num_experts: int,
                   grouped_gemm: bool = False) -> ModuleSpec:
    """The hybrid 'E' layer: pre-MLP norm and an MoE layer (megatron-core's MoETransformerLayer,
    as upstream's hybrid spec builds it)."""
    norm, moe = _moe_spec(provider, normalization, num_experts, grouped_gemm)
    return ModuleSpec(
        module=GraphSafeMoELayer,
        submodules=TransformerLayerSubmodules(pre_mlp_layernorm=norm, mlp=moe,
                                              mlp_bda=get_bias_dropout_add),
    )


def gpt_layer_spec(attention_backend: str, normalization: str = "RMSNorm",
                   num_experts: int | None = None, moe_grouped_gemm: bool = False,
                   multi_latent_attention: bool = False,
                   qk_layernorm: bool = False) -> ModuleSpec:
    """GPT TransformerLayer (attention + MLP, or MoE with ``num_experts``) for packed sequences;
    MLA self-attention with ``multi_latent_attention``; ``qk_layernorm`` as the config's (see
    `attention_layer_spec`; MLA's latent norms come from the config alone)."""
    provider = backend_provider(attention_backend)
    if multi_latent_attention:
        attention = mla_attention_submodules(provider, normalization)
    else:
        attention = attention_layer_spec(provider, normalization, qk_layernorm).submodules
    # TE's MLA keeps its input norm separate, and MoE layers their pre-MLP norm.
    fused_norms = [] if multi_latent_attention else ["input_layernorm."]
    if num_experts is None:
        pre_mlp_norm, mlp = _mlp_spec(provider, normalization)
        fused_norms.append("pre_mlp_layernorm.")
    else:
        pre_mlp_norm, mlp = _moe_spec(provider, normalization, num_experts, moe_grouped_gemm)
    return ModuleSpec(
        # MoE: megatron-core's MoETransformerLayer, which the partial MoE graphs need.
        module=GraphSafeTransformerLayer if num_experts is None else GraphSafeMoELayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=attention.input_layernorm,
            self_attention=attention.self_attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=te_checkpoint_keys(provider, *fused_norms),
        ),
    )


def moe_layer_pattern(moe_layer_freq, num_layers: int) -> list:
    """Megatron's --moe-layer-freq as one 0/1 entry per layer (1: MoE): an int N makes every
    N-th layer MoE, starting with the first; a list is taken as it is."""
    if isinstance(moe_layer_freq, int):
        return [int(i % moe_layer_freq == 0) for i in range(num_layers)]
    return list(moe_layer_freq)


def gpt_decoder_spec(config, attention_backend: str, normalization: str = "RMSNorm",
                     num_experts: int | None = None, moe_grouped_gemm: bool = False,
                     multi_latent_attention: bool = False, qk_layernorm: bool = False,
                     vp_stage: int | None = None):
    """GPTModel's ``transformer_layer_spec``: `gpt_layer_spec` for every layer, or, when the
    config's ``moe_layer_freq`` leaves some layers dense (e.g. DeepSeek's and Moonlight's
    dense first layers), the layers of this pipeline stage (``vp_stage``), each dense or MoE,
    with megatron-core's default final norm (as a single layer spec gets)."""
    layer = functools.partial(gpt_layer_spec, attention_backend, normalization,
                              moe_grouped_gemm=moe_grouped_gemm,
                              multi_latent_attention=multi_latent_attention,
                              qk_layernorm=qk_layernorm)
    pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers)
    if num_experts is None or all(pattern):
        return layer(num_experts=num_experts)
    dense, moe = layer(num_experts=None), layer(num_experts=num_experts)
    first = get_transformer_layer_offset(config, vp_stage)
    local = pattern[first:first + get_num_layers_to_build(config, vp_stage)]
    return TransformerBlockSubmodules(layer_specs=[moe if is_moe else dense for is_moe in local],
                                      layer_norm=LayerNormImpl)


def hybrid_stack_spec(attention_backend: str, normalization: str = "RMSNorm",
                      num_experts: int | None = None, moe_grouped_gemm: bool = False,
                      multi_latent_attention: bool = False, qk_layernorm: bool = False,
                      mamba_conv_kernel_size: int = 4) -> ModuleSpec:
    """`GraphSafeHybridStack` spec: Mamba ('M'), attention ('*'), MLP ('-'), with
    ``num_experts`` MoE ('E') and with ``multi_latent_attention`` MLA ('+') layers;
    ``qk_layernorm`` as in `gpt_layer_spec`; ``mamba_conv_kernel_size``: the Mamba mixer's
    causal convolution width (megatron-core's ``d_conv``).

    Imports the Mamba modules on call: megatron-core's MambaMixer needs triton and mamba-ssm.
    """
    from megatron.core.ssm.mamba_layer import MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules

    from megatron.packed_model.mamba import PackedMambaMixer

    provider = backend_provider(attention_backend)
    mamba_norm, in_proj = norm_and_linear(provider, normalization)
    pre_mlp_norm, mlp = _mlp_spec(provider, normalization)
    return ModuleSpec(
        module=GraphSafeHybridStack,
        submodules=PackedHybridStackSubmodules(
            mamba_layer=ModuleSpec(
                module=GraphSafeMambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=mamba_norm,
                    mixer=ModuleSpec(
                        module=PackedMambaMixer,
                        submodules=MambaMixerSubmodules(
                            in_proj=in_proj, out_proj=provider.row_parallel_linear()
                        ),
                        params={"d_conv": mamba_conv_kernel_size},
                    ),
                    mamba_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map=te_checkpoint_keys(provider, "norm."),
                ),
            ),
            attention_layer=attention_layer_spec(provider, normalization, qk_layernorm),
            mlp_layer=ModuleSpec(
                module=GraphSafeMLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=pre_mlp_norm, mlp=mlp, mlp_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map=te_checkpoint_keys(provider, "pre_mlp_layernorm."),
                ),
            ),
            moe_layer=(IdentityOp if num_experts is None else
                       moe_layer_spec(provider, normalization, num_experts, moe_grouped_gemm)),
            mla_layer=(ModuleSpec(module=GraphSafeTransformerLayer,
                                  submodules=mla_attention_submodules(provider, normalization))
                       if multi_latent_attention else IdentityOp),
            final_norm=own_norm(provider, normalization),
        ),
    )
