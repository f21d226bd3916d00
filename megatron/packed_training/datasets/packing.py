"""Packed rows of tokenized documents, and the micro-batch contract.

A document of ``L`` tokens gives ``L - 1`` training positions: position ``j`` reads token
``input_ids[j]`` and predicts ``input_ids[j + 1]``. A row holds whole documents back to back,
each its own segment of ``cu_seqlens`` with positions restarting at 0, so attention (and
Mamba's scan) never crosses a document boundary. The unused end of a row is one more segment
of pad tokens whose loss mask is 0. A document longer than a row follows the long-document
policy (`admit_lengths`, the one admission rule every packer applies).

Everything here is host-side numpy until `collate_packed_rows` hands torch CPU tensors to the
training loop.
"""

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

PAD_TOKEN_ID = 0
"""Token and label id of the padding tail. Synthetic data never emits it as a real token."""


@dataclass(frozen=True, eq=False)
class Document:
    """One tokenized document, as read from the data source.

    Attributes:
        input_ids: int64 ``[L]`` token ids.
        loss_mask: float32 ``[L]`` or None (every token counts). ``loss_mask[j]`` says whether
            token ``j`` is a prediction target, so ``loss_mask[0]`` is never used.
        origin: where the document came from, e.g. ``"data.jsonl:12"``; quoted in errors.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray | None
    origin: str

    def __post_init__(self):
        if self.input_ids.ndim != 1 or not np.issubdtype(self.input_ids.dtype, np.integer):
            raise ValueError(
                f"Document input_ids is wrong: {self.origin} has shape {self.input_ids.shape}, "
                f"dtype {self.input_ids.dtype}. Pass a 1-D integer array."
            )
        if self.loss_mask is not None and self.loss_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"Document loss_mask is wrong: {self.origin} has {self.loss_mask.shape[0]} mask "
                f"values for {self.input_ids.shape[0]} tokens. Give one mask value per token."
            )


@dataclass(frozen=True, eq=False)
class PackedRow:
    """One packed row of ``S = seq_length`` training positions.

    Attributes:
        tokens: int64 ``[S]`` model inputs.
        labels: int64 ``[S]`` next token of each input, always within the same document.
        loss_mask: float32 ``[S]``, 1.0 where the label counts, 0.0 elsewhere and on padding.
        position_ids: int64 ``[S]``, restarting at 0 in every segment (padding included).
        cu_seqlens: int32 ``[n_segments + 1]``, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == S``;
            every segment has at least one position.
        num_documents: real documents in the row. A padding tail adds one segment, so
            ``n_segments`` is ``num_documents`` (exact fit) or ``num_documents + 1``.
        cu_seqlens_actual: int32 ``[n_segments + 1]`` when segments carry padding of their own
            (packed with ``segment_multiple > 1``, for context parallelism): cumulative
            unpadded lengths, Transformer Engine's ``cu_seqlens`` next to ``cu_seqlens`` as
            its ``cu_seqlens_padded``. None when no segment has inner padding.
        cp_size: the CP size the row was packed for under dynamic CP (its length is
            ``cp_size`` x tokens per rank); 1 otherwise.
    """

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    num_documents: int
    cu_seqlens_actual: np.ndarray | None = None
    cp_size: int = 1

    @property
    def num_segments(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def real_positions(self) -> int:
        """Positions holding document tokens (not padding): what data-parallel balance weighs."""
        return int((~row_padding_mask(self)).sum())


LONG_DOCUMENT_POLICIES = ("truncate", "split", "reject")
"""What a packer does with a document longer than a row (``--long-document-policy``)."""

DEFAULT_LONG_DOCUMENT_POLICY = "split"


@dataclass
class PackingStats:
    """Counters filled by the packer (`row_plan.plan_rows`) (they accumulate if one object is reused).

    Attributes:
        documents: documents packed into rows (a split document counts once per piece,
            truncated ones once, skipped ones not).
        rows: rows produced.
        skipped_empty: documents with fewer than 2 tokens: nothing to predict, so skipped.
        skipped_no_target: chat conversations without an assistant turn (no loss token), so
            skipped; counted by the reader (datasets/builder.py), not by the packer.
        truncated: documents cut to ``seq_length + 1`` tokens (policy ``truncate``).
        truncated_tokens: tokens those cuts dropped (each one a training position lost).
        split: documents cut into row-sized pieces (policy ``split``).
        pieces: the pieces they became (each packed as a document of its own).
        longest: token count of the longest document read (before any cut).
        padding_tokens: positions filled by padding tails.
        tokens: training positions holding real tokens (so ``tokens + padding_tokens`` is
            ``rows * seq_length``).
    """

    documents: int = 0
    rows: int = 0
    skipped_empty: int = 0
    skipped_no_target: int = 0
    truncated: int = 0
    truncated_tokens: int = 0
    split: int = 0
    pieces: int = 0
    longest: int = 0
    padding_tokens: int = 0
    tokens: int = 0

    @property
    def truncated_fraction(self) -> float:
        """Share of the data's training positions that truncation dropped (0.0 when none)."""
        total = self.tokens + self.truncated_tokens
        return self.truncated_tokens / total if total else 0.0


