"""build_datasets / build_data_iterator / describe_packing from CLI-shaped arguments."""

import json
from argparse import Namespace

import pytest
import torch

from megatron.packed_training.datasets.builder import (
    build_data_iterator,
    build_datasets,
    build_rank_iterators,
    describe_packing,
)
from megatron.packed_training.datasets.mock import MockPackedDataset
from megatron.packed_training.datasets.packing import PackingStats


def make_args(**overrides):
    args = dict(
        seq_length=8, vocab_size=50, seed=3, data_path=None, valid_data_path=None, mock_data=True,
        mock_doc_length_median=4, mock_doc_length_sigma=0.5, reject_long_documents=False, sft=True,
        train_iters=10, global_batch_size=4, eval_iters=2, eval_interval=5,
    )
    return Namespace(**(args | overrides))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


SFT_RECORDS = [{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]}, {"input_ids": [7, 8, 9]}]


def test_mock_sample_counts_and_valid_seed():
    train, valid, stats = build_datasets(make_args())
    assert isinstance(train, MockPackedDataset) and len(train) == 40 and train.seed == 3
    # eval_iters * gbs * (train_iters // eval_interval + 1) = 2 * 4 * 3
    assert len(valid) == 24 and valid.seed == 4
    assert stats is None


def test_sample_counts_from_train_samples_with_a_rampup():
    args = make_args(train_iters=None, train_samples=30, rampup_batch_size=["2", "2", "8"])
    train, valid, _ = build_datasets(args)
    # At most 30 / 2 = 15 iterations (the ramp-up's first batch): 15 // 5 + 1 evaluations.
    assert len(train) == 30 and len(valid) == 2 * 4 * 4


def test_no_valid_dataset_when_evaluation_is_off():
    _, valid, _ = build_datasets(make_args(eval_interval=0))
    assert valid is None


def test_sft_uses_the_jsonl_mask(tmp_path):
    args = make_args(mock_data=False, data_path=write_jsonl(tmp_path / "d.jsonl", SFT_RECORDS))
    train, valid, stats = build_datasets(args)
    assert len(train) == 40 and valid is None
    assert (stats.documents, stats.rows) == (2, 1)
    assert train[0].loss_mask.tolist() == [0, 1, 1, 1, 1, 1, 0, 0]


def test_pretraining_ignores_the_jsonl_mask(tmp_path):
    args = make_args(mock_data=False, sft=False, data_path=write_jsonl(tmp_path / "d.jsonl", SFT_RECORDS))
    train, _, _ = build_datasets(args)
    assert train[0].loss_mask.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]


def test_jsonl_valid_file_is_packed_separately(tmp_path):
    args = make_args(
        mock_data=False,
        data_path=write_jsonl(tmp_path / "t.jsonl", SFT_RECORDS),
        valid_data_path=write_jsonl(tmp_path / "v.jsonl", [{"input_ids": [40, 41, 42]}]),
    )
    _, valid, _ = build_datasets(args)
    assert len(valid) == 24 and valid[0].tokens.tolist()[:2] == [40, 41]


def test_reject_long_documents_reaches_the_packer(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(1, 20))}])
    with pytest.raises(ValueError, match=r"d\.jsonl:1 has 19 tokens"):
        build_datasets(make_args(mock_data=False, data_path=path, reject_long_documents=True))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mock_data=True, data_path="x.jsonl"), "both --mock-data and --data-path"),
        (dict(mock_data=False, data_path=None), "none given"),
        (dict(train_iters=0), "--train-iters"),
        (dict(global_batch_size=0), "--global-batch-size"),
    ],
)
def test_bad_data_arguments_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_datasets(make_args(**overrides))


def test_empty_jsonl_is_rejected(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [3]}])
    with pytest.raises(ValueError, match="no document with at least 2 tokens"):
        build_datasets(make_args(mock_data=False, data_path=path))


