"""Capacity recommendation math and the advisor CLI end to end (CPU)."""

import json
import re

import numpy as np
import pytest

from megatron.packed_training.datasets import MockPackedDataset, collate_packed_rows
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


# ------------------------------------------------------------------------------ MoE capacity

def router_loads(peaks, experts=8, topk=2, tokens=1024, per_iteration=0):
    return ca.RouterLoads(experts, topk, tokens, np.asarray(peaks, dtype=np.int64), per_iteration)


# An even share is 1024 x 2 / 8 = 256 tokens per expert; 90 micro-batches peak at it, 9 at
# 300, one at 400.
PEAKS = [256] * 90 + [300] * 9 + [400]


@pytest.mark.parametrize("target, factor, capacity, rate", [
    (0.0, 1.56, 400, 0.0),    # 256 x 1.56 = 399.4 -> 400; 1.55 -> 397 would drop
    (0.01, 1.17, 300, 0.01),  # 256 x 1.17 = 299.5 -> 300
    (0.1, 1.0, 256, 0.1),
])
def test_capacity_factor_on_a_known_load_distribution(target, factor, capacity, rate):
    loads = router_loads(PEAKS)
    assert ca.recommend_capacity_factor(loads, target) == (factor, capacity, pytest.approx(rate))
    assert ca.expert_capacity(loads, round(factor - 0.01, 2)) < capacity