def check_long_document_policy(policy: str) -> str:
    """``policy`` if it is one of `LONG_DOCUMENT_POLICIES`, else ValueError."""
    if policy not in LONG_DOCUMENT_POLICIES:
        raise ValueError(f"long-document policy is wrong: {policy!r}. Set "
                         f"--long-document-policy to one of {', '.join(LONG_DOCUMENT_POLICIES)}.")
    return policy


def resolve_long_document_policy(policy: str | None, reject_long_documents: bool = False) -> str:
    """The policy a packer applies: ``policy`` when given, else ``reject`` for the older
    ``reject_long_documents=True``, else `DEFAULT_LONG_DOCUMENT_POLICY`."""
    if policy is None:
        return "reject" if reject_long_documents else DEFAULT_LONG_DOCUMENT_POLICY
    check_long_document_policy(policy)
    if reject_long_documents and policy != "reject":
        raise ValueError(f"long-document policy is wrong: {policy!r} together with "
                         f"reject_long_documents. Give one: --long-document-policy reject is "
                         f"the same as --reject-long-documents.")
    return policy


DEFAULT_MAX_TRUNCATED_TOKEN_FRACTION = 0.05
"""``--max-truncated-token-fraction`` when not given."""


def check_truncated_fraction(stats: PackingStats, max_fraction: float | None, where: str) -> None:
    """ValueError when truncation dropped more than ``max_fraction`` (None: the default 0.05)
    of ``where``'s training positions (``--max-truncated-token-fraction``), naming the two
    fixes."""
    if max_fraction is None:
        max_fraction = DEFAULT_MAX_TRUNCATED_TOKEN_FRACTION
    fraction = stats.truncated_fraction
    if fraction <= max_fraction:
        return
    total = stats.tokens + stats.truncated_tokens
    raise ValueError(
        f"truncation is wrong: {where}: cutting {stats.truncated} long documents to a row "
        f"drops {stats.truncated_tokens} of {total} tokens ({100 * fraction:.2f}%), more than "
        f"--max-truncated-token-fraction {max_fraction:g}. Raise --seq-length (the longest "
        f"document has {stats.longest} tokens) or use --long-document-policy split (long "
        f"documents become row-sized pieces, nothing dropped).")


def check_seq_length(seq_length: int) -> None:
    """Raise ValueError unless ``seq_length`` is a positive int."""
    if isinstance(seq_length, bool) or not isinstance(seq_length, (int, np.integer)) or seq_length < 1:
        raise ValueError(f"seq_length is wrong: {seq_length!r}. Set --seq-length to a positive integer.")


def segment_position_ids(segment_lengths: np.ndarray) -> np.ndarray:
    """Positions restarting at 0 in every segment: int64 ``[sum(segment_lengths)]``."""
    segment_lengths = np.asarray(segment_lengths, dtype=np.int64)
    starts = np.cumsum(segment_lengths) - segment_lengths
    return np.arange(int(segment_lengths.sum()), dtype=np.int64) - np.repeat(starts, segment_lengths)


