"""Transformer Engine core attention for packed (THD) micro-batches, free of host syncs.

megatron-core's `TEDotProductAttention` forwards `PackedSeqParams` to TE as it is. Two of TE
2.11's defaults then read GPU values back to the host, which a CUDA graph cannot capture:

* ``max_seqlen_q/kv`` left ``None`` are measured with ``.item()``;
* ``pad_between_seqs`` left ``None`` is detected with ``torch.equal(cu_seqlens_padded,
  cu_seqlens)``.

`PackedTEDotProductAttention` decides both on the host instead: ``max_seqlen`` must be given
(the training step passes the fixed packed length), and there is padding between sequences
exactly when the micro-batch carries ``cu_seqlens_*_padded`` as a tensor of its own (the
training step passes none without CP, and with CP the padded boundaries as both).

`PackedTESelfAttention` applies RoPE with TE's fused kernel to a per-token table gathered at
document-local positions (attention.PackedSelfAttention), not with TE's THD RoPE kernel:
that kernel launches a block per segment and table row (capacity x packed length under
graphs, where all but the tokens' blocks exit at once; 4.5 ms of a 23 ms step on an H200
for GPT 8 x 512 x 2048 at capacity 32), the gathered table one per token. The positions are
each rank's own under context parallelism, so the RoPE needs no CP group.

Dynamic CP: a micro-batch may carry its own CP group (``packed_seq_params.cp_group``,
or ``local_cp_size == 1`` for none). The core attention then runs TE's CP over that group,
as megatron-core's `TEDotProductAttention` does. Under a CUDA graph the group of the capture
is baked in, hence one bank of graphs per CP size (te_graphs.py).

Importing this module imports Transformer Engine.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron.core.extensions.transformer_engine import (
    TEDotProductAttention,
    fused_apply_rotary_pos_emb,
)
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.transformer.enums import AttnMaskType

from megatron.packed_upstream import graph_engine, model_layers
from megatron.packed_model.attention import PackedSelfAttention
from megatron.packed_model.dynamic_cp import micro_batch_cp_group

_PADDED_MASKS = {
    AttnMaskType.causal: "padding_causal",
    AttnMaskType.padding_causal: "padding_causal",
    AttnMaskType.no_mask: "padding",
    AttnMaskType.padding: "padding",
}


class PackedTEDotProductAttention(TEDotProductAttention):
    """`TEDotProductAttention` whose THD path passes every host-side choice explicitly.

    forward (THD): query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` -> ``[T, Hq * D]``, with
    ``packed_seq_params.max_seqlen_q/kv`` host ints. Non-THD inputs take the parent's path.
    No host sync on the THD path.
    """

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: AttnMaskType,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
        num_splits: Optional[int] = None,
    ) -> Tensor:
        params = packed_seq_params
        if params is None or params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params, num_splits)
        if attention_bias is not None:
            raise ValueError("PackedTEDotProductAttention does not take attention_bias on THD.")
        self._set_micro_batch_cp_group(params)
        if params.max_seqlen_q is None or params.max_seqlen_kv is None:
            raise ValueError(
                "packed_seq_params.max_seqlen_q/kv is None: Transformer Engine would measure it "
                "with a GPU->CPU sync. Pass the packed length (build_packed_batch_params does).")
        # Decided by identity, on the host: the same tensor means no padding between them.
        padded = params.cu_seqlens_q_padded is not None and (
            params.cu_seqlens_q_padded is not params.cu_seqlens_q)
        # TE's own forward, skipping the parent's, which would leave pad_between_seqs to TE.
        return model_layers.te_dot_product_attention_forward(
            self, query, key, value, None,
            qkv_format="thd",
            attn_mask_type=_PADDED_MASKS[attn_mask_type],
            cu_seqlens_q=params.cu_seqlens_q,
            cu_seqlens_kv=params.cu_seqlens_kv,
            cu_seqlens_q_padded=params.cu_seqlens_q_padded,
            cu_seqlens_kv_padded=params.cu_seqlens_kv_padded,
            max_seqlen_q=params.max_seqlen_q,
            max_seqlen_kv=params.max_seqlen_kv,
            pad_between_seqs=padded,
            **({"num_splits": num_splits} if num_splits is not None else {}),
        )

    def _set_micro_batch_cp_group(self, params) -> None:
        """Dynamic CP: point TE's CP at the micro-batch's group (host only, no sync)."""
        group = micro_batch_cp_group(params)
        if group is not None:
            self.set_context_parallel_group(group, torch.distributed.get_process_group_ranks(group),
                                            graph_engine.te_cp_stream(), self.cp_comm_type)
        elif params.local_cp_size == 1:
            self.set_context_parallel_group(None, None, None, self.cp_comm_type)


class PackedTESelfAttention(PackedSelfAttention):
    """The TE spec's self-attention: the packed RoPE by gather (see module doc), rotated by
    TE's fused kernel over the ``[T, b, h, d]`` tokens (one block per token)."""

    rotates_interleaved = True

    def rotate(self, t: Tensor, freqs: Tensor) -> Tensor:
        return fused_apply_rotary_pos_emb(t, freqs, interleaved=self.config.rotary_interleaved)


class PackedTESpecProvider(TESpecProvider):
    """megatron-core's TE spec provider with the sync-free THD core attention (see specs.py)."""

    self_attention = PackedTESelfAttention

    def core_attention(self):
        return PackedTEDotProductAttention
