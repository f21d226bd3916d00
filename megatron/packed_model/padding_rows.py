"""Padding rows held at exactly zero, so that FP8 scales see only document tokens.

A packed row has a fixed number of positions; those its documents leave free (the row's tail,
and under context parallelism each document's CP padding after its last token) hold no
token. FP8 takes its scales from the values a GEMM reads: tensorwise current scaling one
amax over all the rows of a GEMM input (all-reduced over TP under sequence parallelism),
delayed scaling an amax history, blockwise the 128-token column blocks of the weight
gradient. A padding row that is not zero (an embedding of the pad id, a bias, a static graph
buffer that held NaN) would move the scale of every document token.

With ``config.zero_padding_rows`` (set with ``--fp8-format``; fp8_flags.py refuses the
layer types whose padding rows could not be held at zero):

* `ZeroedPaddingRowsLayer` (`ZeroedPaddingRowsMambaLayer`): a layer's input rows that are
  padding are zero (a `torch.where`, so NaN or 1e30 left in a static buffer become 0 too),
  whatever produced them;
* `ZeroedProjectionInput` (`ZeroedPaddingRowsInput`): the input of an output projection is
  zeroed the same way: attention's core output (CP padding attends to its document; a QKV
  bias reaches padding rows through V) and Mamba's scan output (the conv bias and the D
  skip reach them).

With RMSNorm and no linear bias but QKV's, every other GEMM then reads zero padding rows:
the norm, the projections and the MLP activations map zero rows to zero rows. The loss mask
is 0 there, and the backward of `torch.where` is 0 on the rows it replaced, so the output
gradient of every GEMM is zero on padding rows too. MoE routers route no padding token
(moe.py). Without the flag nothing here runs: BF16 numbers are unchanged.

The mask is ``packed_seq_params.padding_mask`` (bool ``[T]``, True = padding, built once per
micro-batch by the training step), so it travels into every graph kind as a graph input.
"""

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor

from megatron.packed_upstream import model_layers


def layer_padding_mask(params, num_tokens: int, tp_group=None,
                       sequence_parallel: bool = False) -> Optional[Tensor]:
    """This rank's padding mask, ``[1, num_tokens]`` bool (True = padding), from the
    micro-batch's ``params.padding_mask`` (``[T]``, one entry per position this rank's layers
    hold before sequence parallelism); None when the params carry none.

    With sequence parallelism (``sequence_parallel`` and a ``tp_group`` of more than one
    rank) each TP rank holds a contiguous share of the positions. Host work only."""
    mask = getattr(params, "padding_mask", None)
    if mask is None:
        return None
    mask = mask.reshape(-1)
    if sequence_parallel and tp_group is not None and tp_group.size() > 1:
        mask = mask.view(tp_group.size(), -1)[tp_group.rank()]
    if mask.numel() != num_tokens:
        raise ValueError(f"packed_seq_params.padding_mask has {mask.numel()} entries for "
                         f"{num_tokens} tokens on this rank; build it from the same "
                         "micro-batch")
    return mask.view(1, -1)


def zero_padding_rows(x: Tensor, mask: Optional[Tensor]) -> Tensor:
    """``x`` (``[N, ...]``, a row per position) with the rows where ``mask`` (bool, ``N``
    entries) is True set to 0, NaN and inf included; ``x`` itself when ``mask`` is None.
    Differentiable: the replaced rows get a zero gradient. No host sync."""
    if mask is None:
        return x
    if mask.numel() != x.shape[0]:
        raise ValueError(f"padding mask has {mask.numel()} entries for {x.shape[0]} rows; "
                         "build it from the same micro-batch")
    return torch.where(mask.reshape(-1, *([1] * (x.dim() - 1))), 0.0, x)


def zeroes_padding_rows(config) -> bool:
    """Whether ``config`` (a TransformerConfig) asks for zero padding rows."""
    return bool(getattr(config, "zero_padding_rows", False))