def test_iterator_resumes_where_it_stopped():
    dataset = MockPackedDataset(24, 16, 50, seed=0, doc_length_median=5)
    full = [b["tokens"] for b in build_data_iterator(dataset, 0, 2, 1, 2)]
    resumed = [b["tokens"] for b in build_data_iterator(dataset, 8, 2, 1, 2)]
    assert len(full) == 6 and len(resumed) == 4
    assert all((a == b).all() for a, b in zip(full[2:], resumed))
    assert full[0].tolist() == [dataset[2].tokens.tolist(), dataset[3].tokens.tolist()]


def test_worker_processes_give_the_same_micro_batches():
    dataset = MockPackedDataset(24, 16, 50, seed=0, doc_length_median=5)
    inline = list(build_data_iterator(dataset, 4, 2, 1, 2))
    workers = list(build_data_iterator(dataset, 4, 2, 1, 2, num_workers=2))
    assert len(inline) == len(workers) == 5
    for a, b in zip(inline, workers):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def test_workers_outlive_the_exit_signal():
    """torchrun passes SIGTERM to the whole process group: with --exit-signal-handler the
    loader's workers must keep serving until training has saved and stopped."""
    import os
    import signal
    import time

    dataset = MockPackedDataset(64, 16, 50, seed=0, doc_length_median=5)
    iterator = build_data_iterator(dataset, 0, 1, 0, 1, num_workers=1,
                                   exit_signal=signal.SIGUSR1)
    next(iterator)
    for worker in iterator._workers:
        os.kill(worker.pid, signal.SIGUSR1)  # SIGUSR1's default action ends the process
    time.sleep(0.5)
    assert all(worker.is_alive() for worker in iterator._workers)
    assert len([next(iterator) for _ in range(20)]) == 20


def test_cycling_iterator_restarts_from_zero():
    dataset = MockPackedDataset(4, 16, 50, seed=0, doc_length_median=5)
    iterator = build_data_iterator(dataset, 2, 2, 0, 1, cycle=True)
    firsts = [next(iterator)["tokens"][0].tolist() for _ in range(4)]
    assert firsts == [dataset[i].tokens.tolist() for i in (2, 0, 2, 0)]


def test_cycling_a_dataset_smaller_than_a_micro_batch_is_rejected():
    with pytest.raises(ValueError, match="cannot be cycled"):
        build_data_iterator(MockPackedDataset(1, 16, 50, seed=0), 0, 2, 0, 1, cycle=True)


def test_rank_iterators_read_micro_batches_from_the_consumed_samples():
    """What Megatron-LM's loop gets from the data provider: this data-parallel rank's
    micro-batches, training resumed at a checkpoint's consumed samples, validation cycling."""
    train = MockPackedDataset(24, 16, 50, seed=0, doc_length_median=5)
    valid = MockPackedDataset(4, 16, 50, seed=1, doc_length_median=5)
    args = Namespace(dynamic_cp_sizes=None, consumed_train_samples=8, micro_batch_size=2,
                     num_workers=0, exit_signal_handler=False)
    train_iterator, valid_iterator = build_rank_iterators(train, valid, args, 1, 2)
    assert next(train_iterator)["tokens"][0].tolist() == train[10].tokens.tolist()
    assert len(list(train_iterator)) == 3
    assert [next(valid_iterator)["tokens"][0].tolist() for _ in range(2)] == [
        valid[2].tokens.tolist()] * 2
    assert build_rank_iterators(train, None, args, 0, 2)[1] is None


def test_describe_packing():
    stats = PackingStats(documents=30, rows=10, skipped_empty=2, truncated=1, padding_tokens=10, tokens=30)
    line = describe_packing(stats)
    assert "30 documents into 10 rows" in line and "skipped 2 empty" in line
    assert "truncated 1" in line and "padding 25.0% of 40 positions" in line
    assert "synthetic" in describe_packing(None)
