"""megatron-core's HybridStack with its final norm taken from the spec.

Upstream hard-codes ``TENorm`` there, which makes the stack unbuildable without Transformer
Engine. Chunk graphs subclass `PackedHybridStack` (packed_graphs/layers.py,
`GraphSafeHybridStack`).
"""

from dataclasses import dataclass
from typing import Union

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class PackedHybridStackSubmodules(HybridStackSubmodules):
    """HybridStackSubmodules plus the final norm (``final_norm`` in checkpoints, as upstream)."""

    final_norm: Union[ModuleSpec, type] = IdentityOp


class PackedHybridStack(HybridStack):
    """HybridStack with a spec-provided final norm (TE-free capable)."""

    def __init__(self, config, submodules: PackedHybridStackSubmodules, *args, post_layer_norm=True,
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
