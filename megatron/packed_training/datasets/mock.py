"""Synthetic packed rows (``--mock-data``) that look like SFT packing and are learnable.

Document lengths follow a log-normal law, so the number of documents per row, and with it
``cu_seqlens``, changes from row to row the way it does with real data: that is what CUDA-graph
capacity and the eager fallback have to cope with. Token content is an arithmetic walk over the
non-pad ids (``next = 1 + (prev - 1 + stride) % (V - 1)``, stride in {1, 2, 3} per document):
once a model has read two tokens of a document the rest is predictable, so the loss falls
visibly within a few hundred steps.
"""

import math

import numpy as np
import torch

from megatron.packed_training.datasets.packing import (
    DEFAULT_LONG_DOCUMENT_POLICY,
    PAD_TOKEN_ID,
    Document,
    PackedRow,
    PackingStats,
    admit_lengths,
    build_packed_row,
    check_long_document_policy,
    check_seq_length,
    pad_to_multiple,
    segment_position_ids,
)

STRIDES = (1, 2, 3)
"""Per-document step of the token walk."""


def walk(offset, position, stride, vocab_size: int):
    """Token at ``position`` of a document whose walk starts at id ``offset + 1`` (numpy
    broadcasting): ``1 + (offset + position * stride) % (vocab_size - 1)``, never the pad id."""
    return 1 + (offset + position * stride) % (vocab_size - 1)


def draw_raw_lengths(rng: np.random.Generator, count: int, median: float,
                     sigma: float) -> np.ndarray:
    """``count`` document lengths in tokens as drawn: int64, log-normal(median, sigma) rounded,
    at least 2 (one training position); no upper bound."""
    lengths = np.rint(rng.lognormal(mean=math.log(median), sigma=sigma, size=count))
    return np.maximum(lengths, 2).astype(np.int64)


def draw_document_lengths(
    rng: np.random.Generator, count: int, median: float, sigma: float, seq_length: int
) -> np.ndarray:
    """`draw_raw_lengths` clipped to ``seq_length + 1`` (at most a full row): the length a
    drawn document enters a row with under ``truncate`` and, as its first piece, ``split``."""
    return np.minimum(draw_raw_lengths(rng, count, median, sigma), seq_length + 1)


def mock_documents(num_positions: int, max_positions: int, vocab_size: int, seed: int,
                   doc_length_median: float, doc_length_sigma: float) -> list:
    """Synthetic `Document` s (the law and token walk of `MockPackedDataset`) drawn from
    ``seed`` until they hold ``num_positions`` training positions, counting each at most
    ``max_positions`` (a row). Lengths are as drawn: one longer than ``max_positions`` is
    left to the packer's long-document policy. For packers that take documents (dynamic CP)."""
    rng = np.random.default_rng([seed])
    documents, total = [], 0
    while total < num_positions:
        length = int(draw_raw_lengths(rng, 1, doc_length_median, doc_length_sigma)[0])
        start, stride = int(rng.integers(1, vocab_size)), int(rng.choice(STRIDES))
        ids = walk(start - 1, np.arange(length, dtype=np.int64), stride, vocab_size)
        documents.append(Document(ids, None, f"mock:{len(documents)}"))
        total += min(length, max_positions + 1) - 1
    return documents


