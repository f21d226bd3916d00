"""TE-free attention for packed (THD) sequences.

Two modules, both entered through layer specs:

* `VarlenAttention`: the core attention (softmax(QK^T)V over each document) for THD inputs,
  backed by PyTorch's ``torch.nn.attention.varlen.varlen_attn`` or flash-attn's
  ``flash_attn_varlen_func``; both run FlashAttention-2 kernels that take the maximum
  sequence length as a host int and capture cleanly in a CUDA graph. Without CUDA it runs an
  exact per-document SDPA reference (slow; it reads ``cu_seqlens`` on the host) so that
  models can be built and checked on CPU.
* `PackedSelfAttention`: megatron-core's SelfAttention with a sync-free THD RoPE. Upstream's
  unfused THD RoPE splits by ``cu_seqlens.tolist()``; here the rotary table is gathered at
  each token's document-local position (``PackedBatchParams.position_ids``), which is the
  same rotation without reading anything back to the host.
"""

import importlib.util
import inspect
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.packed_model.padding_rows import ZeroedProjectionInput

ATTENTION_BACKENDS = ("auto", "te", "flash", "torch")


def is_te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def is_flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention_backend(name: str) -> str:
    """Turn ``--attention-backend`` into the backend that will run: 'te', 'flash' or 'torch'.

    'auto' prefers Transformer Engine, then flash-attn, then PyTorch's varlen attention.
    An explicit choice whose package is missing is an error (never a silent downgrade).
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"--attention-backend is wrong: {name!r}. Choose one of {', '.join(ATTENTION_BACKENDS)}."
        )
    if name == "auto":
        if is_te_available():
            return "te"
        return "flash" if is_flash_attn_available() else "torch"
    if name == "te" and not is_te_available():
        raise ValueError(
            "--attention-backend flash/fused/unfused (Transformer Engine's) needs Transformer "
            "Engine, which is not importable. Install it (pip install .[te]) or use "
            "--attention-backend local."
        )
    if name == "flash" and not is_flash_attn_available():
        raise ValueError(
            "flash-attn's varlen attention needs flash-attn, which is not importable. "
            "Install it (pip install .[flash]) or use --attention-backend local."
        )
    return name


def _torch_varlen_attn():
    # Imported lazily: the module exists from torch 2.9 on.
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def _varlen_supports_gqa() -> bool:
    return "enable_gqa" in inspect.signature(_torch_varlen_attn()).parameters


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def reference_varlen_attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float
) -> Tensor:
    """Exact causal attention per document with SDPA. ``[T, Hq, D]`` in and out.

    Syncs once: reads ``cu_seqlens`` on the host. A reference for CPU and tests, not for graphs.
    """
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()  # deliberate host sync (reference path only)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
            out[start:end] = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale
            ).transpose(0, 1)
    # Tokens after the last boundary (none when cu_seqlens[-1] == T) are never attended.
    if bounds[-1] < query.shape[0]:
        out[bounds[-1] :] = 0
    return out


class VarlenAttention(MegatronModule):
    """Causal core attention over packed documents (THD), TE-free.

    Same constructor as megatron-core's DotProductAttention, so specs can swap it in.
    forward: query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` (Attention squeezes the batch
    dim for THD) -> ``[T, Hq * D]``. ``packed_seq_params.max_seqlen_q`` is read as a host int;
    nothing else crosses to the host on CUDA in bf16 / fp16 (fp32 runs the exact reference).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        backend: str = "torch",
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(
                f"VarlenAttention supports causal masks only, got {attn_mask_type}. "
                "Use a causal self-attention spec."
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"--attention-dropout is wrong for the varlen backends: {dropout}. "
                "Set --attention-dropout 0 or use Transformer Engine's attention (--attention-backend auto with TE installed)."
            )
        if config.context_parallel_size > 1:
            raise ValueError(
                "--context-parallel-size > 1 needs Transformer Engine attention. "
                "Use Transformer Engine's attention (--attention-backend auto with TE installed)."
            )
        if backend not in ("torch", "flash"):
            raise ValueError(f"VarlenAttention backend must be 'torch' or 'flash', got {backend!r}.")
        self.backend = backend
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.deterministic = config.deterministic_mode

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError(
                "VarlenAttention runs packed (THD) batches only; pass packed_seq_params "
                "with qkv_format='thd' (the training scripts always do)."
            )
        if attention_bias is not None:
            raise ValueError("VarlenAttention does not support attention_bias.")
        cu_seqlens = packed_seq_params.cu_seqlens_q
        max_seqlen = packed_seq_params.max_seqlen_q
        if not query.is_cuda or query.dtype == torch.float32:
            # FlashAttention kernels take fp16 / bf16 only: fp32 (checks against a reference,
            # debugging) runs the exact per-document path, which reads cu_seqlens on the host.
            if query.is_cuda and torch.cuda.is_current_stream_capturing():
                raise ValueError("TE-free attention in fp32 cannot run under CUDA graphs (no "
                                 "fp32 FlashAttention kernel): train with --bf16 or --fp16, "
                                 "or use Transformer Engine's attention.")
            out = reference_varlen_attention(query, key, value, cu_seqlens, self.softmax_scale)
        elif self.backend == "flash":
            from flash_attn import flash_attn_varlen_func

            out = flash_attn_varlen_func(
                query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                dropout_p=0.0, softmax_scale=self.softmax_scale, causal=True,
                deterministic=self.deterministic,
            )
        else:
            out = self._torch_varlen(query, key, value, cu_seqlens, max_seqlen)
        return out.reshape(out.shape[0], -1)

    def _torch_varlen(self, query, key, value, cu_seqlens, max_seqlen):
        varlen_attn = _torch_varlen_attn()
        extra = {}
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            if _varlen_supports_gqa():
                extra["enable_gqa"] = True
            else:
                key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
        # window_size=(-1, 0) is causal attention within each document.
        return varlen_attn(
            query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
            scale=self.softmax_scale, window_size=(-1, 0), **extra,
        )


def apply_rotary_per_token(t: Tensor, freqs: Tensor) -> Tensor:
    """Rotate ``t`` ``[T, b, h, d]`` by per-token angles ``freqs`` ``[T, 1, 1, rot_dim]``.

    Non-interleaved (rotate-half) RoPE on the first ``rot_dim`` channels; the rest pass through.
    """
    rot_dim = freqs.shape[-1]
    rot, passthrough = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    first, second = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((rotated, passthrough), dim=-1) if passthrough.numel() else rotated


class PackedSelfAttention(ZeroedProjectionInput, SelfAttention):
    """SelfAttention whose THD RoPE is a gather at document-local positions (no host sync).

    For THD inputs with a rotary table, ``forward`` gathers per-token angles
    ``rotary_pos_emb[position_ids]`` and runs the parent with ``rotary_pos_emb=None``; the
    rotation (`rotate`) is applied in ``get_query_key_value_tensors`` (the one hook between
    the QKV projection and core attention). Other inputs take the parent's path unchanged.

    The work is linear in the tokens whatever the segment count and ``max_seqlen``: under
    graphs those are the capacity and the packed length, and a kernel over segments x
    ``max_seqlen`` would launch for all of them.
    """

    rotates_interleaved = False  # `rotate` below rotates halves only

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.rotary_interleaved and not self.rotates_interleaved:
            raise ValueError(
                "rotary_interleaved is not supported by the TE-free packed RoPE. Use the "
                "default (non-interleaved) rotary embedding, or the TE spec."
            )
        # Per-token angles of the forward in flight; set and cleared by forward().
        self._token_freqs: Optional[Tensor] = None

    def rotate(self, t: Tensor, freqs: Tensor) -> Tensor:
        """``t`` ``[T, b, h, d]`` rotated by per-token angles ``freqs`` ``[T, 1, 1, rot_dim]``."""
        return apply_rotary_per_token(t, freqs)

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        rotary_pos_emb = kwargs.get("rotary_pos_emb")
        params = kwargs.get("packed_seq_params")
        if rotary_pos_emb is None or params is None or params.qkv_format != "thd":
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        if isinstance(rotary_pos_emb, tuple):  # self-attention: q and k share the table
            rotary_pos_emb = rotary_pos_emb[0]
        self._token_freqs = rotary_pos_emb[params.position_ids]
        try:
            return super().forward(
                hidden_states, attention_mask, *args, **{**kwargs, "rotary_pos_emb": None}
            )
        finally:
            self._token_freqs = None

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        qkv = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
        )
        if self._token_freqs is None:
            return qkv
        query, key, *rest = qkv
        query = self.rotate(query, self._token_freqs)
        key = self.rotate(key, self._token_freqs)
        return (query, key, *rest)
