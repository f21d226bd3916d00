"""Which pieces of which documents fill each packed row: the packer, on document lengths only.

A `RowPlan` holds, per row, the ``(document, start, end)`` token ranges it packs: 24 bytes per
piece, however long the documents are. `PlannedRows` turns a row of the plan into a
`PackedRow` when it is read, from a document source that reads tokens on demand (an indexed
dataset, the token cache, or documents in memory). So a rank's memory grows with the number
of documents, not with the tokens.

Two algorithms (``--packing-algorithm``):

- ``in-order``: documents in source order; a document joins the current row if it fits, else
  the row is closed. The rows are those this fork packed before the plan existed.
- ``best-fit-decreasing`` (default): the pieces are shuffled (seeded), and each window of
  ``--packing-window`` pieces is packed longest first, each piece into the open row it fills
  most tightly. Deterministic in the seed; every rank computes the same plan.
"""

import bisect
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np

from megatron.packed_training.datasets.packing import (
    PAD_TOKEN_ID,
    Document,
    PackedRow,
    PackingStats,
    admit_lengths,
    build_packed_row,
    check_seq_length,
    pad_to_multiple,
    resolve_long_document_policy,
)

PACKING_ALGORITHMS = ("best-fit-decreasing", "in-order")
DEFAULT_PACKING_ALGORITHM = "best-fit-decreasing"
DEFAULT_PACKING_WINDOW = 20_000
DEFAULT_PACKING_MAX_DOCUMENTS = 63
"""Pieces per best-fit row (``--packing-max-documents``): a row and its padding tail fit one
graph capacity of 64, whatever the graph flags, so eager and graphed runs pack the same rows."""


class DocumentSource(Protocol):
    """What the packer reads: document lengths up front, tokens when a row is built."""

    lengths: np.ndarray  # int ``[num_documents]``, tokens per document

    def read(self, document: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray | None]:
        """int64 tokens ``[start, end)`` of ``document`` and their float32 loss mask (None: all
        tokens count)."""

    def origin(self, document: int) -> str:
        """How errors name ``document`` (``file:line``)."""


@dataclass(frozen=True)
class RowPlan:
    """Rows as ranges of documents, in CSR form.

    Attributes:
        seq_length: positions per row.
        segment_multiple: every piece's segment is padded to a multiple of it (CP: ``2 * cp``).
        row_starts: int64 ``[rows + 1]``, row ``i`` holds pieces ``row_starts[i]:row_starts[i+1]``.
        documents, starts, ends: int64 ``[pieces]``, the document of each piece and its token
            range ``[start, end)``; a piece of ``n`` tokens fills ``n - 1`` positions.
    """

    seq_length: int
    segment_multiple: int
    row_starts: np.ndarray
    documents: np.ndarray
    starts: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def real_positions(self) -> np.ndarray:
        """int64 ``[rows]``: positions of each row that hold document tokens."""
        positions = self.ends - self.starts - 1
        sums = np.concatenate([[0], np.cumsum(positions)])
        return sums[self.row_starts[1:]] - sums[self.row_starts[:-1]]

    def select(self, rows: np.ndarray) -> "RowPlan":
        """The plan of ``rows`` only (int array of row indices), in that order."""
        counts = self.row_starts[rows + 1] - self.row_starts[rows]
        pieces = np.concatenate([np.arange(self.row_starts[r], self.row_starts[r + 1])
                                 for r in rows]) if len(rows) else np.zeros(0, np.int64)
        return RowPlan(self.seq_length, self.segment_multiple,
                       np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                       self.documents[pieces], self.starts[pieces], self.ends[pieces])


