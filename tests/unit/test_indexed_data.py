"""Megatron-LM's indexed datasets, blends and splits, the token cache, the packer's algorithms
and data-parallel balance: real files written through megatron-core's IndexedDatasetBuilder,
read by the training data path."""

import argparse
import json
import os
import re

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron.packed_training.datasets.balance import (
    DataParallelBalanced,
    balance_report,
    balanced_order,
    rank_tokens,
)
from megatron.packed_training.datasets.builder import build_datasets, build_test_dataset
from megatron.packed_training.datasets.packing import PackingStats
from megatron.packed_training.datasets.preflight import check_data
from megatron.packed_training.datasets.row_plan import (
    DocumentList,
    PlannedRows,
    pack_documents,
    plan_rows,
)
from megatron.packed_training.datasets.sources import pack_data
from megatron.packed_training.datasets.token_cache import open_cached_source, tokenizer_fingerprint

VOCAB = 1000


def args_for(**values) -> argparse.Namespace:
    defaults = dict(mock_data=False, data_path=None, valid_data_path=None, train_data_path=None,
                    test_data_path=None, data_args_path=None, per_split_data_args_path=None,
                    data_cache_path=None, split=None, vocab_size=VOCAB, tokenizer_type=None,
                    tokenizer_model=None, sft=False, seq_length=32, long_document_policy="split",
                    max_truncated_token_fraction=None, dynamic_cp_sizes=None,
                    context_parallel_size=1, train_iters=4, global_batch_size=4,
                    eval_interval=1000, eval_iters=0, seed=1234,
                    packing_algorithm="in-order", packing_window=20000)
    return argparse.Namespace(**(defaults | values))


def documents(count: int, seed: int = 0, low: int = 2, high: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(n)) for n in rng.integers(low, high, size=count)]


