"""Multi-latent attention (DeepSeek / Moonlight style) on packed (THD) micro-batches.

`PackedMLASelfAttention` is megatron-core's `MLASelfAttention`, entered through the layer
spec, with what packed data under CUDA graphs needs:

* RoPE: upstream's fused yarn kernels (``apply_rope_fusion``; the only sync-free MLA RoPE on
  THD), over `mla_rope.GraphSafeYarnRotaryEmbedding` tables that no later micro-batch frees,
  with one more boundary at the end of the stream (the zero-valid tail segment) and a table
  as long as the stream, so no row reads outside it (see mla_rope.py);
* dynamic CP: a micro-batch with its own CP group (``packed_seq_params.cp_group``) runs the
  fused RoPE with that group's size and rank (standard attention's RoPE needs no group: it
  gathers each rank's own positions); the core attention (`PackedTEDotProductAttention`)
  switches TE's CP group itself. megatron-core 0.19.2 refuses ``local_cp_size`` in MLA; the
  RoPE here never reads it;
* no query norm without q-LoRA: see `DeepSeekMLASelfAttention`;
* V padding: upstream pads V to the query head size on THD so that TE may choose
  FlashAttention. The config's ``mla_pad_v`` (``--mla-pad-v``) keeps that (True, the
  default) or hands TE the narrower V (False): TE's cuDNN attention takes unequal query and
  value head sizes on THD, and on Hopper and newer TE prefers it to FlashAttention whenever
  both run, so there the pad only widens the work (tools/mla_costs.py measures both).

THD MLA needs Transformer Engine attention: the spec builder refuses other backends, as the
command line does.
"""

import copy
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, get_backend
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron.packed_model.dynamic_cp import micro_batch_cp_group
from megatron.packed_model.mla_rope import GraphSafeYarnRotaryEmbedding, cover_all_rows
from megatron.packed_model.padding_rows import ZeroedProjectionInput
from megatron.packed_model.providers import VarlenSpecProvider
from megatron.packed_upstream import model_layers

def graph_safe_rotary(config, cp_group) -> GraphSafeYarnRotaryEmbedding:
    """The yarn rotary embedding upstream MLA builds from ``config``, graph-safe."""
    return GraphSafeYarnRotaryEmbedding(
        config.qk_pos_emb_head_dim, rotary_base=config.rotary_base,
        scaling_factor=config.rotary_scaling_factor,
        original_max_position_embeddings=config.original_max_position_embeddings,
        beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
        mscale_all_dim=config.mscale_all_dim, cp_group=cp_group)


def rope_params(params, rows: int, cp_size: int):
    """The packed params upstream MLA's RoPE reads, for ``rows`` physical rows on this rank.

    A shallow copy of ``params`` whose padded boundaries (which upstream's RoPE prefers) end
    in the zero-valid tail segment (`cover_all_rows`), whose ``max_seqlen`` is the whole
    stream (``rows * cp_size``: the RoPE table length, the same for every micro-batch of a
    bank), and without ``local_cp_size`` (the caller already set the micro-batch's group).
    Attention keeps ``params`` as they are. No host sync.
    """
    if params is None or params.qkv_format != "thd":
        return params
    boundaries = (params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None
                  else params.cu_seqlens_q)
    covered = cover_all_rows(boundaries, rows, cp_size)
    rope = copy.copy(params)
    rope.cu_seqlens_q_padded = rope.cu_seqlens_kv_padded = covered
    rope.max_seqlen_q = rope.max_seqlen_kv = rows * cp_size
    rope.local_cp_size = None
    return rope


def _module_class(spec):
    return spec.module if isinstance(spec, ModuleSpec) else spec


def query_norm_fused(config, submodules, resolved: dict) -> bool:
    """Whether megatron-core's Q/KV norm resolution (``resolved``: linear_q_proj, ...) put a
    norm in front of the query projection that the spec did not ask for: no q-LoRA,
    ``qk_layernorm``, and the backend's fused norm + linear in place of the spec's plain
    ``linear_q_proj`` (megatron-core 0.19.2's choice)."""
    if config.q_lora_rank is not None or not config.qk_layernorm:
        return False
    fused = get_backend(config.transformer_impl).column_parallel_layer_norm_linear()
    return (fused is not None and _module_class(resolved.get("linear_q_proj")) is fused
            and _module_class(submodules.linear_q_proj) is not fused)


class DeepSeekMLASelfAttention(MLASelfAttention):
    """megatron-core's MLASelfAttention with DeepSeek's norms also without q-LoRA.

    DeepSeek-V3 and Moonlight normalise only the two latents (``q_a_layernorm`` after the
    query down projection, ``kv_a_layernorm`` after the key/value one), which
    ``qk_layernorm`` asks for. Without q-LoRA (``q_lora_rank`` None: Moonlight,
    DeepSeek-V2-Lite) the query projection reads the layer's normalised input as it is.
    megatron-core 0.19.2 (transformer/mla_qk_norm_config.py) builds that projection as a
    fused norm + linear whenever ``qk_layernorm`` is set, a second norm in front of the query
    that these models lack. Here the spec's ``linear_q_proj`` (a plain column-parallel
    linear) is built instead; the key/value latent norm stays as megatron-core resolves it
    (fused into ``linear_kv_up_proj`` on TE). Upstream's forward hands ``linear_q_proj`` the
    hidden states unchanged either way. Where the resolver leaves the spec's linear (a spec
    that asks for the fused one, a megatron-core that does not fuse), nothing changes; a
    megatron-core without ``_resolve_qk_norm_config`` never calls the override.
    tests/unit/test_mla_spec.py fails once megatron-core stops fusing that norm.
    """

    def _resolve_qk_norm_config(self, submodules):
        resolved = super()._resolve_qk_norm_config(submodules)
        if query_norm_fused(self.config, submodules, resolved):
            resolved = {**resolved, "linear_q_proj": submodules.linear_q_proj or get_backend(
                self.config.transformer_impl).column_parallel_linear()}
        return resolved

    def set_for_recompute_input_layernorm(self):
        """As upstream (fp8 / fp4 with the input norm recomputed: the projections that read
        the norm's output save it unquantised), plus the plain query projection, which reads
        it too."""
        super().set_for_recompute_input_layernorm()
        if self.config.q_lora_rank is None and not hasattr(self.linear_q_proj,
                                                           "layer_norm_weight"):
            from megatron.core.extensions.transformer_engine import set_save_original_input

            set_save_original_input(self.linear_q_proj)


