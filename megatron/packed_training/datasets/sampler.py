"""Which sample indices a data-parallel rank reads at each micro-batch step.

Global step ``k`` covers samples ``[consumed + k*mbs*dp, consumed + (k+1)*mbs*dp)``; rank ``r``
takes the contiguous slice ``[r*mbs, (r+1)*mbs)`` of it. The order depends only on the
sample index, so a run resumed from ``consumed_samples`` continues exactly where it stopped.
"""

from typing import Iterator


def _check_int(name: str, value, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} is wrong: {value!r}. {hint}")


class MicroBatchSampler:
    """Iterable of index lists (``micro_batch_size`` ints each) for one data-parallel rank.

    A trailing global step with fewer than ``micro_batch_size * data_parallel_size`` samples
    is dropped, so every rank yields the same number of micro-batches (``len(self)``).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ):
        _check_int("total_samples", total_samples, 0, "The dataset length must be an integer >= 0.")
        _check_int("micro_batch_size", micro_batch_size, 1, "Set --micro-batch-size to an integer >= 1.")
        _check_int("data_parallel_size", data_parallel_size, 1, "It must be an integer >= 1.")
        _check_int("data_parallel_rank", data_parallel_rank, 0, "It must be an integer >= 0.")
        if data_parallel_rank >= data_parallel_size:
            raise ValueError(
                f"data_parallel_rank is wrong: {data_parallel_rank}. It must be below "
                f"data_parallel_size {data_parallel_size}."
            )
        _check_int("consumed_samples", consumed_samples, 0, "It must be an integer >= 0.")
        if consumed_samples > total_samples:
            raise ValueError(
                f"consumed_samples is wrong: {consumed_samples}, more than the {total_samples} "
                f"samples of the dataset. Check the checkpoint against --train-iters and "
                f"--global-batch-size."
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def __len__(self) -> int:
        step = self.micro_batch_size * self.data_parallel_size
        return (self.total_samples - self.consumed_samples) // step

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.data_parallel_size
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        for k in range(len(self)):
            start = first + k * step
            yield list(range(start, start + self.micro_batch_size))
