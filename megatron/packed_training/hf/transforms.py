"""Named tensor transforms between Hugging Face and Megatron layouts.

A `Transform` is a pair of pure functions: ``to_megatron(hf_tensors, dims) -> tensor`` and
``to_hf(tensor, dims) -> hf_tensors``, inverse of each other bit for bit (they only
reshape, concatenate, split and pad; no arithmetic on values). ``dims`` is the model's
`Dims` (head counts, sizes, vocabulary). Both run on meta tensors too, which is how the
mapping tables learn every Megatron shape from the Hugging Face shapes without reading data.

Shapes use PyTorch's ``[out_features, in_features]`` for linear weights in both layouts.
"""

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class Dims:
    """The sizes transforms need. ``vocab_size``: the Hugging Face vocabulary (rows of the
    embedding on disk); ``padded_vocab_size``: the Megatron rows (a multiple of
    ``--make-vocab-size-divisible-by`` x TP, at least ``vocab_size``)."""

    hidden_size: int
    num_attention_heads: int = 0
    num_query_groups: int = 0
    head_dim: int = 0
    vocab_size: int = 0
    padded_vocab_size: int = 0


@dataclass(frozen=True)
class Transform:
    """``name``: how the mapping tables and error messages call it. ``arity``: the number
    of Hugging Face tensors that make one Megatron tensor. ``rows``: set for a Megatron
    tensor that is rows ``[start, stop)`` of its one Hugging Face tensor (megatron-core
    saves some fused weights as separate sections); ``to_hf`` then gives that part, which
    the exporter puts together with the other sections."""

    name: str
    arity: int
    to_megatron: Callable[[Sequence[Tensor], Dims], Tensor]
    to_hf: Callable[[Tensor, Dims], Sequence[Tensor]]
    rows: tuple[int, int] | None = None


def _one(tensors: Sequence[Tensor]) -> Tensor:
    (tensor,) = tensors
    return tensor


IDENTITY = Transform("identity", 1, lambda hf, dims: _one(hf), lambda t, dims: [t])


def _fuse_qkv(hf: Sequence[Tensor], dims: Dims) -> Tensor:
    """q ``[A*D, H]``, k and v ``[G*D, H]`` -> megatron-core's fused QKV ``[(A + 2G)*D, H]``:
    query groups one after the other, each ``[its A/G query heads, its key, its value]``
    (attention.py splits each group's rows that way), so every TP rank holds whole groups."""
    q, k, v = hf
    groups, head = dims.num_query_groups, dims.head_dim
    per_group = dims.num_attention_heads // groups
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, per_group * head, *rest),
                       k.reshape(groups, head, *rest),
                       v.reshape(groups, head, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def _split_qkv(fused: Tensor, dims: Dims) -> list[Tensor]:
    groups, head = dims.num_query_groups, dims.head_dim
    per_group = dims.num_attention_heads // groups
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, (per_group + 2) * head, *rest).split(
        [per_group * head, head, head], dim=1)
    return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]


FUSE_QKV = Transform("fuse_qkv", 3, _fuse_qkv, _split_qkv)


def _fuse_gate_up(hf: Sequence[Tensor], dims: Dims) -> Tensor:
    """gate ``[F, H]`` and up ``[F, H]`` -> ``linear_fc1`` ``[2F, H]``: megatron-core's gated
    MLP chunks fc1's output in two and gates with the first half (mlp.py), and its checkpoint
    keeps the whole gate above the whole up projection at any TP (a sharded factory)."""
    gate, up = hf
    return torch.cat([gate, up], dim=0)


def _split_gate_up(fused: Tensor, dims: Dims) -> list[Tensor]:
    gate, up = fused.chunk(2, dim=0)
    return [gate.contiguous(), up.contiguous()]


FUSE_GATE_UP = Transform("fuse_gate_up", 2, _fuse_gate_up, _split_gate_up)


def _pad_vocab(hf: Sequence[Tensor], dims: Dims) -> Tensor:
    """``[V, H]`` -> ``[V_padded, H]``, the added rows zero: Megatron pads the vocabulary to a
    multiple of --make-vocab-size-divisible-by x TP; no token id reaches the added rows."""
    table = _one(hf)
    extra = dims.padded_vocab_size - table.shape[0]
    if extra < 0:
        raise ValueError(f"padded vocabulary {dims.padded_vocab_size} is below the "
                         f"checkpoint's {table.shape[0]} rows")
    if extra == 0:
        return table
    return torch.cat([table, table.new_zeros(extra, *table.shape[1:])], dim=0)


def _crop_vocab(table: Tensor, dims: Dims) -> list[Tensor]:
    """The first ``vocab_size`` rows; rows a smaller Megatron vocabulary lacks are zero."""
    rows = dims.vocab_size
    if table.shape[0] >= rows:
        return [table[:rows].contiguous()]
    return [torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])])]


PAD_VOCAB = Transform("pad_vocab", 1, _pad_vocab, _crop_vocab)


def section(name: str, start: int, stop: int) -> Transform:
    """Rows ``[start, stop)`` of one Hugging Face tensor as a Megatron tensor of their own
    (megatron-core's Mamba mixer saves its in_proj as z, x, B, C, dt and its conv1d as x, B,
    C: ssm/mamba_mixer.py ``sharded_state_dict``), so each section shards by itself at any TP."""
    return Transform(f"{name}[{start}:{stop}]", 1,
                     lambda hf, dims: _one(hf)[start:stop],
                     lambda t, dims: [t], rows=(start, stop))


def sections(prefix: str, sizes: Sequence[tuple[str, int]]) -> list[tuple[str, Transform]]:
    """[(section name, its `section` transform)] for consecutive ``(name, rows)`` sizes."""
    out, start = [], 0
    for name, size in sizes:
        out.append((name, section(f"{prefix}.{name}", start, start + size)))
        start += size
    return out
