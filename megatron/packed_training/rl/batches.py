"""A framework's packed micro-batch, checked and laid out as the packed training step reads it.

A framework hands over each micro-batch as whole sequences (a prompt and its response, a
document) back to back: `PackedSequences`. Everything that is per token is **token
aligned**: value ``t`` belongs to token ``t`` as a prediction target, i.e. to the
prediction of token ``t`` from the tokens before it in its sequence. A sequence's first
token is predicted by nothing, so its value is ignored (its log-prob comes back as 0).

`lay_out` turns it into the collated micro-batch of the data path (packing.py's contract:
a sequence of ``L`` tokens gives ``L - 1`` training positions, position ``j`` reads token
``j`` and predicts token ``j + 1``; the rest of the row is one padding segment), plus the
per-token loss tensors shifted the same way and the `RowLayout` that maps positions back to
tokens. Host work only: token ids and tensors stay on the device they came on (a CUDA
tensor is gathered on the GPU), and nothing is read back from a device.

`check_values` is the input health check: one host read over every micro-batch of a call
finds token ids outside the vocabulary and non-finite loss tensors (a NaN advantage), and
raises naming the micro-batch, the tensor and the fix, before anything is trained on.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from megatron.packed_training.datasets.balance import deal_to_ranks
from megatron.packed_training.datasets.packing import (
    PAD_TOKEN_ID,
    pad_to_multiple,
    segment_position_ids,
)
from megatron.packed_training.datasets.row_plan import plan_rows

LOSS_WEIGHTS = "loss_weights"
SEQUENCE_IDS = "sequence_ids"  # each position's sequence (of those it predicts; -1: padding)


@dataclass
class PackedSequences:
    """One packed micro-batch of whole sequences, as a framework hands it over.

    Attributes:
        tokens: integer ``[N]``, the token ids of the sequences back to back (host or device).
        lengths: tokens per sequence, ``[D]`` summing to ``N`` (a list or a host tensor), or
            None when ``cu_seqlens`` is given.
        cu_seqlens: ``[D + 1]`` sequence boundaries (``0 ... N``, host), or None when
            ``lengths`` is given. Exactly one of the two.
        loss_weights: float ``[N]``, each token's weight as a prediction target (e.g. 1 on
            response tokens, 0 on the prompt), or None: every token weighs 1.
        tensors: per-token loss tensors by name, each float (or bool) ``[N]``, token aligned
            like ``loss_weights``: advantages, old and reference log-probs, masks. They reach
            the loss function position aligned (`LossInputs`).
        indices: which of the caller's sequences these are, in order (`pack_sequences` sets
            it: the order it packed them in), or None.

    A micro-batch of no sequence (``lengths=[]``, no tokens) is allowed: it runs a row of
    padding that weighs nothing, so that data-parallel ranks with fewer sequences still run
    as many micro-batches as the others (`deal_micro_batches`).
    """

    tokens: Tensor
    lengths: Optional[Sequence[int]] = None
    cu_seqlens: Optional[Sequence[int]] = None
    loss_weights: Optional[Tensor] = None
    tensors: Dict[str, Tensor] = field(default_factory=dict)
    indices: Optional[Sequence[int]] = None

    @classmethod
    def empty(cls, tensor_names: Sequence[str] = (), device=None) -> "PackedSequences":
        """A micro-batch of no sequence, carrying empty ``tensor_names`` tensors."""
        return cls(torch.zeros(0, dtype=torch.long, device=device), lengths=[],
                   loss_weights=torch.zeros(0, device=device),
                   tensors={name: torch.zeros(0, device=device) for name in tensor_names},
                   indices=[])


@dataclass(frozen=True)
class RowLayout:
    """Where a micro-batch's tokens sit in its packed row (host tensors).

    ``inputs``: int64 ``[P]``, the token read at each of the ``P`` used positions;
    ``targets``: int64 ``[P]``, the token each position predicts (``inputs + 1``);
    ``num_tokens``: ``N``; ``row_positions``: ``S``, positions of the row (``P <= S``);
    ``positions``: int64 ``[P]``, the row position of each used position where sequences
    carry padding of their own (context parallelism: each padded to a multiple of
    ``2 x CP``), else None (they are the row's first ``P``).
    """

    inputs: Tensor
    targets: Tensor
    num_tokens: int
    row_positions: int
    positions: Optional[Tensor] = None

    def to_tokens(self, per_position: Tensor) -> Tensor:
        """``[S]`` (or ``[1, S]``) per-position values -> ``[N]`` per token, token aligned: a
        sequence's first token (and a one-token sequence) gets 0. Device work only."""
        values = per_position.reshape(-1)
        out = torch.zeros(self.num_tokens, dtype=values.dtype, device=values.device)
        used = self.targets.numel()
        if self.positions is None:
            values = values[:used]
        else:
            values = values.index_select(0, self.positions.to(values.device, non_blocking=True))
        out.index_copy_(0, self.targets.to(values.device, non_blocking=True), values)
        return out


def _boundaries(mb: PackedSequences, where: str, num_tokens: int) -> np.ndarray:
    """The sequences' cu_seqlens on the host, checked."""
    given = [name for name in ("lengths", "cu_seqlens") if getattr(mb, name) is not None]
    if len(given) != 1:
        raise ValueError(f"{where} is wrong: {' and '.join(given) or 'neither lengths nor '
                         f'cu_seqlens'} given. Give the sequences' lengths or their cu_seqlens, "
                         f"one of the two.")
    name = given[0]
    value = getattr(mb, name)
    if torch.is_tensor(value):
        if value.device.type != "cpu":
            raise ValueError(f"{where}: {name} is wrong: a {value.device.type} tensor. Give "
                             f"it on the host (a list or a CPU tensor): the graph plan reads it "
                             f"before anything reaches the GPU.")
        value = value.tolist()
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"{where}: {name} is wrong: shape {array.shape}, dtype {array.dtype}. "
                         f"Give a 1-D list of integers.")
    array = array.astype(np.int64)
    if name == "lengths":
        if (array < 1).any():
            raise ValueError(f"{where}: lengths is wrong: {array.tolist()[:8]}. Give each "
                             f"sequence's tokens, at least one each.")
        cu = np.concatenate([[0], np.cumsum(array)]).astype(np.int64)
    else:
        cu = array
        if cu.size < 1 or cu[0] != 0 or (np.diff(cu) < 1).any():
            raise ValueError(f"{where}: cu_seqlens is wrong: {cu.tolist()[:8]}. It starts at "
                             f"0 and rises by at least one token per sequence.")
    if cu[-1] != num_tokens:
        raise ValueError(f"{where}: {name} is wrong: the sequences hold {int(cu[-1])} tokens, "
                         f"tokens has {num_tokens}. They must cover the tokens exactly.")
    return cu


