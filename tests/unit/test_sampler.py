"""MicroBatchSampler (resume, data-parallel split) and PackedRowDataset (epoch shuffling)."""

import numpy as np
import pytest

from megatron.packed_training.datasets.packed_row_dataset import PackedRowDataset
from megatron.packed_training.datasets.packing import Document
from megatron.packed_training.datasets.row_plan import pack_documents
from megatron.packed_training.datasets.sampler import MicroBatchSampler


def test_steps_and_rank_slices():
    assert list(MicroBatchSampler(12, 0, 2, 0, 2)) == [[0, 1], [4, 5], [8, 9]]
    assert list(MicroBatchSampler(12, 0, 2, 1, 2)) == [[2, 3], [6, 7], [10, 11]]


def test_trailing_partial_step_is_dropped():
    sampler = MicroBatchSampler(11, 0, 2, 1, 2)
    assert len(sampler) == 2 and list(sampler) == [[2, 3], [6, 7]]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 7])
def test_resume_from_consumed_samples_continues_exactly(stop_after):
    mbs, dp = 3, 4
    for rank in range(dp):
        uninterrupted = list(MicroBatchSampler(120, 0, mbs, rank, dp))
        resumed = list(MicroBatchSampler(120, stop_after * mbs * dp, mbs, rank, dp))
        assert uninterrupted[:stop_after] + resumed == uninterrupted


def test_data_parallel_ranks_are_disjoint_and_cover_every_sample():
    mbs, dp, consumed = 2, 3, 12
    per_rank = [sum(MicroBatchSampler(60, consumed, mbs, r, dp), []) for r in range(dp)]
    flat = sum(per_rank, [])
    assert len(flat) == len(set(flat))
    assert sorted(flat) == list(range(consumed, 60))


def test_consumed_equal_to_total_yields_nothing():
    assert list(MicroBatchSampler(8, 8, 2, 0, 1)) == []


@pytest.mark.parametrize(
    "args, message",
    [
        ((10, 0, 0, 0, 1), "micro_batch_size is wrong: 0"),
        ((10, 0, 2, 2, 2), "data_parallel_rank is wrong: 2"),
        ((10, 0, 2, -1, 2), "data_parallel_rank is wrong: -1"),
        ((10, 0, 2, 0, 0), "data_parallel_size is wrong: 0"),
        ((10, 12, 2, 0, 1), "consumed_samples is wrong: 12"),
        ((10, -2, 2, 0, 1), "consumed_samples is wrong: -2"),
        ((-1, 0, 2, 0, 1), "total_samples is wrong: -1"),
    ],
)
def test_bad_sampler_arguments_are_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        MicroBatchSampler(*args)


def numbered_rows(count):
    """Rows whose first token is their index + 1."""
    documents = [Document(np.array([i + 1, 0, 0, 0], dtype=np.int64), None, f"t:{i}") for i in range(count)]
    return list(pack_documents(documents, 3))


def first_tokens(dataset, indices):
    return [int(dataset[i].tokens[0]) for i in indices]


def test_each_epoch_visits_every_row_once_in_a_new_order():
    rows = numbered_rows(20)
    dataset = PackedRowDataset(rows, num_samples=60, seed=5)
    epochs = [first_tokens(dataset, range(e * 20, (e + 1) * 20)) for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(1, 21))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(1, 21))


def test_row_order_depends_only_on_seed():
    rows = numbered_rows(20)
    a = PackedRowDataset(rows, num_samples=40, seed=5)
    b = PackedRowDataset(rows, num_samples=40, seed=5)
    c = PackedRowDataset(rows, num_samples=40, seed=6)
    # Random access in a different order must not change what an index returns.
    assert first_tokens(a, range(40)) == first_tokens(b, reversed(range(40)))[::-1]
    assert first_tokens(a, range(40)) != first_tokens(c, range(40))


def test_packed_row_dataset_rejects_no_rows_and_bad_counts():
    with pytest.raises(ValueError, match="0 rows"):
        PackedRowDataset([], num_samples=4, seed=0)
    with pytest.raises(ValueError, match="num_samples is wrong"):
        PackedRowDataset(numbered_rows(2), num_samples=-1, seed=0)
    with pytest.raises(IndexError):
        PackedRowDataset(numbered_rows(2), num_samples=4, seed=0)[4]


def test_rampup_becomes_megatron_cores_step_schedule():
    from megatron.core import num_microbatches_calculator as calculator
    from megatron.packed_training.extra_args import rampup_schedule

    assert rampup_schedule([4, 2, 32], 8, 1024) == "0:4 16384:6 32768:8"
    # Fewer samples than increments: the batch jumps; no ramp-up samples: the full batch.
    assert rampup_schedule([4, 1, 2], 8, 10) == "0:4 10:6 20:8"
    assert rampup_schedule([4, 2, 0], 8, 10) == "0:8"
    # As Megatron-LM's start-up builds it: thresholds in tokens of --seq-length.
    calculator.init_num_microbatches_calculator(
        0, None, 8, 1, 1, step_batch_size_schedule=rampup_schedule([4, 2, 32], 8, 1024),
        seq_length=1024)
    consumed, sizes = 0, []
    for _ in range(8):
        calculator.update_num_microbatches(consumed, consistency_check=True)
        sizes.append(calculator.get_current_global_batch_size())
        consumed += sizes[-1]
    calculator.destroy_num_microbatches_calculator()
    # Megatron's ramp: int(consumed / (32 / 2)) increments of 2 from 4, then 8 past 32 samples.
    assert sizes == [4, 4, 4, 4, 6, 6, 6, 8]