class PackedMLASelfAttention(ZeroedProjectionInput, DeepSeekMLASelfAttention):
    """MLASelfAttention for packed micro-batches under CUDA graphs (see module doc).

    forward: hidden states ``[T_local (/ TP with SP), 1, H]`` and THD ``packed_seq_params``
    (``max_seqlen`` host ints, boundaries on the device) -> ``([T_local, 1, H], bias)``.
    No host sync. ``pad_value`` (from ``config.mla_pad_v``; True where the config has no such
    field): pad V to the query head size on THD, upstream's choice. Fixed at capture.
    """

    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.padding,
                 cp_comm_type: Optional[str] = None, pg_collection=None, pp_layer_offset=None,
                 name=None):
        if config.rope_type != "yarn" or not config.apply_rope_fusion:
            raise ValueError(
                f"MLA RoPE is wrong: rope_type {config.rope_type!r}, apply_rope_fusion "
                f"{config.apply_rope_fusion}. Packed MLA needs the fused yarn RoPE (upstream's "
                f"unfused THD RoPE reads cu_seqlens back to the host).")
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                         pp_layer_offset=pp_layer_offset, name=name)
        self.rotary_pos_emb = graph_safe_rotary(config, self.pg_collection.cp)
        self.pad_value = getattr(config, "mla_pad_v", True)

    def forward(self, hidden_states, attention_mask, *args, packed_seq_params=None, **kwargs):
        group = micro_batch_cp_group(packed_seq_params)
        if group is None:
            return super().forward(hidden_states, attention_mask, *args,
                                   packed_seq_params=packed_seq_params, **kwargs)
        groups = copy.copy(self.pg_collection)  # fields are init=False: no dataclasses.replace
        groups.cp = group
        with model_layers.field_for_this_call(self, "pg_collection", groups):
            return super().forward(hidden_states, attention_mask, *args,
                                   packed_seq_params=packed_seq_params, **kwargs)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None,
                                    inference_context=None, *, inference_params=None):
        rows = hidden_states.shape[0]
        if self.config.sequence_parallel:  # the up projections gather the sequence
            rows *= self.pg_collection.tp.size()
        params = rope_params(packed_seq_params, rows, self.pg_collection.cp.size())
        return super().get_query_key_value_tensors(
            hidden_states, key_value_states, position_ids, params,
            inference_context=inference_context, inference_params=inference_params)

    def _run_core_attention(self, query, key, value, attention_mask, packed_seq_params=None,
                            attn_mask_type=None, **extra_kwargs):
        if self.pad_value:
            return super()._run_core_attention(query, key, value, attention_mask,
                                               packed_seq_params=packed_seq_params,
                                               attn_mask_type=attn_mask_type, **extra_kwargs)
        return self.core_attention(query, key, value, attention_mask,
                                   packed_seq_params=packed_seq_params,
                                   attn_mask_type=attn_mask_type or self.attn_mask_type,
                                   **extra_kwargs)


def _require_te(provider: BackendSpecProvider) -> None:
    if isinstance(provider, VarlenSpecProvider):
        raise ValueError(f"--attention-backend is wrong: the TE-free "
                         f"{provider.attention_backend} attention. Packed multi-latent attention "
                         f"runs only on Transformer Engine attention; use --attention-backend "
                         f"auto, flash or fused with Transformer Engine installed.")


def mla_self_attention_spec(provider: BackendSpecProvider) -> ModuleSpec:
    """`PackedMLASelfAttention` over ``provider``'s TE modules (upstream's TE MLA layout).

    The Q/KV up projections are left to megatron-core's resolver, which fuses the latent
    norms into them when the config asks for ``qk_layernorm``. Without q-LoRA the query
    projection is ``linear_q_proj`` as given here, with no norm (`DeepSeekMLASelfAttention`).
    """
    _require_te(provider)
    return ModuleSpec(
        module=PackedMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=provider.column_parallel_linear(),
            linear_q_down_proj=provider.linear(),
            linear_kv_down_proj=provider.linear(),
            core_attention=provider.core_attention(),
            linear_proj=provider.row_parallel_linear(),
            q_layernorm=IdentityOp,
            kv_layernorm=IdentityOp,
        ),
    )


def mla_attention_submodules(provider: BackendSpecProvider,
                             normalization: str) -> TransformerLayerSubmodules:
    """Input norm + MLA self-attention + residual: the attention half of a layer (the hybrid
    '+' layer on its own). The norm stays a module of its own: MLA's down projections do not
    fuse it."""
    return TransformerLayerSubmodules(
        input_layernorm=provider.layer_norm(rms_norm=normalization == "RMSNorm", for_qk=False),
        self_attention=mla_self_attention_spec(provider),
        self_attn_bda=get_bias_dropout_add,
    )