def _per_token(name: str, value, where: str, num_tokens: int) -> Tensor:
    """A per-token loss tensor, checked: ``[N]``, floating point or bool (-> float32)."""
    if not torch.is_tensor(value):
        raise ValueError(f"{where}: {name} is wrong: a {type(value).__name__}. Give a tensor "
                         f"of one value per token, shape ({num_tokens},).")
    if tuple(value.shape) != (num_tokens,):
        raise ValueError(f"{where}: {name} is wrong: shape {tuple(value.shape)}, expected "
                         f"({num_tokens},). Give one value per token of the micro-batch, token "
                         f"aligned (a sequence's first token is ignored).")
    if not (value.is_floating_point() or value.dtype is torch.bool):
        raise ValueError(f"{where}: {name} is wrong: dtype {value.dtype}. Per-token loss "
                         f"tensors are floating point (or bool masks); pass {name}.float().")
    return value.float()


def lay_out(mb: PackedSequences, index: int, row_positions: int,
            names: Optional[Sequence[str]] = None, segment_multiple: int = 1) -> dict:
    """Check micro-batch ``index`` and lay it out in a row of ``row_positions`` positions.

    ``names``: the per-token tensors every micro-batch of the call must carry (None: any).
    ``segment_multiple``: each sequence's positions padded to a multiple of it, the padding
    after its last position (context parallelism: ``2 x CP``, as the packer pads documents).
    Returns the collated micro-batch of the data path (packing.collate_packed_rows' keys, one
    row) plus ``loss_tensors`` (name -> float32 ``[1, S]``, position aligned, 0 on padding)
    and ``layout`` (`RowLayout`). Raises ValueError naming the micro-batch and what is wrong.
    """
    where = f"micro-batch {index}"
    tokens = mb.tokens
    if not torch.is_tensor(tokens) or tokens.dim() != 1 or tokens.is_floating_point() \
            or tokens.dtype is torch.bool:
        shown = (f"shape {tuple(tokens.shape)}, dtype {tokens.dtype}" if torch.is_tensor(tokens)
                 else f"a {type(tokens).__name__}")
        raise ValueError(f"{where}: tokens is wrong: {shown}. Give a 1-D integer tensor of "
                         f"token ids, the sequences back to back.")
    num_tokens = tokens.numel()
    cu = _boundaries(mb, where, num_tokens)
    lengths = np.diff(cu)
    used = lengths[lengths > 1] - 1  # positions per sequence; a one-token one predicts nothing
    padded = pad_to_multiple(used, segment_multiple)  # the row positions each sequence takes
    positions = int(padded.sum())
    if positions > row_positions:
        padding = (f"; {int(used.sum())} before each sequence is padded to a multiple of "
                   f"{segment_multiple}, 2 x the context parallel size"
                   if segment_multiple > 1 else "")
        raise ValueError(f"{where} is wrong: its sequences hold {positions} training positions "
                         f"(tokens minus one per sequence{padding}), more than a packed row's "
                         f"{row_positions} (micro_batch_size x seq_length). Split it across "
                         f"more micro-batches, or raise seq_length.")
    if positions == 0 and len(lengths):
        raise ValueError(f"{where} is wrong: no sequence has two tokens, so nothing is "
                         f"predicted. Leave it out (or pass PackedSequences.empty()).")
    tensors = {LOSS_WEIGHTS: (mb.loss_weights if mb.loss_weights is not None
                              else torch.ones(num_tokens))}
    tensors |= dict(mb.tensors)
    for reserved in (LOSS_WEIGHTS, SEQUENCE_IDS):
        if reserved in mb.tensors:
            raise ValueError(f"{where}: tensors is wrong: it names {reserved!r}, which the "
                             f"library fills itself. Rename it.")
    if names is not None and sorted(mb.tensors) != sorted(names):
        raise ValueError(f"{where}: tensors is wrong: {sorted(mb.tensors)}, other micro-batches "
                         f"carry {sorted(names)}. Every micro-batch of a call carries the same "
                         f"per-token tensors.")
    tensors = {name: _per_token(name, value, where, num_tokens)
               for name, value in tensors.items()}

    starts = cu[:-1][lengths > 1]
    inputs = torch.from_numpy((np.repeat(starts, used) + segment_position_ids(used))
                              .astype(np.int64))
    # Row positions of the used positions where sequences carry padding (else the first P).
    in_row = None
    if (padded != used).any():
        in_row = torch.from_numpy(np.repeat(np.cumsum(padded) - padded, used)
                                  + segment_position_ids(used))
    layout = RowLayout(inputs, inputs + 1, num_tokens, row_positions, in_row)
    pad = row_positions - positions
    segments = np.append(padded, pad) if pad else padded
    cu_seqlens = np.zeros(len(segments) + 1, dtype=np.int32)
    np.cumsum(segments, out=cu_seqlens[1:])

    def row(values: Tensor, index_: Tensor, fill) -> Tensor:
        # index_select, not values[index_]: on the host, advanced indexing runs on torch's
        # thread pool even at this size and took ~2 ms a row on a busy 64-core host.
        picked = values.index_select(0, index_.to(values.device, non_blocking=True))
        if in_row is not None:
            out = torch.full((row_positions,), fill, dtype=picked.dtype, device=picked.device)
            return out.index_copy_(0, in_row.to(picked.device, non_blocking=True),
                                   picked).reshape(1, row_positions)
        tail = torch.full((pad,), fill, dtype=picked.dtype, device=picked.device)
        return torch.cat([picked, tail]).reshape(1, row_positions)

    weights = tensors.pop(LOSS_WEIGHTS)
    used_positions = in_row if in_row is not None else slice(0, positions)
    # Float, as every loss tensor (exact below 2**24 sequences a micro-batch).
    sequence_ids = torch.full((1, row_positions), -1.0)
    # Numbered densely over the sequences that hold a position (one-token sequences hold
    # none): every id stays below the positions of a rank's share, the per-sequence scatters'
    # size.
    sequence_ids[0, used_positions] = torch.from_numpy(
        np.repeat(np.arange(len(used)), used).astype(np.float32))
    padding_mask = torch.ones(1, row_positions, dtype=torch.bool)
    padding_mask[0, used_positions] = False
    return {
        "tokens": row(tokens.long(), layout.inputs, PAD_TOKEN_ID),
        "labels": row(tokens.long(), layout.targets, PAD_TOKEN_ID),
        "loss_mask": row(weights, layout.targets, 0.0),
        "position_ids": torch.from_numpy(segment_position_ids(segments)).reshape(1, -1),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        "num_segments": len(segments),
        "num_documents": len(used),
        "padding_mask": padding_mask,
        "max_seqlen": int(segments.max()),
        "loss_tensors": {name: row(value, layout.targets, 0.0) for name, value in tensors.items()}
        | {SEQUENCE_IDS: sequence_ids},
        "layout": layout,
    }