class MockPackedDataset(torch.utils.data.Dataset):
    """``num_samples`` synthetic `PackedRow` s of ``seq_length`` positions.

    Row ``i`` depends on ``(seed, i)`` only (random access, identical on every rank and on
    resume): documents are drawn until the next one does not fit, and the rest of the row is
    padding (its own segment). Tokens are in ``[1, vocab_size)``; the pad id 0 never appears
    as a real token.

    A drawn document longer than a row follows ``long_document_policy`` (`admit_lengths`):
    ``truncate`` and ``split`` both enter it as its first ``seq_length + 1`` tokens, which
    fill a row (a row never continues into the next, so a split document's other pieces are
    dropped like any document that does not fit), so rows are the same under both; ``reject``
    raises ValueError naming the row.
    """

    def __init__(
        self,
        num_samples: int,
        seq_length: int,
        vocab_size: int,
        seed: int,
        doc_length_median: float = 512,
        doc_length_sigma: float = 1.0,
        segment_multiple: int = 1,
        long_document_policy: str = DEFAULT_LONG_DOCUMENT_POLICY,
    ):
        check_seq_length(seq_length)
        check_long_document_policy(long_document_policy)
        if segment_multiple < 1 or seq_length % segment_multiple:
            raise ValueError(f"segment multiple is wrong: {segment_multiple} for seq_length "
                             f"{seq_length}. It must be >= 1 and divide --seq-length.")
        if not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"mock num_samples is wrong: {num_samples!r}. Pass an integer >= 0.")
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(
                f"vocab_size is wrong: {vocab_size!r}. Set --vocab-size to at least 2 "
                f"(id 0 is padding, synthetic tokens use 1..vocab_size-1)."
            )
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed is wrong: {seed!r}. Set --seed to an integer >= 0.")
        if not doc_length_median >= 2:
            raise ValueError(
                f"mock document length median is wrong: {doc_length_median!r}. "
                f"Set --mock-doc-length-median to at least 2 tokens."
            )
        if not doc_length_sigma >= 0:
            raise ValueError(
                f"mock document length sigma is wrong: {doc_length_sigma!r}. "
                f"Set --mock-doc-length-sigma to a value >= 0."
            )
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.doc_length_median = float(doc_length_median)
        self.doc_length_sigma = float(doc_length_sigma)
        # Context parallelism: every document's segment padded to a multiple of 2 * cp.
        self.segment_multiple = segment_multiple
        self.long_document_policy = long_document_policy
        # Enough draws per batch that one batch nearly always overfills a row.
        self._draw_batch = 2 * math.ceil(seq_length / (self.doc_length_median - 1)) + 8

    def __len__(self) -> int:
        return self.num_samples

    def _rng(self, index: int) -> np.random.Generator:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"mock row index {index} out of range [0, {self.num_samples})")
        return np.random.default_rng([self.seed, int(index)])

    def _row_lengths(self, rng: np.random.Generator, index: int,
                     stats: PackingStats | None = None) -> np.ndarray:
        """Lengths (tokens) of the documents that fit, drawn until one does not, each as the
        long-document policy admits it; ``stats`` (if given) counts the row."""
        raw = np.empty(0, dtype=np.int64)
        positions_drawn = 0
        while positions_drawn <= self.seq_length:
            batch = draw_raw_lengths(rng, self._draw_batch, self.doc_length_median,
                                     self.doc_length_sigma)
            raw = np.concatenate([raw, batch])
            positions_drawn += int(np.minimum(batch, self.seq_length + 1).sum()) - len(batch)
        # What admit_lengths gives a long document under truncate, and as its first piece
        # under split: seq_length + 1 tokens, a full row (the pieces after it never fit).
        lengths = np.minimum(raw, self.seq_length + 1)
        fitting = np.searchsorted(np.cumsum(self._padded(lengths - 1)), self.seq_length,
                                  side="right")
        examined = raw[:fitting + 1]  # the row's documents and the one that did not fit
        if self.long_document_policy == "reject" and (examined > self.seq_length + 1).any():
            first = int(examined[np.argmax(examined > self.seq_length + 1)])
            admit_lengths(first, self.seq_length, policy="reject", stats=PackingStats(),
                          too_long=lambda n: (
                              f"document length is wrong: mock row {index} drew a document of "
                              f"{n} tokens ({n - 1} training positions), more than --seq-length "
                              f"{self.seq_length}. Use --long-document-policy split or "
                              f"truncate, or lower --mock-doc-length-median / "
                              f"--mock-doc-length-sigma."))
        if stats is not None:
            for length in raw[:fitting].tolist():
                admit_lengths(length, self.seq_length, policy=self.long_document_policy,
                              stats=stats, too_long=str)
            positions = int((lengths[:fitting] - 1).sum())
            stats.rows += 1
            stats.documents += int(fitting)
            stats.tokens += positions
            stats.padding_tokens += self.seq_length - positions
        return lengths[:fitting]

    def packing_stats(self, num_rows: int | None = None) -> PackingStats:
        """`PackingStats` of rows ``0 .. num_rows - 1`` (default: all), read without building
        them; a long document split by the policy counts all its pieces although only the
        first is in a row."""
        stats = PackingStats()
        for index in range(self.num_samples if num_rows is None else num_rows):
            self._row_lengths(self._rng(index), index, stats)
        return stats

    def _padded(self, positions: np.ndarray) -> np.ndarray:
        return pad_to_multiple(positions, self.segment_multiple)

    def document_lengths(self, index: int) -> np.ndarray:
        """Token lengths (int64) of the documents packed into row ``index``."""
        return self._row_lengths(self._rng(index), index)

    def real_positions(self, index: int) -> int:
        """Positions of row ``index`` that hold document tokens (balance.py)."""
        return self[index].real_positions

    def __getitem__(self, index: int) -> PackedRow:
        rng = self._rng(index)
        lengths = self._row_lengths(rng, index)
        num_documents = len(lengths)
        starts = rng.integers(1, self.vocab_size, size=num_documents)
        strides = rng.choice(np.array(STRIDES, dtype=np.int64), size=num_documents)

        positions_per_document = lengths - 1
        position = segment_position_ids(positions_per_document)
        offset = np.repeat(starts - 1, positions_per_document)
        stride = np.repeat(strides, positions_per_document)
        tokens = walk(offset, position, stride, self.vocab_size)
        labels = walk(offset, position + 1, stride, self.vocab_size)
        loss_mask = np.ones(len(tokens), dtype=np.float32)
        if self.segment_multiple == 1:
            return build_packed_row(tokens, labels, loss_mask, positions_per_document,
                                    self.seq_length)
        # Spread each document over its padded segment; the gaps are pad positions.
        segments = self._padded(positions_per_document)
        starts = np.cumsum(segments) - segments
        where = np.repeat(starts, positions_per_document) + position
        laid_out = [np.full(int(segments.sum()), PAD_TOKEN_ID, dtype=np.int64) for _ in range(2)]
        laid_out[0][where], laid_out[1][where] = tokens, labels
        mask = np.zeros(int(segments.sum()), dtype=np.float32)
        mask[where] = 1.0
        return build_packed_row(*laid_out, mask, segments, self.seq_length,
                                positions_per_document)