def build_packed_row(
    tokens: np.ndarray,
    labels: np.ndarray,
    loss_mask: np.ndarray,
    segment_lengths: np.ndarray,
    seq_length: int,
    actual_lengths: np.ndarray | None = None,
) -> PackedRow:
    """Pad already-shifted documents to ``seq_length`` and lay out one `PackedRow`.

    Args:
        tokens, labels: int64 ``[n]``, the documents' positions back to back.
        loss_mask: float32 ``[n]``.
        segment_lengths: int ``[num_documents]``, each >= 1, summing to ``n <= seq_length``.
        seq_length: ``S``; a tail of ``S - n`` pad positions becomes its own segment.
        actual_lengths: int ``[num_documents]``, the unpadded length of each segment when
            segments end in padding of their own (then ``cu_seqlens_actual`` is filled).
    """
    segment_lengths = np.asarray(segment_lengths, dtype=np.int64)
    used = int(segment_lengths.sum())
    pad = seq_length - used
    if pad < 0 or len(tokens) != used:
        raise ValueError(
            f"packed row is wrong: {used} positions in segments, {len(tokens)} tokens, "
            f"seq_length {seq_length}. This is a packing bug; report it."
        )
    num_documents = len(segment_lengths)
    if pad > 0:
        pad_ids = np.full(pad, PAD_TOKEN_ID, dtype=np.int64)
        tokens = np.concatenate([tokens, pad_ids])
        labels = np.concatenate([labels, pad_ids])
        loss_mask = np.concatenate([loss_mask, np.zeros(pad, dtype=np.float32)])
        segment_lengths = np.append(segment_lengths, pad)
    cu_seqlens = np.zeros(len(segment_lengths) + 1, dtype=np.int32)
    np.cumsum(segment_lengths, out=cu_seqlens[1:])
    cu_seqlens_actual = None
    if actual_lengths is not None:
        actual = np.append(np.asarray(actual_lengths, dtype=np.int64), segment_lengths[num_documents:])
        cu_seqlens_actual = np.zeros_like(cu_seqlens)
        np.cumsum(actual, out=cu_seqlens_actual[1:])
    return PackedRow(
        tokens=tokens.astype(np.int64, copy=False),
        labels=labels.astype(np.int64, copy=False),
        loss_mask=loss_mask.astype(np.float32, copy=False),
        position_ids=segment_position_ids(segment_lengths),
        cu_seqlens=cu_seqlens,
        num_documents=num_documents,
        cu_seqlens_actual=cu_seqlens_actual,
    )


def pad_to_multiple(positions, multiple: int):
    """``positions`` (an int or an int array) rounded up to a multiple of ``multiple``."""
    return -(-positions // multiple) * multiple


def piece_bounds(num_tokens: int, max_positions: int) -> list[tuple[int, int]]:
    """``[start, end)`` token ranges of the pieces a ``split`` cuts a document of
    ``num_tokens`` tokens into: ``max_positions`` training positions each (the last one the
    rest), consecutive pieces sharing one token. Position ``j`` of the document (token ``j``
    predicts token ``j + 1``) lands in exactly one piece, so no prediction is lost."""
    return [(start, min(start + max_positions + 1, num_tokens))
            for start in range(0, num_tokens - 1, max_positions)]


def admit_lengths(num_tokens: int, max_positions: int, *, policy: str, stats: PackingStats,
                  too_long: Callable[[int], str]) -> list[tuple[int, int]]:
    """The one admission rule of every packer (static, dynamic CP, mock): the ``[start, end)``
    token ranges a document of ``num_tokens`` tokens enters rows as, for rows of
    ``max_positions`` training positions.

    Fewer than 2 tokens: none (nothing to predict; ``stats.skipped_empty``). Up to
    ``max_positions + 1`` tokens: the whole document. Longer, by ``policy`` (see
    `LONG_DOCUMENT_POLICIES`): ``truncate`` keeps the first ``max_positions + 1`` tokens
    (``stats.truncated``, ``stats.truncated_tokens``); ``split`` returns `piece_bounds`
    (``stats.split``, ``stats.pieces``); ``reject`` raises ``ValueError(too_long(num_tokens))``.
    """
    stats.longest = max(stats.longest, num_tokens)
    if num_tokens < 2:
        stats.skipped_empty += 1
        return []
    if num_tokens - 1 <= max_positions:
        return [(0, num_tokens)]
    if policy == "reject":
        raise ValueError(too_long(num_tokens))
    if policy == "truncate":
        stats.truncated += 1
        stats.truncated_tokens += num_tokens - (max_positions + 1)
        return [(0, max_positions + 1)]
    check_long_document_policy(policy)
    bounds = piece_bounds(num_tokens, max_positions)
    stats.split += 1
    stats.pieces += len(bounds)
    return bounds


def admit_document(document: Document, max_positions: int, *, policy: str, stats: PackingStats,
                   too_long: Callable[[int], str]) -> list[Document]:
    """`admit_lengths` applied to ``document``: the documents it enters rows as (itself, its
    truncated head or its pieces). A piece's origin is the document's plus
    ``" piece k/n"``; its ``loss_mask`` is the document's over the same tokens."""
    bounds = admit_lengths(len(document.input_ids), max_positions, policy=policy, stats=stats,
                           too_long=too_long)
    if bounds == [(0, len(document.input_ids))]:
        return [document]
    pieces = []
    for k, (start, end) in enumerate(bounds):
        origin = document.origin if len(bounds) == 1 else f"{document.origin} piece {k + 1}/{len(bounds)}"
        mask = None if document.loss_mask is None else document.loss_mask[start:end]
        pieces.append(Document(document.input_ids[start:end], mask, origin))
    return pieces


def join_row_boundaries(per_row: Sequence[np.ndarray]) -> np.ndarray:
    """Cumulative boundaries of rows laid end to end, int32: each row's ``[0, ..., end]``
    shifted by the ends of the rows before it, shared boundaries written once."""
    offsets = np.cumsum([0] + [int(b[-1]) for b in per_row[:-1]])
    parts = [np.zeros(1, dtype=np.int64)]
    parts += [b[1:].astype(np.int64) + offset for b, offset in zip(per_row, offsets)]
    return np.concatenate(parts).astype(np.int32)


def row_padding_mask(row: PackedRow) -> np.ndarray:
    """bool ``[S]``: True where a position of ``row`` holds no document token (the padding
    tail past its documents, and each segment's own padding when ``cu_seqlens_actual`` is
    set)."""
    mask = np.ones(len(row.tokens), dtype=bool)
    starts = row.cu_seqlens[:row.num_documents].astype(np.int64)
    if row.cu_seqlens_actual is None:
        ends = row.cu_seqlens[1:row.num_documents + 1].astype(np.int64)
    else:
        ends = starts + np.diff(row.cu_seqlens_actual)[:row.num_documents]
    for start, end in zip(starts, ends):
        mask[start:end] = False
    return mask


def collate_packed_rows(rows: Sequence[PackedRow]) -> dict:
    """Stack ``mbs`` rows into the micro-batch dict the model code reads.

    Returns a dict with (``S`` = seq_length, all tensors on CPU):
        ``tokens``: int64 ``[mbs, S]``.
        ``labels``: int64 ``[mbs, S]``.
        ``loss_mask``: float32 ``[mbs, S]``.
        ``position_ids``: int64 ``[mbs, S]``, restarting at 0 in every segment.
        ``cu_seqlens``: int32 ``[num_segments + 1]`` over the flattened ``mbs * S`` token
            stream: row ``i``'s boundaries shifted by ``i * S``, shared boundaries written once,
            so ``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == mbs * S``.
        ``num_segments``: host int, ``len(cu_seqlens) - 1`` (padding tails included): what a
            graph capacity must hold.
        ``num_documents``: host int, real documents in the micro-batch.
        ``padding_mask``: bool ``[mbs, S]``, True on positions that hold no document: each
            row's padding tail and, with ``segment_multiple > 1``, its segments' inner padding
            (MoE routes none of them).
        ``max_seqlen``: host int, the longest segment (for eager attention; graphed runs use
            the fixed ``S`` instead).
        ``cu_seqlens_actual``: only when the rows were packed with ``segment_multiple > 1``:
            int32, ``cu_seqlens``' segments without their inner padding, cumulated across rows.
    """
    if len(rows) == 0:
        raise ValueError("micro-batch is wrong: 0 rows. Pass at least one PackedRow.")
    seq_length = len(rows[0].tokens)
    if any(len(row.tokens) != seq_length for row in rows):
        lengths = sorted({len(row.tokens) for row in rows})
        raise ValueError(
            f"micro-batch rows are wrong: lengths {lengths} differ. Pack every row with one seq_length."
        )
    cu_seqlens = join_row_boundaries([row.cu_seqlens for row in rows])
    batch = {
        "tokens": torch.from_numpy(np.stack([row.tokens for row in rows])),
        "labels": torch.from_numpy(np.stack([row.labels for row in rows])),
        "loss_mask": torch.from_numpy(np.stack([row.loss_mask for row in rows])),
        "position_ids": torch.from_numpy(np.stack([row.position_ids for row in rows])),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        "num_segments": len(cu_seqlens) - 1,
        "num_documents": sum(row.num_documents for row in rows),
        "padding_mask": torch.from_numpy(np.stack([row_padding_mask(row) for row in rows])),
        "max_seqlen": int(np.diff(cu_seqlens).max()),
    }
    if rows[0].cu_seqlens_actual is not None:
        if any(row.cu_seqlens_actual is None for row in rows):
            raise ValueError("micro-batch rows are wrong: some carry cu_seqlens_actual, some do "
                             "not. Pack every row with one segment_multiple.")
        actual = join_row_boundaries([row.cu_seqlens_actual for row in rows])
        batch["cu_seqlens_actual"] = torch.from_numpy(actual)
    return batch