def lay_out_all(micro_batches: Sequence[PackedSequences], row_positions: int,
                segment_multiple: int = 1) -> List[dict]:
    """`lay_out` for every micro-batch of a call; they must all carry the same tensors."""
    if isinstance(micro_batches, PackedSequences) or not len(micro_batches):
        raise ValueError("micro_batches is wrong: give a non-empty list of PackedSequences, "
                         "one per micro-batch.")
    for index, mb in enumerate(micro_batches):
        if not isinstance(mb, PackedSequences):
            raise ValueError(f"micro-batch {index} is wrong: a {type(mb).__name__}. Give "
                             f"megatron.packed_training.rl.PackedSequences.")
    names = sorted(micro_batches[0].tensors)
    return [lay_out(mb, index, row_positions, names, segment_multiple)
            for index, mb in enumerate(micro_batches)]


class _SequenceLengths:
    """Sequence lengths as the packer's document source (it reads nothing else)."""

    def __init__(self, lengths: Sequence[int]):
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def origin(self, index: int) -> str:
        return f"sequence {index}"


def pack_sequences(tokens: Sequence[Tensor], row_positions: int, *,
                   loss_weights: Optional[Sequence[Tensor]] = None,
                   tensors: Optional[Mapping[str, Sequence[Tensor]]] = None,
                   algorithm: str = "best-fit-decreasing", max_sequences: Optional[int] = None,
                   seed: int = 0, segment_multiple: int = 1) -> List[PackedSequences]:
    """Whole sequences -> micro-batches of one row of ``row_positions`` positions each (a
    sequence of ``L`` tokens takes ``L - 1``), by the data path's packer (`row_plan`):
    ``best-fit-decreasing`` (seeded; nearly no padding) or ``in-order`` (as many sequences
    per micro-batch as fit, in order). ``max_sequences``: at most that many per micro-batch
    (give the policy's graph capacity minus one, so every micro-batch replays a graph).
    ``segment_multiple``: each sequence's positions padded to a multiple of it, as the policy
    lays them out (give ``policy.segment_multiple``: 2 x the context parallel size).

    ``tokens``: one 1-D tensor per sequence; ``loss_weights`` and each of ``tensors`` (name
    -> one tensor per sequence): token aligned, one per sequence. Each micro-batch's
    ``indices`` says which sequences it holds, in order: results per micro-batch (log-probs)
    map back through it. A sequence longer than a row raises naming it. Host bookkeeping;
    the tensors are concatenated where they are."""
    tensors = dict(tensors or {})
    for name, values in [("loss_weights", loss_weights), *tensors.items()]:
        if values is not None and len(values) != len(tokens):
            raise ValueError(f"{name} is wrong: {len(values)} tensors for {len(tokens)} "
                             f"sequences. Give one per sequence.")
    lengths = [len(sequence) for sequence in tokens]
    for index, length in enumerate(lengths):
        if length - 1 > row_positions:
            raise ValueError(f"sequence {index} is wrong: {length} tokens, more than a "
                             f"packed row's {row_positions} positions + 1. Truncate it, or "
                             f"raise seq_length.")
    # One-token sequences predict nothing but are kept (their log-prob is 0): size 1 here.
    plan = plan_rows(_SequenceLengths([max(n, 2) for n in lengths]), row_positions,
                     long_document_policy="reject", algorithm=algorithm, seed=seed,
                     max_documents=max_sequences, segment_multiple=segment_multiple)
    groups = [plan.documents[plan.row_starts[k]:plan.row_starts[k + 1]].tolist()
              for k in range(len(plan))]

    def joined(values, group):
        return torch.cat([values[i] for i in group])

    return [PackedSequences(
        joined(tokens, group), lengths=[lengths[i] for i in group],
        loss_weights=None if loss_weights is None else joined(loss_weights, group),
        tensors={name: joined(values, group) for name, values in tensors.items()},
        indices=group)
        for group in groups]


