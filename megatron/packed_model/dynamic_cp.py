"""Dynamic context parallelism, host side: a CP size for every packed micro-batch.

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
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.core import parallel_state


def check_cp_sizes(cp_sizes: Sequence[int], max_cp_size: int,
                   what: str = "CP sizes") -> Tuple[int, ...]:
    """The CP-size set, checked: powers of two, strictly ascending, at most ``max_cp_size``
    (the ranks that can form one CP group: data-parallel x context-parallel size). Errors
    name the set ``what`` (e.g. the flag that gave it)."""
    sizes = tuple(int(c) for c in cp_sizes)
    shown = " ".join(map(str, sizes))
    if not sizes or any(c < 1 or c & (c - 1) for c in sizes) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"{what} is wrong: {shown}. Give powers of two in ascending order, "
                         f"e.g. 1 2 4.")
    if sizes[-1] > max_cp_size:
        raise ValueError(f"{what} is wrong: {shown}. {sizes[-1]} exceeds the {max_cp_size} "
                         f"ranks of data x context parallelism; drop it or use more ranks.")
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


@dataclass(frozen=True)
class CPTurn:
    """One micro-batch's turn in a round: its index in the iteration, CP size and ranks.

    The ranks are ``first_rank .. first_rank + cp_size - 1`` of the data x context parallel
    group; ``first_rank`` is a multiple of ``cp_size`` (megatron-core's hybrid DP x CP groups
    are such aligned blocks).
    """

    micro_batch: int
    cp_size: int
    first_rank: int

    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.cp_size)


def schedule_cp_rounds(cp_sizes: Sequence[int], num_ranks: int) -> List[List[CPTurn]]:
    """Place micro-batches of the given CP sizes on ``num_ranks`` ranks, in rounds.

    In a round every rank runs at most one micro-batch, and the micro-batches of a round sit
    on disjoint aligned rank blocks. Ranks run their turns in round order, so the members of
    a CP group meet their group's collectives in the same order and no two groups wait on
    each other. Largest CP size first, each into the first round with a free aligned block
    (buddy placement: power-of-two sizes never fragment a round). A rank without a turn in a
    round has nothing to run in it. Pure host code.
    """
    if num_ranks < 1 or num_ranks & (num_ranks - 1):
        raise ValueError(f"rank count is wrong: {num_ranks}. Dynamic CP needs a power of two "
                         f"data x context parallel ranks.")
    for size in cp_sizes:
        if size < 1 or size & (size - 1) or size > num_ranks:
            raise ValueError(f"CP size is wrong: {size}. Use powers of two up to the "
                             f"{num_ranks} data x context parallel ranks.")
    rounds: List[List[CPTurn]] = []
    free: List[List[bool]] = []  # free[round][rank]
    order = sorted(range(len(cp_sizes)), key=lambda i: -cp_sizes[i])
    for index in order:
        size = cp_sizes[index]
        for turns, ranks_free in zip(rounds, free):
            start = next((s for s in range(0, num_ranks, size) if all(ranks_free[s:s + size])),
                         None)
            if start is not None:
                turns.append(CPTurn(index, size, start))
                ranks_free[start:start + size] = [False] * size
                break
        else:  # no round has a free block: open one
            rounds.append([CPTurn(index, size, 0)])
            free.append([r >= size for r in range(num_ranks)])
    return rounds


def turns_of_rank(rounds: List[List[CPTurn]], rank: int) -> List[CPTurn]:
    """The turns ``rank`` runs, in round order (its micro-batches for the iteration)."""
    return [turn for turns in rounds for turn in turns if rank in turn.ranks()]


def micro_batch_cp_group(params) -> Optional[torch.distributed.ProcessGroup]:
    """The CP group a micro-batch asks for: its ``cp_group``; None when it asks for none (or
    carries no choice: the layer's static group applies). Raises on ``local_cp_size > 1``
    without a group."""
    if params is None:
        return None
    if params.cp_group is None and params.local_cp_size not in (None, 1):
        raise ValueError(f"packed_seq_params.local_cp_size is {params.local_cp_size} but "
                         f"cp_group is None: give the micro-batch its CP group.")
    return params.cp_group


def dynamic_cp_group(cp_size: int) -> Optional[torch.distributed.ProcessGroup]:
    """This rank's CP group of ``cp_size`` ranks: its aligned block of the data x context
    parallel ranks (None for size 1; the whole DP x CP group for its full size; otherwise
    megatron-core's hybrid DP x CP group, built by
    ``initialize_model_parallel(hybrid_context_parallel=True)``)."""
    if cp_size == 1:
        return None
    if cp_size == parallel_state.get_data_parallel_world_size(with_context_parallel=True):
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    return parallel_state.get_hybrid_data_context_parallel_groups(group_size=cp_size)
