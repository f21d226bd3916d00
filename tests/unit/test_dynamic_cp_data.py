"""Dynamic-CP data on CPU: rows that carry a CP size, each rank's turns per iteration, mock
documents, the layout graph banks are captured with (the per-bank plan: test_dispatch.py,
test_graph_runtime.py)."""

from collections import Counter

import numpy as np
import pytest
import torch

from megatron.packed_model.dynamic_cp import cp_padded_length
from megatron.packed_training.datasets.dynamic_cp import DynamicCPBatches, pack_rows_for_dynamic_cp
from megatron.packed_training.datasets.mock import mock_documents
from megatron.packed_training.datasets.packed_row_dataset import PackedRowDataset
from megatron.packed_training.datasets.packing import Document, PackingStats
from megatron.packed_training.packed_step import dummy_micro_batch


def _documents(token_counts):
    return [Document(np.arange(1, n + 1, dtype=np.int64), None, f"doc:{i}")
            for i, n in enumerate(token_counts)]


def test_rows_hold_cp_size_times_tokens_per_rank_with_cp_padded_documents():
    # Positions 99, 9, 300, 60, 5 with N = 128: 99 + 9 fit at size 1; 300 opens size 4.
    rows = pack_rows_for_dynamic_cp(_documents([100, 10, 301, 61, 6]), (1, 2, 4), 128)
    assert [(r.cp_size, len(r.tokens), r.num_documents) for r in rows] == [
        (1, 128, 2), (4, 512, 3)]
    big = rows[1]
    segments = np.diff(big.cu_seqlens)
    assert list(segments[:3]) == [cp_padded_length(n, 4) for n in (300, 60, 5)]
    assert list(np.diff(big.cu_seqlens_actual)[:3]) == [300, 60, 5]
    # Each document's tokens lead its padded segment; the padding carries no loss.
    assert big.loss_mask.sum() == 365 and big.tokens[300] == 0 and big.tokens[299] == 300


def test_rows_skip_empty_documents_and_truncate_or_reject_long_ones():
    stats = PackingStats()
    rows = pack_rows_for_dynamic_cp(_documents([1, 40, 600]), (1, 2), 128, stats=stats,
                                    long_document_policy="truncate")
    assert [r.cp_size for r in rows] == [1, 2]
    assert (stats.skipped_empty, stats.truncated, stats.truncated_tokens) == (1, 1, 343)
    assert rows[1].num_documents == 1 and rows[1].loss_mask.sum() == 256
    for spelling in (dict(long_document_policy="reject"), dict(reject_long_documents=True)):
        with pytest.raises(ValueError, match="doc:2 has 599 training positions, more than the "
                                             "largest CP size holds \\(2 x 128 = 256\\)\\. Use "
                                             "--long-document-policy split"):
            pack_rows_for_dynamic_cp(_documents([1, 40, 600]), (1, 2), 128, **spelling)


def test_long_documents_are_split_by_default_into_pieces_of_the_largest_size():
    # 599 positions, largest size 2 x 128 = 256: pieces of 256, 256 and 87 positions.
    stats = PackingStats()
    rows = pack_rows_for_dynamic_cp(_documents([40, 600]), (1, 2), 128, stats=stats)
    assert [(r.cp_size, r.num_documents) for r in rows] == [(1, 1), (2, 1), (2, 1), (1, 1)]
    assert [int(r.loss_mask.sum()) for r in rows] == [39, 256, 256, 87]
    assert (stats.split, stats.pieces, stats.truncated, stats.tokens) == (1, 3, 0, 39 + 599)
    # Consecutive pieces share a token: every prediction of the document is in one piece.
    assert rows[1].tokens[0] == 1 and rows[2].tokens[0] == 257 and rows[1].labels[255] == 257


