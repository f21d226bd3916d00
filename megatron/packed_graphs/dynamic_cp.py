"""Dynamic context parallelism, host side: a CP size for every packed micro-batch (issue 7).

Every rank holds the same number of positions, ``tokens_per_rank`` (N), whatever the CP size:
a micro-batch of CP size ``c`` spans ``c * N`` positions over ``c`` ranks. So the local shape
is static for every bank of graphs, and a micro-batch takes as many ranks as its documents
need: short documents run without CP, a long one gets the CP size it needs.

The packer walks the documents in order. A micro-batch is opened with the smallest CP size in
the configured set that holds its first document; documents follow while they fit at that
size (each padded to a multiple of ``2 * c``, the THD CP layout of `context_parallel.py`);
the tail is padding. Pure host code: document lengths come from the dataset, nothing here
touches a GPU.
"""

from dataclasses import dataclass
from typing import List, Sequence, Tuple


def check_cp_sizes(cp_sizes: Sequence[int], max_cp_size: int) -> Tuple[int, ...]:
    """The CP-size set, checked: powers of two, strictly ascending, at most ``max_cp_size``
    (the ranks that can form one CP group: data-parallel x context-parallel size)."""
    sizes = tuple(int(c) for c in cp_sizes)
    if not sizes or any(c < 1 or c & (c - 1) for c in sizes) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"CP sizes are wrong: {list(sizes)}. Give powers of two in ascending "
                         f"order, e.g. 1 2 4.")
    if sizes[-1] > max_cp_size:
        raise ValueError(f"CP sizes are wrong: {sizes[-1]} exceeds the {max_cp_size} ranks of "
                         f"data x context parallelism. Drop it or use more ranks.")
    return sizes


def cp_padded_length(length: int, cp_size: int) -> int:
    """``length`` rounded up to a multiple of ``2 * cp_size`` (the THD CP layout)."""
    return -(-length // (2 * cp_size)) * (2 * cp_size)


def fits(lengths: Sequence[int], cp_size: int, tokens_per_rank: int) -> bool:
    """Whether documents of ``lengths`` positions, CP-padded, fit ``cp_size * tokens_per_rank``."""
    return sum(cp_padded_length(n, cp_size) for n in lengths) <= cp_size * tokens_per_rank


@dataclass(frozen=True)
class CPMicroBatch:
    """One micro-batch: its documents (indices into the input, in order) and its CP size."""

    documents: Tuple[int, ...]
    lengths: Tuple[int, ...]
    cp_size: int


def pack_for_dynamic_cp(lengths: Sequence[int], cp_sizes: Sequence[int],
                        tokens_per_rank: int) -> List[CPMicroBatch]:
    """Group documents (``lengths``: training positions each, in order) into micro-batches,
    each with a CP size from ``cp_sizes`` (checked with `check_cp_sizes` first).

    ``tokens_per_rank`` must be a multiple of ``2 * max(cp_sizes)`` so that every size's
    span is. Raises ValueError for a document longer than the largest CP size can hold.
    """
    sizes = tuple(cp_sizes)
    if tokens_per_rank < 1 or tokens_per_rank % (2 * sizes[-1]):
        raise ValueError(f"tokens per rank are wrong: {tokens_per_rank}. Use a positive multiple "
                         f"of 2 x the largest CP size ({2 * sizes[-1]}).")
    batches: List[CPMicroBatch] = []
    docs: List[int] = []
    cp = used = 0  # the open micro-batch's CP size and its padded positions

    def close():
        batches.append(CPMicroBatch(tuple(docs), tuple(lengths[i] for i in docs), cp))

    for index, length in enumerate(lengths):
        if docs and used + cp_padded_length(length, cp) <= cp * tokens_per_rank:
            docs.append(index)
            used += cp_padded_length(length, cp)
            continue
        if docs:
            close()
        cp = next((c for c in sizes if fits([length], c, tokens_per_rank)), None)
        if cp is None:
            raise ValueError(
                f"document length is wrong: document {index} has {length} positions, more than "
                f"CP size {sizes[-1]} x {tokens_per_rank} tokens per rank hold. Add a larger CP "
                f"size or truncate long documents.")
        docs, used = [index], cp_padded_length(length, cp)
    if docs:
        close()
    return batches
