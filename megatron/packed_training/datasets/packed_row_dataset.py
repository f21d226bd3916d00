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

    def __init__(self, rows: Sequence[PackedRow], num_samples: int, seed: int,
                 stream: int | None = None):
        if len(rows) == 0:
            raise ValueError(
                "packed rows are wrong: 0 rows. The data produced no document with at least "
                "2 tokens; check --data-path."
            )
        if not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"num_samples is wrong: {num_samples!r}. Pass an integer >= 0.")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed is wrong: {seed!r}. Set --seed to an integer >= 0.")
        # Planned rows are built when read (row_plan.PlannedRows); others are kept as given.
        self.rows = rows if hasattr(rows, "plan") else list(rows)
        self.num_samples = num_samples
        self.seed = seed
        self.stream = stream  # a blend's source index: its own order beside the others'
        self._real = None
        # Reads are mostly sequential: keep the current epoch's permutation.
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices (int64 ``[len(rows)]``) in the order epoch ``epoch`` serves them."""
        if epoch != self._epoch:
            key = [self.seed, epoch] if self.stream is None else [self.seed, self.stream, epoch]
            self._order = np.random.default_rng(key).permutation(len(self.rows))
            self._epoch = epoch
        return self._order

    def row_index(self, index: int) -> int:
        """Which row sample ``index`` serves."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range [0, {self.num_samples})")
        epoch, position = divmod(int(index), len(self.rows))
        return int(self.epoch_order(epoch)[position])

    def __getitem__(self, index: int) -> PackedRow:
        return self.rows[self.row_index(index)]

    def real_positions(self, index: int) -> int:
        """Positions of sample ``index`` that hold document tokens (no row is built for
        planned rows)."""
        if self._real is None:
            self._real = (self.rows.plan.real_positions() if hasattr(self.rows, "plan") else
                          np.asarray([row.real_positions for row in self.rows]))
        return int(self._real[self.row_index(index)])