def test_every_micro_batch_of_an_iteration_runs_once_on_its_group():
    rows = pack_rows_for_dynamic_cp(mock_documents(40_000, 512, 97, 3, 100, 1.3), (1, 2, 4), 128)
    assert {r.cp_size for r in rows} == {1, 2, 4}
    dataset = PackedRowDataset(rows, 64, seed=0)
    ranks = [DynamicCPBatches(dataset, 8, 8, rank, 4) for rank in range(4)]
    for iteration in range(3):
        turns = [next(reader) for reader in ranks]
        assert all(turns), "every rank gets at least one micro-batch"
        first = iteration * 8 + 8  # consumed 8 samples before the first iteration
        seen = Counter()
        for rank, batches in enumerate(turns):
            for batch in batches:
                turn = batch["cp_turn"]
                assert rank in turn.ranks() and turn.first_rank % turn.cp_size == 0
                row = dataset[first + turn.micro_batch]
                assert turn.cp_size == row.cp_size
                assert torch.equal(batch["tokens"][0], torch.from_numpy(row.tokens))
                seen[turn.micro_batch] += 1
                assert batch["iteration_positions"] == sum(
                    len(dataset[first + i].tokens) for i in range(8))
        # A micro-batch of size c appears on its c ranks, and every one of the 8 appears.
        assert sorted(seen) == list(range(8))
        assert all(seen[i] == dataset[first + i].cp_size for i in seen)
    with pytest.raises(StopIteration):
        for _ in range(10):
            next(ranks[0])
    cycled = DynamicCPBatches(dataset, 56, 8, 0, 4, cycle=True)
    next(cycled)
    assert next(cycled)[0]["cp_turn"] is not None and cycled.consumed == 8


def test_the_run_reads_each_ranks_turns_one_iteration_per_item():
    """What Megatron-LM's loop gets from the data provider under --dynamic-cp-sizes: training
    resumes at the consumed samples, validation cycles; each item is one iteration's turns."""
    from argparse import Namespace

    from megatron.packed_training.datasets.builder import build_rank_iterators

    rows = pack_rows_for_dynamic_cp(mock_documents(4000, 128, 97, 3, 48, 1.3), (1, 2), 64)
    train, valid = PackedRowDataset(rows, 16, 0), PackedRowDataset(rows, 4, 1)
    args = Namespace(dynamic_cp_sizes=[1, 2], global_batch_size=4, consumed_train_samples=8)
    train_iterations, valid_iterations = build_rank_iterators(train, valid, args, 1, 2)
    expected = DynamicCPBatches(train, 8, 4, 1, 2)
    for _ in range(2):
        turns, again = next(train_iterations), next(expected)
        assert isinstance(turns, list) and turns
        assert [t["cp_turn"] for t in turns] == [t["cp_turn"] for t in again]
    with pytest.raises(StopIteration):  # 16 samples: iterations from sample 8 and 12 only
        next(train_iterations)
    assert all(next(valid_iterations) for _ in range(3))  # cycles over its 4 samples
    assert build_rank_iterators(train, None, args, 0, 2)[1] is None


def test_global_batch_must_give_every_rank_a_turn():
    dataset = PackedRowDataset(pack_rows_for_dynamic_cp(_documents([50] * 8), (1, 2), 64), 8, 0)
    with pytest.raises(ValueError, match="global batch size is wrong: 2 micro-batches for 4 ranks"):
        DynamicCPBatches(dataset, 0, 2, 0, 4)


def test_mock_documents_are_deterministic_bounded_walks():
    docs = mock_documents(5_000, 300, 50, seed=7, doc_length_median=64, doc_length_sigma=1.5)
    again = mock_documents(5_000, 300, 50, seed=7, doc_length_median=64, doc_length_sigma=1.5)
    assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(docs, again))
    # Positions count at most a row (300) each; lengths are as drawn, longer ones are the
    # packer's to cut (its long-document policy).
    assert sum(min(len(d.input_ids), 301) - 1 for d in docs) >= 5_000
    assert all(len(d.input_ids) >= 2 for d in docs) and max(len(d.input_ids) for d in docs) > 301
    for doc in docs:
        ids = doc.input_ids
        assert ids.min() >= 1 and ids.max() < 50
        steps = set(((ids[1:] - ids[:-1]) % 49).tolist())
        assert len(steps) == 1 and steps <= {1, 2, 3}


def test_dummy_micro_batch_is_one_loss_free_segment_over_the_buffer():
    batch = dummy_micro_batch(64)
    assert batch["cu_seqlens"].tolist() == [0, 64] and batch["loss_mask"].sum() == 0
    assert batch["tokens"].shape == (1, 64) and batch["num_documents"] == 0
