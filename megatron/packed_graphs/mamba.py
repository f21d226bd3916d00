"""Packed-sequence subclasses of megatron-core's Mamba modules, entered through specs.

* `PackedMambaMixer` takes the document index of every token from `PackedBatchParams.seq_idx`
  (built once per micro-batch, no host sync) instead of rebuilding it per layer with the
  upstream ``repeat_interleave`` that reads the lengths back to the host.
* `HybridStack` is MambaStack with its final norm taken from the spec: 0.16.1 hard-codes
  ``TENorm`` there, which makes the stack unbuildable without Transformer Engine. It is
  also the hybrid model's chunk for chunk graphs (chunk_graphs.py).
"""

from dataclasses import dataclass
from typing import Union

from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron.packed_graphs.chunk_graphs import ChunkGraphDispatch
from megatron.packed_graphs.packed_seq import build_seq_idx


class PackedMambaMixer(MambaMixer):
    """MambaMixer whose packed ``seq_idx`` comes from the micro-batch's params."""

    def _create_packed_seq_idx(self, packed_seq_params, total_tokens: int):
        seq_idx = getattr(packed_seq_params, "seq_idx", None)
        if seq_idx is not None:
            return seq_idx
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        return build_seq_idx(cu_seqlens, total_tokens)


@dataclass
class HybridStackSubmodules(MambaStackSubmodules):
    """MambaStackSubmodules plus the final norm (``final_norm`` in checkpoints, as upstream)."""

    final_norm: Union[ModuleSpec, type] = IdentityOp


class HybridStack(ChunkGraphDispatch, MambaStack):
    """MambaStack with a spec-provided final norm (TE-free capable) and chunk graphs."""

    def __init__(self, config, submodules: HybridStackSubmodules, *args, post_layer_norm=True,
                 **kwargs):
        # The parent builds TENorm when post_layer_norm is set; build ours instead.
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and self.post_layer_norm:
            self.final_norm = build_module(
                submodules.final_norm,
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )
