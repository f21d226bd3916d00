"""Greedy packing of tokenized documents into fixed-length rows, and the micro-batch contract.

A document of ``L`` tokens gives ``L - 1`` training positions: position ``j`` reads token
``input_ids[j]`` and predicts ``input_ids[j + 1]``. A row holds whole documents back to back,
each its own segment of ``cu_seqlens`` with positions restarting at 0, so attention (and
Mamba's scan) never crosses a document boundary. The unused end of a row is one more segment
of pad tokens whose loss mask is 0.

Everything here is host-side numpy until `collate_packed_rows` hands torch CPU tensors to the
training loop.
"""

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

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


@dataclass
class PackingStats:
    """Counters filled by `pack_documents` (they accumulate if one object is reused).

    Attributes:
        documents: documents packed into rows (truncated ones included, skipped ones not).
        rows: rows produced.
        skipped_empty: documents with fewer than 2 tokens: nothing to predict, so skipped.
        truncated: documents cut to ``seq_length + 1`` tokens.
        padding_tokens: positions filled by padding tails.
        tokens: training positions holding real tokens (so ``tokens + padding_tokens`` is
            ``rows * seq_length``).
    """

    documents: int = 0
    rows: int = 0
    skipped_empty: int = 0
    truncated: int = 0
    padding_tokens: int = 0
    tokens: int = 0


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


def tokens_to_pack(document: Document, max_positions: int, *, reject_long_documents: bool,
                   stats: PackingStats, too_long: Callable[[int], str]) -> int:
    """How many of ``document``'s tokens a packer takes: 0 for fewer than 2 tokens (nothing
    to predict; counted in ``stats.skipped_empty``), all of them up to ``max_positions + 1``;
    a longer document is cut to that (counted in ``stats.truncated``) or, under
    ``reject_long_documents``, refused with ``ValueError(too_long(its token count))``."""
    num_tokens = len(document.input_ids)
    if num_tokens < 2:
        stats.skipped_empty += 1
        return 0
    if num_tokens - 1 <= max_positions:
        return num_tokens
    if reject_long_documents:
        raise ValueError(too_long(num_tokens))
    stats.truncated += 1
    return max_positions + 1


def _shift(document: Document, num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, labels, loss_mask) of the first ``num_tokens`` tokens of a document."""
    ids = document.input_ids[:num_tokens].astype(np.int64, copy=False)
    if document.loss_mask is None:
        mask = np.ones(num_tokens - 1, dtype=np.float32)
    else:
        # loss_mask[j] marks token j as a target; position j predicts token j + 1.
        mask = document.loss_mask[1:num_tokens].astype(np.float32, copy=False)
    return ids[:-1], ids[1:], mask


def pack_documents(
    documents: Iterable[Document],
    seq_length: int,
    *,
    reject_long_documents: bool = False,
    stats: PackingStats | None = None,
    segment_multiple: int = 1,
) -> Iterator[PackedRow]:
    """Greedily pack documents, in order, into rows of ``seq_length`` positions.

    A document goes into the current row if its ``L - 1`` positions fit, else the row is closed
    (padded) and a new one starts. Documents with fewer than 2 tokens are skipped and counted.
    A document with more than ``seq_length`` positions is cut to ``seq_length + 1`` tokens
    (counted in ``stats.truncated``), or rejected with ValueError when
    ``reject_long_documents`` is set. ``stats`` is complete once the iterator is exhausted.
    A bad ``seq_length`` raises at call time; document errors raise while iterating.

    ``segment_multiple`` (context parallelism: ``2 * cp``) pads every document's segment with
    pad positions (loss 0) to a multiple of it; ``seq_length`` must be a multiple too. The
    rows then carry ``cu_seqlens_actual`` (see `PackedRow`); padding counts in
    ``stats.padding_tokens``.
    """
    check_seq_length(seq_length)
    if segment_multiple < 1 or seq_length % segment_multiple:
        raise ValueError(f"segment multiple is wrong: {segment_multiple} for seq_length "
                         f"{seq_length}. It must be >= 1 and divide --seq-length.")
    stats = stats if stats is not None else PackingStats()
    return _pack(iter(documents), seq_length, reject_long_documents, stats, segment_multiple)


def _pad_segment(parts: tuple, length: int) -> tuple:
    """(tokens, labels, loss_mask) of one document extended with pad positions to ``length``."""
    pad = length - len(parts[0])
    if pad == 0:
        return parts
    pad_ids = np.full(pad, PAD_TOKEN_ID, dtype=np.int64)
    tokens, labels, mask = parts
    return (np.concatenate([tokens, pad_ids]), np.concatenate([labels, pad_ids]),
            np.concatenate([mask, np.zeros(pad, dtype=np.float32)]))


def _pack(
    documents: Iterator[Document], seq_length: int, reject_long_documents: bool,
    stats: PackingStats, segment_multiple: int,
) -> Iterator[PackedRow]:
    pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    actual: list[int] = []
    used = 0

    def close_row() -> PackedRow:
        tokens, labels, mask = (np.concatenate(parts) for parts in zip(*pending))
        row = build_packed_row(tokens, labels, mask, [len(p[0]) for p in pending], seq_length,
                               actual if segment_multiple > 1 else None)
        stats.rows += 1
        stats.tokens += sum(actual)
        stats.padding_tokens += seq_length - sum(actual)
        return row

    for document in documents:
        num_tokens = tokens_to_pack(
            document, seq_length, reject_long_documents=reject_long_documents, stats=stats,
            too_long=lambda n: (
                f"document length is wrong: {document.origin} has {n} tokens ({n - 1} "
                f"training positions), more than --seq-length {seq_length}. Drop "
                f"--reject-long-documents to truncate it to {seq_length + 1} tokens, or raise "
                f"--seq-length."))
        if num_tokens == 0:
            continue
        positions = num_tokens - 1
        padded = pad_to_multiple(positions, segment_multiple)
        if used + padded > seq_length:
            yield close_row()
            pending, actual, used = [], [], 0
        pending.append(_pad_segment(_shift(document, num_tokens), padded))
        actual.append(positions)
        used += padded
        stats.documents += 1
        if used == seq_length:
            # Exact fit: hand the row out now instead of holding it until the next document.
            yield close_row()
            pending, actual, used = [], [], 0
    if pending:
        yield close_row()


def join_row_boundaries(per_row: Sequence[np.ndarray]) -> np.ndarray:
    """Cumulative boundaries of rows laid end to end, int32: each row's ``[0, ..., end]``
    shifted by the ends of the rows before it, shared boundaries written once."""
    offsets = np.cumsum([0] + [int(b[-1]) for b in per_row[:-1]])
    parts = [np.zeros(1, dtype=np.int64)]
    parts += [b[1:].astype(np.int64) + offset for b, offset in zip(per_row, offsets)]
    return np.concatenate(parts).astype(np.int32)


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
        "max_seqlen": int(np.diff(cu_seqlens).max()),
    }
    if rows[0].cu_seqlens_actual is not None:
        if any(row.cu_seqlens_actual is None for row in rows):
            raise ValueError("micro-batch rows are wrong: some carry cu_seqlens_actual, some do "
                             "not. Pack every row with one segment_multiple.")
        actual = join_row_boundaries([row.cu_seqlens_actual for row in rows])
        batch["cu_seqlens_actual"] = torch.from_numpy(actual)
    return batch
