"""A fixed list of packed rows served for ``num_samples`` samples, reshuffled every epoch."""

from typing import Sequence

import numpy as np
import torch

from megatron.packed_training.datasets.packing import PackedRow


class PackedRowDataset(torch.utils.data.Dataset):
    """Sample ``i`` is row ``perm_e[i % n]`` of epoch ``e = i // n`` (``n = len(rows)``).

    ``perm_e`` is a permutation drawn from ``(seed, e)`` alone, so every rank and every resumed
    run sees the same order, and an epoch visits each row exactly once. Items are the stored
    `PackedRow` objects themselves (not copies): consumers must not write into them.
    """

    def __init__(self, rows: Sequence[PackedRow], num_samples: int, seed: int):
        if len(rows) == 0:
            raise ValueError(
                "packed rows are wrong: 0 rows. The data produced no document with at least "
                "2 tokens; check --data-path."
            )
        if not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"num_samples is wrong: {num_samples!r}. Pass an integer >= 0.")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed is wrong: {seed!r}. Set --seed to an integer >= 0.")
        self.rows = list(rows)
        self.num_samples = num_samples
        self.seed = seed
        # Reads are mostly sequential: keep the current epoch's permutation.
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices (int64 ``[len(rows)]``) in the order epoch ``epoch`` serves them."""
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
            self._epoch = epoch
        return self._order

    def __getitem__(self, index: int) -> PackedRow:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range [0, {self.num_samples})")
        epoch, position = divmod(int(index), len(self.rows))
        return self.rows[int(self.epoch_order(epoch)[position])]