@pytest.mark.parametrize("seed", range(5))
def test_capacity_factor_is_the_smallest_meeting_the_target(seed):
    rng = np.random.default_rng(seed)
    tokens = int(rng.integers(64, 4096))
    loads = router_loads(rng.integers(1, tokens // 2, size=int(rng.integers(1, 300))),
                         experts=16, topk=4, tokens=tokens)
    for target in (0.0, 0.01, 0.2):
        factor, capacity, rate = ca.recommend_capacity_factor(loads, target)
        assert capacity == ca.expert_capacity(loads, factor)
        assert rate == fallback_rate(loads.peak_loads, capacity) <= target
        if factor > 0.01:
            lower = ca.expert_capacity(loads, round(factor - 0.01, 2))
            assert fallback_rate(loads.peak_loads, lower) > target


def test_capacity_factor_is_capped_where_drop_and_pad_stops():
    # 3 experts, top-2: factor x 2 <= 3 caps it at 1.5, a capacity of every token.
    loads = router_loads([1024], experts=3, topk=2)
    assert loads.max_factor == 1.5
    assert ca.recommend_capacity_factor(loads, 0.0) == (1.5, 1024, 0.0)
    # 7 experts, top-3: 2.33 (x 3 = 6.99 <= 7) leaves each expert a token short of all.
    loads = router_loads([1024], experts=7, topk=3)
    factor, capacity, rate = ca.recommend_capacity_factor(loads, 0.0)
    assert (factor, capacity, rate) == (2.33, 1023, 1.0)
    assert "the target is out of reach" in ca.format_moe_report(loads, 0.0)


def test_bad_overflow_target_is_rejected():
    with pytest.raises(ValueError, match="target overflow rate is wrong: 1.0. Set "
                                         r"--target-overflow-rate in \[0, 1\)"):
        ca.recommend_capacity_factor(router_loads(PEAKS), 1.0)


def write(tmp_path, record):
    path = tmp_path / "loads.json"
    path.write_text(json.dumps(record))
    return str(path)


SHAPE = {"num_experts": 8, "moe_router_topk": 2, "tokens_per_rank": 1024}


@pytest.mark.parametrize("loads", [
    {"peak_loads": [256, 300, 300]},
    {"peak_loads": {"300": 2, "256": 1}},
    {"expert_loads": [[[256, 0], [10, 20]], [300, 5], [[1, 2], [300, 3]]]},  # per layer, expert
])
def test_router_load_formats(tmp_path, loads):
    read = ca.read_router_loads(write(tmp_path, SHAPE | loads))
    assert sorted(read.peak_loads.tolist()) == [256, 300, 300]
    assert (read.num_experts, read.topk, read.tokens_per_rank) == (8, 2, 1024)


@pytest.mark.parametrize("record, message", [
    ({"peak_loads": [1]}, "lacks a positive integer num_experts, moe_router_topk, "
                          "tokens_per_rank"),
    (SHAPE | {"tokens_per_rank": 0, "peak_loads": [1]}, "lacks a positive integer tokens_per_rank"),
    (SHAPE, "has neither peak_loads nor expert_loads"),
    (SHAPE | {"peak_loads": []}, "holds no micro-batch"),
])
def test_bad_router_loads_are_rejected(tmp_path, record, message):
    with pytest.raises(ValueError, match=f"router loads are wrong: .*{message}"):
        ca.read_router_loads(write(tmp_path, record))


def test_moe_cli_prints_the_factor_and_the_report(tmp_path, capsys):
    path = write(tmp_path, SHAPE | {"micro_batches_per_iteration": 4, "peak_loads": PEAKS})
    assert main(["--moe-router-loads", path, "--print-capacity"]) == 0
    assert capsys.readouterr().out == "1.17\n"
    assert main(["--moe-router-loads", path, "--target-overflow-rate", "0"]) == 0
    report = capsys.readouterr().out
    assert ("recommended: --moe-expert-capacity-factor 1.56 --moe-pad-expert-input-to-capacity "
            "--moe-capacity-overflow rerun") in report
    # Overflow at factor 1.25 (capacity 320): 1% of micro-batches, 1 - 0.99^4 of iterations.
    assert re.search(r"1\.25\s+320\s+1\.00%\s+3\.94%", report)
    assert "an even share is 256 per expert" in report


def test_data_modes_still_need_the_row_shape():
    with pytest.raises(SystemExit) as done:
        ca.parse_args(["--mock-data", "--vocab-size", "100"])
    assert done.value.code == 2


def _long_jsonl(tmp_path):
    """One 20-token document (longer than an 8-position row) and two short ones."""
    path = tmp_path / "long.jsonl"
    records = [{"input_ids": list(range(1, 21))}, {"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_long_documents_follow_trainings_long_document_policy(tmp_path, capsys):
    """--long-document-policy as training's: split (the default) cuts the long document into
    row-sized pieces, truncate cuts it to one row, reject (or the older
    --reject-long-documents) refuses it."""
    path = _long_jsonl(tmp_path)
    common = ["--data-path", path, "--seq-length", "8", "--vocab-size", "32"]
    assert main(common) == 0
    assert "0 truncated, 1 split into 3 pieces" in capsys.readouterr().out
    assert main(common + ["--long-document-policy", "truncate"]) == 0
    assert "1 truncated, 0 split into 0 pieces" in capsys.readouterr().out
    for refuse in (["--long-document-policy", "reject"], ["--reject-long-documents"]):
        with pytest.raises(ValueError, match="--long-document-policy split"):
            main(common + refuse)


def test_the_two_spellings_of_reject_cannot_disagree(capsys):
    with pytest.raises(SystemExit) as done:
        ca.parse_args(["--mock-data", "--seq-length", "8", "--vocab-size", "32",
                       "--long-document-policy", "split", "--reject-long-documents"])
    assert done.value.code == 2
    assert "long-document policy is wrong: 'split' together with reject_long_documents" in \
        capsys.readouterr().err


# ------------------------------------------------------------ against dropless MoE graphs

def test_dropless_graph_rows_are_the_layers_static_buffer():
    from megatron.packed_model.grouped_gemm import group_alignment
    from megatron.packed_model.moe_dropless import static_rows

    import torch

    loads = router_loads(PEAKS)  # 1024 tokens, top-2, 8 experts
    assert ca.DROPLESS_ALIGNMENT == group_alignment(torch.bfloat16)
    allocated, computed = ca.dropless_graph_rows(loads)
    assert allocated == static_rows(1024, 2, 8, 8) == 2048 + 64 + 8
    assert computed == 2048 + 64


def test_the_report_sets_the_factor_against_dropless_graphs():
    loads = router_loads(PEAKS)
    report = ca.format_dropless_comparison(loads, 1.17, hidden_size=1024)
    # drop-and-pad at 1.17: 8 experts x 300 rows; dropless graphs: 2120 allocated.
    assert re.search(r"dropless graphs\s+2120\s+2112\s+4\.1", report)
    assert re.search(r"drop-and-pad at 1\.17\s+2400\s+2400\s+4\.7", report)
    assert "dropless graphs hold fewer rows" in report
    assert "with FP8/FP4 experts (dropless graphs run bf16)" in report
    tight = ca.format_dropless_comparison(loads, 1.0)
    assert "dropless graphs hold more rows" in tight  # 2120 > 8 x 256
    ep = ca.format_dropless_comparison(loads, 1.17, expert_parallel=2)
    # 4 local experts: blocks of 1024 x min(2, 4) rows from each of the 2 ranks.
    assert ca.dropless_graph_rows(loads, 2) == (4096 + 32 + 8, 4096 + 32)
    assert "each rank sends and receives 4096 rows each way (drop-and-pad: 2400)" in ep
    assert "dropless graphs hold more rows" in ep


def test_moe_cli_compares_with_dropless_graphs(tmp_path, capsys):
    path = write(tmp_path, SHAPE | {"peak_loads": PEAKS})
    assert main(["--moe-router-loads", path, "--hidden-size", "1024"]) == 0
    report = capsys.readouterr().out
    assert "dropless MoE graphs (--moe-dropless-graphs) instead" in report
    assert re.search(r"drop-and-pad at 1\.17\s+2400", report)  # the recommended factor


@pytest.mark.slow  # a process each
@pytest.mark.parametrize("kind", ["sharegpt", "chat"])
def test_conversations_are_refused_in_one_line_naming_the_fix(tmp_path, kind):
    """The tool as a user runs it: ShareGPT data names the rewrite into messages, chat data
    (messages) names tools/preprocess_sft.py; exit status 2, one line, no traceback."""
    import os
    import subprocess
    import sys

    from tests.unit.test_chat_data import CONVERSATION, SHAREGPT, SHAREGPT_MESSAGE

    path = tmp_path / "data.jsonl"
    record = SHAREGPT if kind == "sharegpt" else {"messages": CONVERSATION}
    path.write_text(json.dumps(record) + "\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, os.path.join(repo, "tools", "capacity_advisor.py"),
                          "--data-path", str(path), "--seq-length", "64", "--vocab-size", "500"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == ""
    (line,) = run.stderr.splitlines()
    if kind == "sharegpt":
        assert re.match(rf"capacity_advisor: error: {path}:1: {SHAREGPT_MESSAGE}", line), line
    else:
        assert line == (
            f'capacity_advisor: error: {path}:1: data is wrong: a chat conversation ("messages"), '
            f"and the advisor reads pre-tokenized JSONL. Pre-tokenize it first: python "
            f"tools/preprocess_sft.py --input {path} --output train.jsonl --tokenizer-model "
            f"<tokenizer folder>, then pass --data-path train.jsonl.")
