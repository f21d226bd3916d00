"""Capacity recommendation math and the advisor CLI end to end (CPU)."""

import json
import re

import numpy as np
import pytest

from megatron.training.datasets import MockPackedDataset, collate_packed_rows
import tools.capacity_advisor as ca
from tools.capacity_advisor import fallback_rate, main, micro_batch_counts, recommend_capacity

# 90 micro-batches with 1 segment, 9 with 5, one with 10.
COUNTS = [1] * 90 + [5] * 9 + [10]


@pytest.mark.parametrize(
    "target, capacity, rate",
    [(0.0, 10, 0.0), (0.01, 5, 0.01), (0.05, 5, 0.01), (0.10, 1, 0.10), (0.5, 1, 0.10)],
)
def test_recommendation_on_a_known_distribution(target, capacity, rate):
    assert recommend_capacity(COUNTS, target) == (capacity, pytest.approx(rate))


def test_fallback_rate_counts_strictly_more_than_capacity():
    assert fallback_rate(COUNTS, 4) == pytest.approx(0.10)
    assert fallback_rate(COUNTS, 5) == pytest.approx(0.01)
    assert fallback_rate(COUNTS, 10) == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_recommendation_is_the_smallest_capacity_meeting_the_target(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 200, size=int(rng.integers(1, 500)))
    for target in (0.0, 0.003, 0.01, 0.1, 0.37):
        capacity, rate = recommend_capacity(counts, target)
        assert rate == fallback_rate(counts, capacity) <= target
        if capacity > 1:
            assert fallback_rate(counts, capacity - 1) > target


@pytest.mark.parametrize("target", [-0.1, 1.0, 2.0])
def test_bad_target_is_rejected(target):
    with pytest.raises(ValueError, match="--target-fallback-rate"):
        recommend_capacity(COUNTS, target)


def test_empty_counts_are_rejected():
    with pytest.raises(ValueError, match="empty"):
        recommend_capacity([], 0.01)


def test_micro_batch_counts_match_collate():
    data = MockPackedDataset(10, 256, 100, seed=1, doc_length_median=20)
    rows = [data[i] for i in range(len(data))]
    segments, documents = micro_batch_counts(rows, 3)
    assert len(segments) == 3  # the 10th row is an incomplete micro-batch
    for k in range(3):
        batch = collate_packed_rows(rows[3 * k: 3 * k + 3])
        assert segments[k] == batch["num_segments"] and documents[k] == batch["num_documents"]


def test_micro_batch_counts_need_one_full_micro_batch():
    data = MockPackedDataset(2, 64, 100, seed=1)
    with pytest.raises(ValueError, match="fewer than one micro-batch of 4"):
        micro_batch_counts([data[0], data[1]], 4)


def recommended_flag(output):
    return int(re.search(r"--cuda-graph-max-packed-seqs (\d+)", output).group(1))


def test_cli_on_mock_data_prints_table_and_flag(capsys):
    argv = ["--mock-data", "--seq-length", "1024", "--vocab-size", "1000", "--mock-doc-length-median", "64",
            "--num-samples", "200", "--micro-batch-size", "2", "--seed", "9"]
    assert main(argv) == 0
    output = capsys.readouterr().out
    data = MockPackedDataset(200, 1024, 1000, seed=9, doc_length_median=64)
    segments, _ = micro_batch_counts([data[i] for i in range(200)], 2)
    assert recommended_flag(output) == recommend_capacity(segments, 0.01)[0]
    assert "100 micro-batches of 2 row(s)" in output
    for label in ("P50", "P90", "P99", "max", "documents", "segments", "1024"):
        assert label in output


def test_cli_on_jsonl(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    # Row 1: three 3-token documents (2 positions each) in 8 positions -> 4 segments; row 2: one
    # 9-token document filling the row -> 1 segment.
    records = [{"input_ids": [1, 2, 3]}] * 3 + [{"input_ids": list(range(1, 10))}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["--data-path", str(path), "--seq-length", "8", "--vocab-size", "16",
                 "--target-fallback-rate", "0"]) == 0
    output = capsys.readouterr().out
    assert "4 documents in 2 rows" in output
    assert recommended_flag(output) == 4


def test_ladder_suggested_only_when_the_top_capacity_is_far_above_typical_counts():
    counts = [5] * 60 + [12] * 35 + [200] * 5
    assert ca.suggest_ladder(counts, 256) == [8, 16]
    assert ca.mean_padded_capacity(counts, [8, 16, 256]) == pytest.approx(0.6 * 8 + 0.35 * 16 + 0.05 * 256)
    assert ca.suggest_ladder([10] * 10, 16) == []  # the top is the typical count already
    assert ca.suggest_ladder(counts, 24) == [8]  # 16 is not worth it below a top of 24