def _admitted(source: DocumentSource, seq_length: int, policy: str, stats: PackingStats,
              documents: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of the chosen ``documents`` (default all), in document order, after the
    long-document policy (`admit_lengths`). Vectorised over the documents that fit a row;
    only longer ones (and the empty, for their count) go through `admit_lengths` one by one."""
    indices = (np.arange(len(source.lengths), dtype=np.int64) if documents is None
               else np.asarray(documents, dtype=np.int64))
    lengths = np.asarray(source.lengths, dtype=np.int64)[indices]
    fits = (lengths >= 2) & (lengths <= seq_length + 1)
    at = [np.flatnonzero(fits)]  # each piece's place in ``indices``: the order to keep
    starts, ends = [np.zeros(len(at[0]), np.int64)], [lengths[fits]]
    if len(lengths):
        stats.longest = max(stats.longest, int(lengths.max()))
    for place in np.flatnonzero(~fits).tolist():
        document, num_tokens = int(indices[place]), int(lengths[place])

        def too_long(n: int, document=document) -> str:
            return (f"document length is wrong: {source.origin(document)} has {n} tokens "
                    f"({n - 1} training positions), more than --seq-length {seq_length}. Use "
                    f"--long-document-policy split (row-sized pieces) or truncate, or raise "
                    f"--seq-length to at least {n - 1}.")

        bounds = admit_lengths(num_tokens, seq_length, policy=policy, stats=stats,
                               too_long=too_long)
        at.append(np.full(len(bounds), place, np.int64))
        starts.append(np.asarray([b[0] for b in bounds], np.int64))
        ends.append(np.asarray([b[1] for b in bounds], np.int64))
    at, starts, ends = (np.concatenate(part) for part in (at, starts, ends))
    order = np.lexsort((starts, at))
    return indices[at[order]], starts[order], ends[order]


def _in_order(sizes: np.ndarray, seq_length: int) -> list[list[int]]:
    rows, current, used = [], [], 0
    for piece, size in enumerate(sizes.tolist()):
        if used + size > seq_length:
            rows.append(current)
            current, used = [], 0
        current.append(piece)
        used += size
        if used == seq_length:
            rows.append(current)
            current, used = [], 0
    if current:
        rows.append(current)
    return rows


def _best_fit_decreasing(sizes: np.ndarray, seq_length: int, window: int, seed: int,
                         max_documents: int | None) -> list[list[int]]:
    order = np.random.default_rng([seed, 0x9ac]).permutation(len(sizes))
    rows = []
    for begin in range(0, len(order), window):
        pieces = order[begin:begin + window]
        # Longest first; ties by piece index, so the plan depends on the seed alone.
        pieces = pieces[np.lexsort((pieces, -sizes[pieces]))]
        bins: list[list[int]] = []
        free: list[tuple[int, int]] = []  # (free positions, bin), ascending
        for piece in pieces.tolist():
            size = int(sizes[piece])
            at = bisect.bisect_left(free, (size, -1))
            if at == len(free):
                bins.append([piece])
                left, index = seq_length - size, len(bins) - 1
            else:
                left, index = free.pop(at)
                bins[index].append(piece)
                left -= size
            # A row stays open while it has room and holds fewer than max_documents pieces.
            if left > 0 and (max_documents is None or len(bins[index]) < max_documents):
                bisect.insort(free, (left, index))
        rows.extend(bins)
    return rows


def plan_rows(source: DocumentSource, seq_length: int, *, long_document_policy: str | None = None,
              stats: PackingStats | None = None, segment_multiple: int = 1,
              algorithm: str = "in-order", window: int = DEFAULT_PACKING_WINDOW, seed: int = 0,
              documents: Sequence[int] | None = None,
              max_documents: int | None = None) -> RowPlan:
    """Pack ``source``'s documents (or the ``documents`` chosen) into rows of ``seq_length``
    positions; fills ``stats`` (`PackingStats`). Host-only, on lengths: no token is read.

    ``max_documents`` (best-fit-decreasing): at most that many pieces per row, so that rows
    stay within a CUDA-graph capacity (best fit tucks short documents into every gap; without
    a limit a row can collect dozens). ``in-order`` keeps its rows as they always were.

    Raises ValueError for a bad ``seq_length``, policy, algorithm or segment multiple, and for
    a too-long document under the ``reject`` policy (naming ``source.origin``)."""
    check_seq_length(seq_length)
    if segment_multiple < 1 or seq_length % segment_multiple:
        raise ValueError(f"segment multiple is wrong: {segment_multiple} for seq_length "
                         f"{seq_length}. It must be >= 1 and divide --seq-length.")
    if algorithm not in PACKING_ALGORITHMS:
        raise ValueError(f"packing algorithm is wrong: {algorithm!r}. Set --packing-algorithm "
                         f"to one of {', '.join(PACKING_ALGORITHMS)}.")
    if window < 1:
        raise ValueError(f"packing window is wrong: {window}. Set --packing-window >= 1.")
    if max_documents is not None and max_documents < 1:
        raise ValueError(f"documents per row is wrong: {max_documents}. It must be >= 1.")
    policy = resolve_long_document_policy(long_document_policy)
    stats = stats if stats is not None else PackingStats()
    docs, starts, ends = _admitted(source, seq_length, policy, stats, documents)
    positions = ends - starts - 1
    sizes = pad_to_multiple(positions, segment_multiple)
    if algorithm == "in-order":
        rows = _in_order(sizes, seq_length)
    else:
        rows = _best_fit_decreasing(sizes, seq_length, window, seed, max_documents)
    flat = np.asarray([piece for row in rows for piece in row], dtype=np.int64)
    row_starts = np.concatenate([[0], np.cumsum([len(row) for row in rows])]).astype(np.int64)
    plan = RowPlan(seq_length, segment_multiple, row_starts, docs[flat], starts[flat], ends[flat])
    stats.documents += len(flat)
    stats.rows += len(plan)
    stats.tokens += int(positions.sum())
    stats.padding_tokens += len(plan) * seq_length - int(positions.sum())
    return plan


def _piece_parts(source: DocumentSource, document: int, start: int, end: int, size: int):
    """(tokens, labels, loss_mask) of one piece, shifted and padded to ``size`` positions."""
    ids, mask = source.read(document, start, end)
    tokens, labels = ids[:-1], ids[1:]
    # loss_mask[j] marks token j as a target; position j predicts token j + 1.
    mask = np.ones(len(tokens), np.float32) if mask is None else mask[1:].astype(np.float32)
    pad = size - len(tokens)
    if pad:
        pad_ids = np.full(pad, PAD_TOKEN_ID, dtype=np.int64)
        tokens, labels = np.concatenate([tokens, pad_ids]), np.concatenate([labels, pad_ids])
        mask = np.concatenate([mask, np.zeros(pad, np.float32)])
    return tokens, labels, mask


class PlannedRows(Sequence[PackedRow]):
    """The rows of ``plan``, each built from ``source`` when it is read (a few reads of the
    mapped files per row; nothing is kept)."""

    def __init__(self, source: DocumentSource, plan: RowPlan):
        self.source, self.plan = source, plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index: int) -> PackedRow:
        plan = self.plan
        if not 0 <= index < len(plan):
            raise IndexError(f"row {index} out of range [0, {len(plan)})")
        first, last = int(plan.row_starts[index]), int(plan.row_starts[index + 1])
        actual = (plan.ends[first:last] - plan.starts[first:last] - 1).tolist()
        sizes = [int(pad_to_multiple(n, plan.segment_multiple)) for n in actual]
        parts = [_piece_parts(self.source, int(plan.documents[p]), int(plan.starts[p]),
                              int(plan.ends[p]), size)
                 for p, size in zip(range(first, last), sizes)]
        tokens, labels, mask = (np.concatenate(column) for column in zip(*parts))
        return build_packed_row(tokens, labels, mask, sizes, plan.seq_length,
                                actual if plan.segment_multiple > 1 else None)


class DocumentList:
    """Documents already in memory (`packing.Document`) as a `DocumentSource`."""

    def __init__(self, documents: Sequence):
        self.documents = list(documents)
        self.lengths = np.asarray([len(d.input_ids) for d in self.documents], dtype=np.int64)

    def read(self, document: int, start: int, end: int):
        doc = self.documents[document]
        mask = None if doc.loss_mask is None else doc.loss_mask[start:end]
        return doc.input_ids[start:end].astype(np.int64, copy=False), mask

    def origin(self, document: int) -> str:
        return self.documents[document].origin


def pack_documents(
    documents: Iterable[Document],
    seq_length: int,
    *,
    long_document_policy: str | None = None,
    reject_long_documents: bool = False,
    stats: PackingStats | None = None,
    segment_multiple: int = 1,
) -> Iterator[PackedRow]:
    """Pack documents in memory, in order, into rows of ``seq_length`` positions (`plan_rows`
    with ``in-order`` over a `DocumentList`).

    A document goes into the current row if its ``L - 1`` positions fit, else the row is closed
    (padded) and a new one starts. Documents with fewer than 2 tokens are skipped and counted.
    A document with more than ``seq_length`` positions follows ``long_document_policy``
    (`admit_lengths`; default ``split``): cut into row-sized pieces, each packed as a document
    of its own (``split``), cut to ``seq_length + 1`` tokens (``truncate``), or a ValueError
    naming its origin (``reject``; ``reject_long_documents=True`` is the older spelling).
    ``stats`` is complete once the iterator is exhausted. A bad ``seq_length`` or policy
    raises at call time; document errors raise while iterating.

    ``segment_multiple`` (context parallelism: ``2 * cp``) pads every document's segment with
    pad positions (loss 0) to a multiple of it; ``seq_length`` must be a multiple too. The
    rows then carry ``cu_seqlens_actual`` (see `PackedRow`); padding counts in
    ``stats.padding_tokens``.
    """
    check_seq_length(seq_length)
    if segment_multiple < 1 or seq_length % segment_multiple:
        raise ValueError(f"segment multiple is wrong: {segment_multiple} for seq_length "
                         f"{seq_length}. It must be >= 1 and divide --seq-length.")
    policy = resolve_long_document_policy(long_document_policy, reject_long_documents)
    stats = stats if stats is not None else PackingStats()
    return _planned(documents, seq_length, policy, stats, segment_multiple)


def _planned(documents, seq_length: int, policy: str, stats: PackingStats,
             segment_multiple: int) -> Iterator[PackedRow]:
    source = DocumentList(documents)
    plan = plan_rows(source, seq_length, long_document_policy=policy, stats=stats,
                     segment_multiple=segment_multiple, algorithm="in-order")
    yield from PlannedRows(source, plan)