def write_indexed(prefix, docs, dtype=np.uint16, sentences: bool = False) -> str:
    """``docs`` as Megatron-LM writes them (preprocess_data.py: one document per line; with
    ``sentences`` each document is two sequences, as --split-sentences gives)."""
    prefix = str(prefix)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        lengths = [len(doc) // 2, len(doc) - len(doc) // 2] if sentences else [len(doc)]
        builder.add_document(torch.from_numpy(np.asarray(doc)), lengths)
    builder.finalize(prefix + ".idx")
    return prefix


def write_jsonl(path, docs, masks=None) -> str:
    with open(path, "w") as stream:
        for k, doc in enumerate(docs):
            record = {"input_ids": [int(t) for t in doc]}
            if masks is not None:
                record["loss_mask"] = [int(m) for m in masks[k]]
            stream.write(json.dumps(record) + "\n")
    return str(path)


def rows_of(packed, split="train"):
    return [row.tokens.tolist() for row in packed[split].rows]


# ------------------------------------------------------------------ indexed data


@pytest.mark.parametrize("sentences", [False, True])
def test_indexed_rows_equal_the_same_documents_from_jsonl(tmp_path, sentences):
    docs = documents(30)
    prefix = write_indexed(tmp_path / "text_document", docs, sentences=sentences)
    jsonl = write_jsonl(tmp_path / "text.jsonl", docs)
    indexed = pack_data(args_for(data_path=[prefix]))
    from_jsonl = pack_data(args_for(data_path=[jsonl]))
    assert rows_of(indexed) == rows_of(from_jsonl)
    for a, b in zip(indexed["train"].rows, from_jsonl["train"].rows):
        assert np.array_equal(a.loss_mask, b.loss_mask) and np.array_equal(a.cu_seqlens, b.cu_seqlens)
    # And the rows are exactly what the in-memory packer makes of the documents.
    from megatron.packed_training.datasets.packing import Document
    expected = list(pack_documents([Document(d, None, str(k)) for k, d in enumerate(docs)], 32))
    assert rows_of(indexed) == [row.tokens.tolist() for row in expected]


def test_sft_treats_each_indexed_document_as_one_sample_with_every_token_a_target(tmp_path):
    prefix = write_indexed(tmp_path / "d", documents(10))
    row = pack_data(args_for(data_path=[prefix], sft=True))["train"].rows[0]
    real = row.cu_seqlens[row.num_documents]
    assert row.loss_mask[:real].all() and not row.loss_mask[real:].any()


def test_an_indexed_prefix_with_only_one_half_is_refused(tmp_path):
    prefix = write_indexed(tmp_path / "d", documents(3))
    os.remove(prefix + ".idx")
    with pytest.raises(ValueError, match=r"--data-path is wrong: .*d' has d.bin but no d.idx\. "
                                         r"An indexed dataset is the pair"):
        check_data(args_for(data_path=[prefix]))
    prefix = write_indexed(tmp_path / "e", documents(3))
    os.remove(prefix + ".bin")
    with pytest.raises(ValueError, match=r"has e.idx but no e.bin"):
        check_data(args_for(data_path=[prefix]))


def test_a_truncated_or_corrupt_index_is_refused_naming_the_file(tmp_path):
    prefix = write_indexed(tmp_path / "d", documents(5))
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(data[:-5])
    with pytest.raises(ValueError, match=re.escape(prefix + ".idx") + r" is \d+ bytes, but its "
                       r"header .* the file is truncated or corrupt\. Rebuild it"):
        check_data(args_for(data_path=[prefix]))
    open(prefix + ".idx", "wb").write(b"NOTANIDX" + data[8:])
    with pytest.raises(ValueError, match=r"is not a Megatron-LM index"):
        check_data(args_for(data_path=[prefix]))
    open(prefix + ".idx", "wb").write(data[:20])
    with pytest.raises(ValueError, match=r"header is cut short"):
        check_data(args_for(data_path=[prefix]))


def test_a_truncated_bin_is_refused(tmp_path):
    prefix = write_indexed(tmp_path / "d", documents(5))
    data = open(prefix + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(data[:-4])
    with pytest.raises(ValueError, match=r"d.bin is \d+ bytes, but its index points to \d+"):
        check_data(args_for(data_path=[prefix]))


def test_token_ids_outside_the_vocabulary_name_the_document(tmp_path):
    docs = documents(6)
    docs[4] = np.array([5, 6, VOCAB + 7, 8])
    prefix = write_indexed(tmp_path / "d", docs)
    with pytest.raises(ValueError, match=re.escape(f"{prefix} document 4 holds token id "
                                                   f"{VOCAB + 7}, not below the vocabulary size")):
        check_data(args_for(data_path=[prefix]))


# ------------------------------------------------------------------ blends and splits


def test_a_blend_draws_samples_by_weight_and_the_same_on_every_call(tmp_path):
    a = write_indexed(tmp_path / "a", documents(40, seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", documents(40, seed=2))
    args = args_for(data_path=["0.25", a, "0.75", b], train_iters=100)
    train, _, _ = build_datasets(args)
    assert len(train) == 400
    shares = np.bincount(train.dataset_index, minlength=2) / len(train)
    assert shares == pytest.approx([0.25, 0.75], abs=0.01)
    again, _, _ = build_datasets(args)
    assert all(np.array_equal(train[i].tokens, again[i].tokens) for i in range(0, 400, 37))
    # Each source cycles its own rows epoch after epoch (Megatron-LM's blend of datasets).
    assert train.datasets[0].num_samples >= 100 and train.datasets[1].num_samples >= 300


def test_a_blend_without_weights_weighs_sources_by_rows(tmp_path):
    a = write_indexed(tmp_path / "a", documents(10, seed=1))
    b = write_indexed(tmp_path / "b", documents(30, seed=2))
    train, _, _ = build_datasets(args_for(data_path=[a, b], train_iters=50))
    rows = [len(d.rows) for d in train.datasets]
    shares = np.bincount(train.dataset_index, minlength=2) / len(train)
    assert shares == pytest.approx(np.array(rows) / sum(rows), abs=0.02)


@pytest.mark.parametrize("blend, message", [
    (["0.3", "A", "x", "B"], "mixes weights and paths"),
    (["0.3", "A", "0.7"], "mixes weights and paths"),
    (["-1", "A", "2", "B"], "must be finite, >= 0 and not all 0"),
    (["0", "A", "0", "B"], "must be finite, >= 0 and not all 0"),
])
def test_a_blend_whose_weights_do_not_parse_is_refused(blend, message):
    from megatron.packed_training.data_paths import parse_blend

    with pytest.raises(ValueError, match=r"--data-path is wrong: .*" + re.escape(message)):
        parse_blend(blend, "--data-path")


def test_split_divides_each_source_and_test_data_is_built(tmp_path):
    a = write_indexed(tmp_path / "a", documents(100, seed=1, high=30))
    b = write_indexed(tmp_path / "b", documents(50, seed=2, high=30))
    args = args_for(data_path=["1", a, "1", b], split="80,10,10", eval_iters=2, eval_interval=2)
    packed = pack_data(args, with_test=True)
    assert set(packed) == {"train", "valid", "test"}
    documents_in = {split: packed[split].stats.documents for split in packed}
    assert documents_in == {"train": 120, "valid": 15, "test": 15}
    test = build_test_dataset(args, packed)
    assert len(test) == 2 * 4
    line = check_data(args).line
    assert f"--data-path 1 {a} 1 {b} (--split 80,10,10, valid): 15 documents" in line
    assert "(--split 80,10,10, test)" in line


def test_per_split_paths_and_their_json_file(tmp_path):
    a = write_indexed(tmp_path / "a", documents(20, seed=1))
    v = write_jsonl(tmp_path / "v.jsonl", documents(8, seed=2))
    by_flags = pack_data(args_for(train_data_path=[a], valid_data_path=[v]))
    listing = tmp_path / "splits.json"
    listing.write_text(json.dumps({"train": [a], "valid": v, "test": []}))
    by_file = pack_data(args_for(per_split_data_args_path=str(listing)))
    assert set(by_flags) == set(by_file) == {"train", "valid"}
    assert rows_of(by_flags, "valid") == rows_of(by_file, "valid")
    listing.write_text("{not json")
    with pytest.raises(ValueError, match=r"--per-split-data-args-path is wrong: .*splits.json"):
        pack_data(args_for(per_split_data_args_path=str(listing)))


def test_a_folder_of_jsonl_files_is_one_source_in_name_order(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    docs = documents(12)
    write_jsonl(folder / "01.jsonl", docs[:5])
    write_jsonl(folder / "02.jsonl", docs[5:])
    whole = write_jsonl(tmp_path / "all.jsonl", docs)
    assert rows_of(pack_data(args_for(data_path=[str(folder)]))) == rows_of(
        pack_data(args_for(data_path=[whole])))
    with open(folder / "02.jsonl", "a") as stream:
        stream.write('{"input_ids": [1, 2000]}\n')
    with pytest.raises(ValueError, match=re.escape(f"{folder / '02.jsonl'}:8: input_ids is "
                                                   f"wrong")):
        pack_data(args_for(data_path=[str(folder)]))


# ------------------------------------------------------------------ the token cache


def open_cache(path, tmp_path, build=True, vocab=VOCAB, tokenizer=None, **kw):
    return open_cached_source(str(path), vocab_size=vocab, load_tokenizer=lambda: None,
                              tokenizer_key=tokenizer,
                              cache_root=str(tmp_path / "cache"), build=build, **kw)


def test_the_cache_is_reused_and_rebuilt_when_stale_never_silently_reused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", documents(5), masks=None)
    _, first = open_cache(path, tmp_path)
    _, second = open_cache(path, tmp_path)
    assert (first.built, second.built) == ("built", "reused")
    _, other = open_cache(path, tmp_path, tokenizer={"type": "HuggingFaceTokenizer",
                                                     "sha256": "another"})
    assert other.built == "rebuilt (another tokenizer)"
    _, vocab = open_cache(path, tmp_path, vocab=VOCAB + 1,
                          tokenizer={"type": "HuggingFaceTokenizer", "sha256": "another"})
    assert vocab.built == "rebuilt (another vocabulary size)"
    write_jsonl(path, documents(6, seed=9))
    source, changed = open_cache(path, tmp_path, vocab=VOCAB + 1,
                                 tokenizer={"type": "HuggingFaceTokenizer", "sha256": "another"})
    assert changed.built == "rebuilt (the data files changed)" and len(source.lengths) == 6


def test_the_tokenizer_fingerprint_follows_the_tokenizer_files(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    before = tokenizer_fingerprint("HuggingFaceTokenizer", str(folder))
    (folder / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    assert tokenizer_fingerprint("HuggingFaceTokenizer", str(folder)) != before


def test_a_bad_line_leaves_no_cache_and_other_ranks_wait_then_name_the_folder(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2,]}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2:\d+: JSON is wrong"):
        open_cache(path, tmp_path)
    leftovers = list((tmp_path / "cache").rglob("*"))
    assert not [p for p in leftovers if p.is_file()]
    with pytest.raises(ValueError, match=r"no token cache of .*t.jsonl appeared at .* within 0 s; "
                                         r"rank 0 builds it"):
        open_cache(path, tmp_path, build=False, wait_seconds=0.2)


def test_the_cache_keeps_loss_masks_and_line_numbers(tmp_path):
    docs = documents(4, low=50, high=60)
    masks = [np.r_[np.zeros(10), np.ones(len(d) - 10)] for d in docs]
    path = write_jsonl(tmp_path / "t.jsonl", docs, masks)
    source, _ = open_cache(path, tmp_path)
    ids, mask = source.read(2, 0, int(source.lengths[2]))
    assert np.array_equal(ids, docs[2]) and np.array_equal(mask, masks[2])
    assert source.origin(3) == f"{path}:4"
    with pytest.raises(ValueError, match=re.escape(f"{path}:1 has")):
        pack_data(args_for(data_path=[path], long_document_policy="reject"))


# ------------------------------------------------------------------ the packer


class Lengths:
    """A document source of lengths only (the packer reads nothing else)."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def origin(self, document):
        return f"doc {document}"


def lognormal_lengths(count, seed=0, median=512, sigma=1.0):
    rng = np.random.default_rng(seed)
    return np.maximum(2, np.round(np.exp(np.log(median) + sigma * rng.standard_normal(count))))


def test_best_fit_decreasing_fills_at_least_97_percent_at_seq_4096():
    source = Lengths(lognormal_lengths(20000))
    stats = {}
    for algorithm in ("in-order", "best-fit-decreasing"):
        stats[algorithm] = PackingStats()
        plan_rows(source, 4096, stats=stats[algorithm], algorithm=algorithm, seed=1)
    real = {a: s.tokens / (s.tokens + s.padding_tokens) for a, s in stats.items()}
    assert real["best-fit-decreasing"] >= 0.97 > real["in-order"]
    assert stats["in-order"].documents == stats["best-fit-decreasing"].documents


def test_best_fit_decreasing_is_deterministic_in_the_seed_and_packs_every_piece_once():
    source = Lengths(lognormal_lengths(3000, seed=3, median=300))
    one = plan_rows(source, 1024, algorithm="best-fit-decreasing", seed=5, window=500)
    again = plan_rows(source, 1024, algorithm="best-fit-decreasing", seed=5, window=500)
    other = plan_rows(source, 1024, algorithm="best-fit-decreasing", seed=6, window=500)
    assert np.array_equal(one.documents, again.documents)
    assert not np.array_equal(one.documents, other.documents)
    assert one.real_positions().max() <= 1024
    pieces = sorted(zip(one.documents.tolist(), one.starts.tolist()))
    assert len(pieces) == len(set(pieces))


def test_planned_rows_of_in_memory_documents_keep_the_cp_layout():
    from megatron.packed_training.datasets.packing import Document

    docs = [Document(d, None, str(k)) for k, d in enumerate(documents(10, low=3, high=9))]
    rows = PlannedRows(DocumentList(docs), plan_rows(DocumentList(docs), 16, segment_multiple=4,
                                                     algorithm="best-fit-decreasing"))
    for row in rows:
        assert np.all(np.diff(row.cu_seqlens)[:row.num_documents] % 4 == 0)
        assert row.cu_seqlens_actual is not None


# ------------------------------------------------------------------ data-parallel balance


def test_balanced_order_deals_rows_evenly_and_reads_every_row_once():
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 4096, size=64)
    order = balanced_order(tokens, data_parallel_size=4, micro_batch_size=2)
    assert sorted(order.tolist()) == list(range(64))
    plain = rank_tokens(tokens, 4, 2)
    balanced = rank_tokens(tokens[order], 4, 2)
    assert balanced.max() / balanced.mean() < 1.01 < plain.max() / plain.mean()


def test_the_balanced_dataset_keeps_steps_whole(tmp_path):
    docs = documents(300, low=2, high=60)
    path = write_jsonl(tmp_path / "t.jsonl", docs)
    args = args_for(data_path=[path], global_batch_size=8, train_iters=6)
    train, _, _ = build_datasets(args)
    balanced = DataParallelBalanced(train, 8, data_parallel_size=4, micro_batch_size=1)
    for step in range(6):
        window = range(step * 8, step * 8 + 8)
        assert sorted(balanced.real_positions(i) for i in window) == sorted(
            train.real_positions(i) for i in window)
    plain, even = balance_report(train, 8, 4, 1), balance_report(balanced, 8, 4, 1)
    assert even[0] <= plain[0] and even[1] <= plain[1]
    row = balanced[0]
    assert row.tokens.shape == (32,)


# ------------------------------------------------------------------ the launch line

LINE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 "
        "--train-iters 10 --lr 1e-3 --vocab-size 1000 --attention-backend local").split()


def parse(argv, capsys):
    from megatron.packed_training.arguments import parse_args_or_exit

    try:
        return parse_args_or_exit("gpt", "pretrain_gpt.py", LINE + argv), ""
    except SystemExit as exit_:
        assert exit_.code == 2
        return None, capsys.readouterr().err


def test_megatron_data_flags_parse_as_megatron_lm_writes_them(tmp_path, capsys):
    a = write_indexed(tmp_path / "a_text_document", documents(100))
    b = write_jsonl(tmp_path / "b.jsonl", documents(100))
    args, _ = parse(["--data-path", "0.3", a, "0.7", b, "--split", "98,2,0",
                     "--data-cache-path", str(tmp_path / "c")], capsys)
    assert args.data_path == ["0.3", a, "0.7", b]
    assert args.packing_algorithm == "best-fit-decreasing"
    assert args.sequence_packing_scheduler == "default"
    packed = pack_data(args)
    assert set(packed) == {"train", "valid"} and len(packed["train"].parts) == 2
    assert (tmp_path / "c" / "packed_token_cache").is_dir()


@pytest.mark.parametrize("argv, message", [
    (["--data-path", "0.3", "{a}", "heavy", "{a}"], "--data-path is wrong: .* mixes weights"),
    (["--data-path", "{missing}"], "--data-path is wrong: .*missing' does not exist"),
    (["--mock-data", "--packing-window", "0"], "--packing-window is wrong: 0"),
    (["--mock-data", "--sequence-packing-scheduler", "dp_balanced", "--rampup-batch-size", "2",
      "2", "8"], "--sequence-packing-scheduler is wrong: dp_balanced.*--rampup-batch-size"),
    (["--mock-data", "--packing-algorithm", "first-fit"], "invalid choice: 'first-fit'"),
    (["--data-path", "{a}.bin"], "is one file of an indexed dataset. Give its prefix"),
    (["--mock-data", "--packing-max-documents", "-1"], "--packing-max-documents is wrong: -1"),
    (["--data-path", "{a}", "--train-data-path", "{a}"],  # Megatron-LM's own check
     "A single data source must be provided"),
    (["--data-path", "{a}", "--valid-data-path", "{a}", "--split", "90,10,0"],
     "--valid-data-path is wrong: .*--split 90,10,0 already holds validation documents"),
    (["--per-split-data-args-path", "{listing}", "--valid-data-path", "{a}"],
     "--per-split-data-args-path is wrong: .*keep one of the two"),
])
def test_bad_data_flags_stop_at_parse_time_naming_value_and_fix(tmp_path, capsys, argv, message):
    a = write_indexed(tmp_path / "a", documents(50))
    listing = tmp_path / "splits.json"
    listing.write_text(json.dumps({"train": [a], "valid": [a], "test": []}))
    argv = [v.format(a=a, missing=tmp_path / "missing", listing=listing) for v in argv]
    args, err = parse(argv, capsys)
    assert args is None and re.search(message, err), err


def test_a_token_cache_given_as_indexed_data_with_another_tokenizer_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", documents(20))
    source, cache = open_cache(path, tmp_path)
    prefix = os.path.join(cache.folder, "tokens")
    assert rows_of(pack_data(args_for(data_path=[prefix]))) == rows_of(
        pack_data(args_for(data_path=[path], data_cache_path=str(tmp_path / "cache"))))
    with pytest.raises(ValueError, match=re.escape(f"--data-path is wrong: {prefix} is a token "
                                                   f"cache built with tokenizer")):
        check_data(args_for(data_path=[prefix], vocab_size=VOCAB + 8))


def test_best_fit_rows_stay_within_the_graph_capacity():
    source = Lengths(lognormal_lengths(20000))
    free, capped = PackingStats(), PackingStats()
    plan = plan_rows(source, 4096, stats=free, algorithm="best-fit-decreasing")
    assert np.diff(plan.row_starts).max() > 32  # best fit alone tucks in dozens
    plan = plan_rows(source, 4096, stats=capped, algorithm="best-fit-decreasing",
                     max_documents=15)
    assert np.diff(plan.row_starts).max() <= 15
    assert capped.tokens / (capped.tokens + capped.padding_tokens) >= 0.97

    # The run's rows do not depend on the graph flags: eager and graphs pack alike.
    eager = args_for(data_path=None, packing_algorithm="best-fit-decreasing", seq_length=4096)
    graphs = argparse.Namespace(**vars(eager), cuda_graph_max_packed_seqs=16)
    from megatron.packed_training.datasets.sources import pack_source
    assert np.array_equal(pack_source(source, eager, PackingStats()).plan.documents,
                          pack_source(source, graphs, PackingStats()).plan.documents)


def test_token_ids_without_a_known_vocabulary_ask_for_vocab_size(tmp_path):
    prefix = write_indexed(tmp_path / "d", documents(5))
    with pytest.raises(ValueError, match=r"the vocabulary size is not known yet for "
                                         r"--tokenizer-type GPT2BPETokenizer\. Add --vocab-size"):
        pack_data(args_for(data_path=[prefix], vocab_size=None, tokenizer_type="GPT2BPETokenizer"))


def test_mock_rows_report_their_real_positions_for_balance():
    from megatron.packed_training.datasets.mock import MockPackedDataset
    from megatron.packed_training.datasets.packing import row_padding_mask

    rows = MockPackedDataset(16, 256, VOCAB, 3)
    balanced = DataParallelBalanced(rows, 8, data_parallel_size=2, micro_batch_size=2)
    assert balanced.real_positions(0) == int((~row_padding_mask(balanced[0])).sum())


def test_a_graph_capacity_below_the_rows_document_limit_is_noted_with_the_fix(tmp_path, capsys):
    data = write_indexed(tmp_path / "a", documents(50))
    graphs = ["--data-path", data, "--split", "100,0,0", "--cuda-graph-impl", "local",
              "--cuda-graph-max-packed-seqs", "16"]
    args, _ = parse(graphs, capsys)
    (note,) = [n for n in args.packed_notes if "--packing-max-documents" in n]
    assert note.startswith("rows may hold 63 documents, so a micro-batch of 1 row(s) can "
                           "outgrow --cuda-graph-max-packed-seqs 16 and run eager; "
                           "--packing-max-documents 15 keeps")
    args, _ = parse(graphs + ["--packing-max-documents", "15"], capsys)
    assert not [n for n in args.packed_notes if "--packing-max-documents" in n]
