"""Data-parallel balance: deal each global batch's packed rows so that every data-parallel
rank gets near-equal real tokens (``--sequence-packing-scheduler dp_balanced``).

A step waits for its slowest rank, and a rank's work grows with its real tokens (attention:
faster than linearly). Packed rows of one length still hold different numbers of real tokens
(the padding tail). Within each global batch, the rows are reordered, never exchanged between
steps: longest first, each to the rank with the fewest tokens that still has room (the
longest-processing-time rule). Every rank computes the same order from the same row lengths,
so no communication is needed, and resuming at a step boundary continues exactly.
"""

import heapq

import numpy as np
import torch

DP_SCHEDULERS = ("default", "dp_balanced")


def deal_to_ranks(sizes, num_ranks: int, per_rank: int) -> list[list[int]]:
    """Indices of ``sizes`` for each of ``num_ranks`` ranks, at most ``per_rank`` each (their
    total must fit): longest first (ties by index), each to the rank with the smallest total
    that has room, ties to the lower rank (the longest-processing-time rule). Host only."""
    sizes = np.asarray(sizes, dtype=np.int64)
    ranks = [[] for _ in range(num_ranks)]
    open_ranks = [(0, rank) for rank in range(num_ranks)]  # (total, rank), a heap
    for index in np.lexsort((np.arange(len(sizes)), -sizes)).tolist():
        total, rank = heapq.heappop(open_ranks)
        ranks[rank].append(index)
        if len(ranks[rank]) < per_rank:  # a full rank leaves the heap
            heapq.heappush(open_ranks, (total + int(sizes[index]), rank))
    return ranks


def balanced_order(tokens: np.ndarray, data_parallel_size: int, micro_batch_size: int) -> np.ndarray:
    """The order (int64 indices into ``tokens``, one global batch of real-token counts) whose
    reading by `sampler.MicroBatchSampler` gives every rank near-equal real tokens.

    Rank ``r`` reads positions ``k * mbs * dp + r * mbs + j`` at micro step ``k``; so rank
    ``r``'s ``t``-th row goes to position ``(t // mbs) * mbs * dp + r * mbs + t % mbs``."""
    size = len(tokens)
    rows = deal_to_ranks(tokens, data_parallel_size, size // data_parallel_size)
    order = np.empty(size, dtype=np.int64)
    for rank, taken in enumerate(rows):
        for t, row in enumerate(taken):
            step, j = divmod(t, micro_batch_size)
            order[step * micro_batch_size * data_parallel_size + rank * micro_batch_size + j] = row
    return order


def batch_tokens(dataset, step: int, global_batch_size: int) -> np.ndarray:
    """Real tokens (``dataset.real_positions``) of global batch ``step``'s samples, int64
    (fewer where the dataset ends)."""
    first = step * global_batch_size
    return np.asarray([dataset.real_positions(first + i)
                       for i in range(min(global_batch_size, len(dataset) - first))],
                      dtype=np.int64)


def rank_tokens(tokens: np.ndarray, data_parallel_size: int, micro_batch_size: int) -> np.ndarray:
    """Real tokens each rank reads from one global batch laid out in sample order."""
    steps = tokens.reshape(-1, data_parallel_size, micro_batch_size)
    return steps.sum(axis=(0, 2))


class DataParallelBalanced(torch.utils.data.Dataset):
    """``dataset`` with every global batch of ``global_batch_size`` samples in `balanced_order`.
    ``dataset.real_positions(i)`` gives sample ``i``'s real tokens (cheap: from the row plan)."""

    def __init__(self, dataset, global_batch_size: int, data_parallel_size: int,
                 micro_batch_size: int):
        if global_batch_size % (data_parallel_size * micro_batch_size):
            raise ValueError(f"global batch size is wrong: {global_batch_size} is not a multiple "
                             f"of {data_parallel_size} ranks x {micro_batch_size} rows.")
        self.dataset, self.batch = dataset, global_batch_size
        self.dp, self.mbs = data_parallel_size, micro_batch_size
        self._window, self._order = -1, None

    def __len__(self) -> int:
        return len(self.dataset)

    def _source_index(self, index: int) -> int:
        window, offset = divmod(int(index), self.batch)
        if window != self._window:
            tokens = batch_tokens(self.dataset, window, self.batch)
            self._order = (balanced_order(tokens, self.dp, self.mbs)
                           if len(tokens) == self.batch else np.arange(len(tokens)))
            self._window = window
        return window * self.batch + int(self._order[offset])

    def __getitem__(self, index: int):
        return self.dataset[self._source_index(index)]

    def real_positions(self, index: int) -> int:
        return self.dataset.real_positions(self._source_index(index))


def balance_report(dataset, global_batch_size: int, data_parallel_size: int,
                   micro_batch_size: int, max_steps: int = 100) -> tuple[float, float]:
    """``(mean, worst)`` over the first ``max_steps`` global batches of ``dataset`` of the
    largest rank's real tokens over the ranks' mean: 1.0 is perfect balance."""
    ratios = []
    steps = min(max_steps, len(dataset) // global_batch_size)
    for step in range(steps):
        per_rank = rank_tokens(batch_tokens(dataset, step, global_batch_size), data_parallel_size, micro_batch_size)
        ratios.append(per_rank.max() / max(per_rank.mean(), 1))
    return (float(np.mean(ratios)), float(np.max(ratios))) if ratios else (1.0, 1.0)