def deal_micro_batches(micro_batches: Sequence[PackedSequences], data_parallel_size: int
                       ) -> List[List[PackedSequences]]:
    """Each data-parallel rank's micro-batches: the same number on every rank, near-equal
    tokens (longest first, each to the rank with the fewest tokens that has room), ranks with
    fewer padded with `PackedSequences.empty` micro-batches, so no rank waits in a collective
    (the expert-parallel all-to-all) for another that has run out. Host bookkeeping."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size is wrong: {data_parallel_size}. Give >= 1.")
    per_rank = -(-len(micro_batches) // data_parallel_size)
    dealt = deal_to_ranks([mb.tokens.numel() for mb in micro_batches], data_parallel_size,
                          per_rank)
    ranks = [[micro_batches[index] for index in taken] for taken in dealt]
    names = sorted(micro_batches[0].tensors) if micro_batches else []
    device = micro_batches[0].tokens.device if micro_batches else None
    for taken in ranks:
        taken.extend(PackedSequences.empty(names, device) for _ in range(per_rank - len(taken)))
    return ranks


def check_values(batches: Sequence[dict], vocab_size: int) -> None:
    """The input health check of a call's laid-out micro-batches: token ids within
    ``[0, vocab_size)`` and every loss tensor finite (loss weights included). One host read
    for the whole call (none beyond that; with host tensors, no device work at all).

    Raises ValueError naming the first bad micro-batch and tensor and the fix: a NaN in an
    advantage would make every gradient NaN, and a loss weight of 0 does not mask it
    (``0 * nan`` is nan).
    """
    flags, names = [], []
    for index, batch in enumerate(batches):
        ids = torch.cat([batch["tokens"], batch["labels"]])  # what the model reads or predicts
        flags.append(((ids >= 0) & (ids < vocab_size)).all())
        names.append((index, "tokens"))
        for name, value in {LOSS_WEIGHTS: batch["loss_mask"], **batch["loss_tensors"]}.items():
            flags.append(torch.isfinite(value).all())
            names.append((index, name))
    # Gathered on the device where any flag is (host flags are copied there), read once.
    device = next((flag.device for flag in flags if flag.device.type != "cpu"),
                  torch.device("cpu"))
    ok = torch.stack([flag.to(device) for flag in flags]).tolist()  # the one host read
    for good, (index, name) in zip(ok, names):
        if good:
            continue
        if name == "tokens":
            raise ValueError(f"micro-batch {index}: tokens is wrong: an id outside [0, "
                             f"{vocab_size}), the model's vocabulary. Check the tokenizer and "
                             f"the padded vocabulary size of the config.")
        raise ValueError(f"micro-batch {index}: {name} is wrong: it holds NaN or infinite "
                         f"values. Training on it would make every gradient NaN (a loss "
                         f"weight of 0 does not mask it: 0 * nan is nan). Fix where {name} is "
                         f"computed (e.g. a reward or advantage over a group whose rewards "
                         f"are all equal), or set those values to 0.")