class ZeroedLayerInput:
    """What the layer mixins below share: the layer input with its padding rows zeroed under
    ``config.zero_padding_rows`` (this rank's rows: its sequence-parallel share)."""

    def _zeroed_input(self, hidden_states: Tensor, params) -> Tensor:
        if not zeroes_padding_rows(self.config):
            return hidden_states
        if params is not None and getattr(params, "padding_mask", None) is None:
            raise ValueError("packed_seq_params.padding_mask is None under FP8: padding rows "
                             "would reach the FP8 scales. Stage the micro-batch with the "
                             "padding mask (packed_step.needs_padding_mask(args) is True for "
                             "FP8 runs)")
        # TransformerLayer keeps its process groups, MambaLayer only its TP group.
        tp_group = self.pg_collection.tp if hasattr(self, "pg_collection") else self.tp_group
        mask = layer_padding_mask(params, hidden_states.shape[0], tp_group,
                                  self.config.sequence_parallel)
        return zero_padding_rows(hidden_states, mask)


class ZeroedPaddingRowsLayer(ZeroedLayerInput):
    """Mixin for a TransformerLayer (attention, MLP or MoE): under ``config.zero_padding_rows``
    the padding rows of the layer's input are zero. The layer takes its input in
    ``_forward_attention``, which every path of megatron-core's layer runs first (``forward``,
    and the replay of partial MoE graphs). Put the mixin before the layer class in the bases."""

    def _forward_attention(self, hidden_states, *args, **kwargs):
        return super()._forward_attention(
            self._zeroed_input(hidden_states, kwargs.get("packed_seq_params")), *args, **kwargs)


class ZeroedPaddingRowsMambaLayer(ZeroedLayerInput):
    """`ZeroedPaddingRowsLayer` for a MambaLayer, which takes its input in ``forward``."""

    def forward(self, hidden_states, *args, **kwargs):
        return super().forward(
            self._zeroed_input(hidden_states, kwargs.get("packed_seq_params")), *args, **kwargs)


class PaddingRowsOfThisCall:
    """The padding mask of the forward in flight of a module whose output projection reads
    it (`ZeroedPaddingRowsInput`): set by the module's forward, cleared after."""

    def __init__(self):
        self.mask: Optional[Tensor] = None

    @contextmanager
    def of(self, params) -> Iterator[None]:
        """The mask of ``params`` (``padding_mask``, all of this rank's positions: before
        sequence parallelism's scatter) for the enclosed forward."""
        self.mask = getattr(params, "padding_mask", None)
        try:
            yield
        finally:
            self.mask = None


class ZeroedPaddingRowsInput:
    """Mixed into an output projection by `ZeroedProjectionInput`: the padding rows of the
    projection's input (``[N, ...]``, all of this rank's positions: before a row-parallel
    projection's reduce-scatter) are zero, from ``padding_rows.mask``. A mixin and not a
    forward pre-hook: megatron-core's layer graphs refuse every pre-forward hook but
    DDP's (``CudaGraphManager.call_ddp_preforward_hook``). Runs inside whatever graph captures
    the call."""

    padding_rows: PaddingRowsOfThisCall

    def forward(self, input_, *args, **kwargs):
        return super().forward(self.gemm_input(input_), *args, **kwargs)

    def gemm_input(self, input_: Tensor) -> Tensor:
        """``input_`` as the projection's GEMM reads it: this call's padding rows zero."""
        return zero_padding_rows(input_, self.padding_rows.mask)


class ZeroedProjectionInput:
    """Mixin for a module with an output projection (attention: ``linear_proj``; Mamba's
    mixer: ``out_proj``, set `projection`): under ``config.zero_padding_rows`` the padding
    rows of the projection's input are zero, from the ``packed_seq_params`` its forward
    takes. Put the mixin before the module class in the bases."""

    projection = "linear_proj"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._padding_rows = None  # BF16: the projection as built; forward passes through
        if zeroes_padding_rows(self.config):
            self._padding_rows = PaddingRowsOfThisCall()
            projection = getattr(self, self.projection)
            model_layers.mix_into_linear(projection, ZeroedPaddingRowsInput)
            projection.padding_rows = self._padding_rows

    def forward(self, *args, **kwargs):
        if self._padding_rows is None:
            return super().forward(*args, **kwargs)
        with self._padding_rows.of(kwargs.get("packed_seq_params")):
            return super().forward(*args, **kwargs)
