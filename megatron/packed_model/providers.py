"""The backend spec providers of packed models and the norms they place.

* ``te``: `PackedTESpecProvider` (te_attention.py) = megatron-core's `TESpecProvider`
  (fused norm+linear) with `PackedTEDotProductAttention` (TE THD attention, no host syncs)
  and `PackedTESelfAttention` (the sync-free RoPE by gather, rotated by TE's fused kernel);
* ``torch`` / ``flash``: `VarlenSpecProvider` = megatron-core's `LocalSpecProvider`
  (torch norms, Megatron column/row-parallel linears) with `VarlenAttention` as the core
  attention and `PackedSelfAttention` (sync-free RoPE by gather). This is the path that runs
  where Transformer Engine is missing.

Where the provider does not fuse the norm into the following linear, the spec places a
separate norm module in front; its weights are saved under TE's fused names
(`te_checkpoint_keys`), and a norm TE's spec keeps separate saves TE's ``_extra_state``
(`TELayoutNorm`). The layer specs that use these live beside the graph-safe layers
(packed_graphs/specs.py).
"""

import torch
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron.packed_model.attention import PackedSelfAttention, VarlenAttention
from megatron.packed_upstream import model_layers


class VarlenSpecProvider(LocalSpecProvider):
    """LocalSpecProvider whose core attention is the TE-free `VarlenAttention`."""

    self_attention = PackedSelfAttention

    def __init__(self, attention_backend: str = "torch"):
        self.attention_backend = attention_backend

    def core_attention(self):
        return ModuleSpec(module=VarlenAttention, params={"backend": self.attention_backend})


def backend_provider(attention_backend: str) -> BackendSpecProvider:
    """Provider for a resolved attention backend ('te', 'flash' or 'torch')."""
    if attention_backend == "te":
        from megatron.packed_model.te_attention import PackedTESpecProvider  # imports TE

        return PackedTESpecProvider()
    return VarlenSpecProvider(attention_backend)


# Where Transformer Engine fuses a norm into the linear after it, the norm's weights are saved
# under that linear (``self_attention.linear_qkv.layer_norm_weight``). The TE-free spec's
# separate norms are saved under the same names, so Megatron-LM, the TE path and the TE-free
# path read each other's checkpoints (megatron-core's own local GPT spec maps them alike).
TE_FUSED_NORM_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    "norm.": "mixer.in_proj.layer_norm_",  # Mamba
}


def te_checkpoint_keys(provider: BackendSpecProvider, *norms: str) -> dict:
    """A layer's ``sharded_state_dict_keys_map`` for its separate ``norms`` (keys of
    `TE_FUSED_NORM_KEYS`) that TE's spec fuses; {} for a provider that fuses them itself."""
    if provider.fuse_layernorm_and_linear():
        return {}
    return {norm: TE_FUSED_NORM_KEYS[norm] for norm in norms}


class _EmptyTEState:
    """``_extra_state`` saved and read as megatron-core's local linears do theirs (None)."""

    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass


class _RMSNormWithTEState(_EmptyTEState, torch.nn.RMSNorm):
    pass


class _LayerNormWithTEState(_EmptyTEState, torch.nn.LayerNorm):
    pass


class TELayoutNorm:
    """megatron-core's torch norm (`WrappedTorchNorm`: same checks, same module, same
    numerics) that also saves the empty ``_extra_state`` entry Transformer Engine's norm
    saves. The TE-free spec builds it where TE's spec has a norm module of its own (the
    hybrid final norm, the MoE pre-MLP norm, q/k norms): Megatron-LM's TE spec asks for that
    entry when it loads, and fails on a checkpoint without it."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        norm = WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps, **kwargs)
        # The same module with two methods more: its state_dict gains `_extra_state`.
        return model_layers.norm_saving_te_extra_state(
            norm, {torch.nn.RMSNorm: _RMSNormWithTEState,
                   torch.nn.LayerNorm: _LayerNormWithTEState})


def _provider_norm(provider: BackendSpecProvider, normalization: str, for_qk: bool = False):
    return provider.layer_norm(rms_norm=normalization == "RMSNorm", for_qk=for_qk)


def own_norm(provider: BackendSpecProvider, normalization: str, for_qk: bool = False):
    """A norm module of its own (TE's spec has one too: see `TELayoutNorm`)."""
    norm = _provider_norm(provider, normalization, for_qk)
    return TELayoutNorm if norm is WrappedTorchNorm else norm


def norm_and_linear(provider: BackendSpecProvider, normalization: str):
    """(norm in front, column-parallel linear) — the norm is Identity when the linear fuses it.
    A TE-free norm here saves no ``_extra_state``: its keys map onto the fused linear's."""
    if provider.fuse_layernorm_and_linear():
        return IdentityOp, provider.column_parallel_layer_norm_linear()
    return _provider_norm(provider, normalization), provider.column_parallel_linear()
