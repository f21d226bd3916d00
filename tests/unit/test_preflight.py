"""The data check before training (datasets/preflight.py): paths, file:line errors, the one
summary line, the truncation limit, the long-document policies, rank 0 only, and its place in
run_pretraining (before any GPU work).

The check is host logic over a few fields of the run's args: most tests hand it a plain
Namespace of those (`args_for`); the run_pretraining tests parse a whole launch line."""

import argparse
import json
import re

import pytest

from megatron.packed_training import extra_args, initialize, pretrain
from megatron.packed_training.datasets.preflight import check_data, is_first_rank, run_data_check

# A Megatron-LM launch line of the run `args_for` describes.
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--train-iters", "2", "--lr", "1e-3", "--vocab-size", "100", "--attention-backend",
        "local", "--eval-iters", "0"]


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)


def write_jsonl(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def doc(n, start=1):
    return {"input_ids": list(range(start, start + n))}


def args_for(**values) -> argparse.Namespace:
    """What the check reads of the args: BASE's run (pre-tokenized data, no tokenizer), with
    ``values`` set. ``split`` None is the builder's one-file-per-split path (the parser gives
    Megatron-LM's default split whenever --data-path is set)."""
    defaults = dict(mock_data=False, data_path=None, valid_data_path=None, split=None,
                    vocab_size=100, tokenizer_type=None, tokenizer_model=None, sft=False,
                    seq_length=16, long_document_policy="split",
                    max_truncated_token_fraction=None, dynamic_cp_sizes=None,
                    context_parallel_size=1, train_iters=2, global_batch_size=1,
                    eval_interval=1000, eval_iters=0, seed=1234, mock_doc_length_median=512,
                    mock_doc_length_sigma=1.0)
    paths = {name: str(value) for name, value in values.items() if name.endswith("path")}
    return argparse.Namespace(**(defaults | values | paths))


def test_missing_data_path_names_the_flag_and_path(tmp_path):
    missing = tmp_path / "train.jsonl"
    with pytest.raises(ValueError, match=re.escape(f"--data-path is wrong: '{missing}' does not "
                                                   "exist. Pass a .jsonl file, a folder of .jsonl "
                                                   "files, or a Megatron-LM indexed-dataset")):
        check_data(args_for(data_path=missing))


def test_missing_valid_path_fails_before_the_training_file_is_read(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", doc(5), "{not json")
    missing = tmp_path / "valid.jsonl"
    with pytest.raises(ValueError, match=re.escape(f"--valid-data-path is wrong: '{missing}' "
                                                   "does not exist")):
        check_data(args_for(data_path=train, valid_data_path=missing))


def test_a_folder_without_jsonl_files_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--data-path is wrong: the folder .* holds no .jsonl"):
        check_data(args_for(data_path=tmp_path))


def test_bad_json_names_file_line_and_the_faults_column(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", doc(5), "", '{"input_ids": [1, 2,]}')
    with pytest.raises(ValueError) as error:
        check_data(args_for(data_path=path))
    first, excerpt, caret = str(error.value).split("\n")
    assert first == (f"{path}:3:20: JSON is wrong: a comma before ']'. Remove the trailing "
                     "comma.")
    assert excerpt[caret.index("^")] == ","


def test_bad_record_names_file_line_and_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", doc(5), {"input_ids": [1, 200]})
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: input_ids is wrong: element 1 is "
                                                   "200, not below the vocab size 100. Set "
                                                   "--vocab-size")):
        check_data(args_for(data_path=path))


def test_summary_line_counts_documents_rows_empty_split_and_truncation(tmp_path):
    # Rows of 16 positions: documents of 10 and 5 positions, one of 1 token (skipped), one of
    # 40 tokens (39 positions): split into 16 + 16 + 7.
    path = write_jsonl(tmp_path / "t.jsonl", doc(11), doc(6), doc(1), doc(40))
    result = check_data(args_for(data_path=path))
    stats = result.train
    assert (stats.documents, stats.rows, stats.skipped_empty) == (5, 4, 1)
    assert (stats.split, stats.pieces, stats.truncated, stats.truncated_tokens) == (1, 3, 0, 0)
    assert result.valid is None
    assert result.line == (
        f"data check: --data-path {path}: 5 documents into 4 rows (1.2 per row), skipped 1 "
        f"empty, split 1 into 3 pieces, truncated 0 (0 tokens lost, 0.00%), padding 15.6% of "
        f"64 positions")


def test_truncation_within_the_limit_is_reported_as_count_and_percent(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", *[doc(17)] * 19, doc(18))
    result = check_data(args_for(data_path=path, long_document_policy="truncate"))
    # 20 documents, 16 + 17 positions in the last: 1 token of 321 dropped.
    assert (result.train.truncated, result.train.truncated_tokens) == (1, 1)
    assert "truncated 1 (1 tokens lost, 0.31%)" in result.line


def test_truncation_over_the_limit_stops_naming_both_fixes(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", doc(5), doc(40))
    args = args_for(data_path=path, long_document_policy="truncate")
    with pytest.raises(ValueError, match=re.escape(
            f"truncation is wrong: --data-path {path}: cutting 1 long documents to a row drops 23 of 43 "
            f"tokens (53.49%), more than --max-truncated-token-fraction 0.05. Raise "
            f"--seq-length (the longest document has 40 tokens) or use --long-document-policy "
            f"split")):
        check_data(args)
    args = args_for(data_path=path, long_document_policy="truncate",
                    max_truncated_token_fraction=0.6)
    assert "truncated 1 (23 tokens lost, 53.49%)" in check_data(args).line


def test_reject_policy_names_the_first_too_long_document(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", doc(5), doc(30), doc(40))
    with pytest.raises(ValueError, match=re.escape(
            f"document length is wrong: {path}:2 has 30 tokens (29 training positions), more "
            f"than --seq-length 16. Use --long-document-policy split")):
        check_data(args_for(data_path=path, long_document_policy="reject"))


def test_valid_file_is_checked_and_summarised_on_the_same_line(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", doc(5))
    valid = write_jsonl(tmp_path / "v.jsonl", doc(6), doc(7))
    result = check_data(args_for(data_path=train, valid_data_path=valid))
    assert result.valid.documents == 2
    assert f"; --valid-data-path {valid}: 2 documents into 1 rows" in result.line
    assert result.line.count("\n") == 0
    bad = write_jsonl(tmp_path / "bad.jsonl", doc(5), "[1, 2]")
    with pytest.raises(ValueError, match=re.escape(f"{bad}:2: record is wrong")):
        check_data(args_for(data_path=train, valid_data_path=bad))


def test_a_file_without_trainable_documents_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", doc(1), doc(0))
    with pytest.raises(ValueError, match="holds no document with at least 2 tokens"):
        check_data(args_for(data_path=path))


def test_mock_data_skips_files_and_summarises_its_rows():
    result = check_data(args_for(mock_data=True, mock_doc_length_median=6))
    assert result.train.rows == 2  # train_iters x global batch size
    assert result.line.startswith("data check: --mock-data (2 rows): ")
    assert f"{result.train.documents} documents into 2 rows" in result.line


def test_mock_data_summary_is_capped(monkeypatch):
    from megatron.packed_training.datasets import preflight

    monkeypatch.setattr(preflight, "MOCK_ROWS_CHECKED", 3)
    result = check_data(args_for(mock_data=True, train_iters=10))
    assert result.train.rows == 3 and "(first 3 of 10 rows)" in result.line


def test_mock_data_follows_the_reject_policy():
    with pytest.raises(ValueError, match=r"mock row 0 drew a document of \d+ tokens"):
        check_data(args_for(mock_data=True, mock_doc_length_median=400,
                            long_document_policy="reject"))


@pytest.mark.parametrize("rank, runs", [(None, True), ("", True), ("0", True), ("1", False),
                                        ("7", False)])
def test_only_the_first_rank_checks(tmp_path, rank, runs):
    environ = {} if rank is None else {"RANK": rank}
    assert is_first_rank(environ) is runs
    lines = []
    result = run_data_check(args_for(data_path=tmp_path / "missing.jsonl"), lines.append,
                            environ) if not runs else None
    if runs:
        path = write_jsonl(tmp_path / "t.jsonl", doc(5))
        result = run_data_check(args_for(data_path=path), lines.append, environ)
        assert lines == result.caches + [result.line]
        assert lines[0].startswith("token cache built: ")
    else:  # another rank does not even look at the (missing) file
        assert result is None and lines == []


class GPUTouched(Exception):
    pass


def _no_gpu(script):
    raise GPUTouched(script)


def test_run_pretraining_checks_the_data_before_any_gpu_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(initialize, "require_cuda", _no_gpu)
    split = ["--split", "100,0,0"]
    path = write_jsonl(tmp_path / "t.jsonl", doc(5), '{"input_ids": [1, 2')
    with pytest.raises(SystemExit) as exit_info:
        pretrain.run_pretraining("gpt", None, "pretrain_gpt.py",
                                 BASE + split + ["--data-path", path])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.startswith(
        f"pretrain_gpt.py: error: {path}:2:20: JSON is wrong: Expecting ',' delimiter")
    # Good data: one summary line, then the CUDA check (where training would start).
    good = write_jsonl(tmp_path / "good.jsonl", doc(5), doc(40))
    with pytest.raises(GPUTouched):
        pretrain.run_pretraining("gpt", None, "pretrain_gpt.py",
                                 BASE + split + ["--data-path", good])
    out = [line for line in capsys.readouterr().out.splitlines() if "data check" in line]
    assert out == [f"data check: --data-path {good} (--split 100,0,0, train): 4 documents into "
                   f"3 rows (1.3 per row), skipped 0 empty, split 1 into 3 pieces, truncated 0 "
                   f"(0 tokens lost, 0.00%), padding 10.4% of 48 positions"]


def test_a_bad_chat_role_stops_the_run_before_megatrons_argument_dump(tmp_path, monkeypatch,
                                                                     capsys):
    """The data check runs before Megatron-LM's ~840-line argument dump is printed: a bad
    data file's message is the only output."""
    from tests.unit.test_chat_data import make_tokenizer

    monkeypatch.setattr(initialize, "require_cuda", _no_gpu)
    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    chat = write_jsonl(tmp_path / "chat.jsonl", {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "Assistant", "content": "Hello"}]})
    argv = BASE[:BASE.index("--vocab-size")] + BASE[BASE.index("--vocab-size") + 2:] + [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer, "--sft",
        "--data-path", chat]  # the tokenizer sets the vocabulary size
    with pytest.raises(SystemExit) as exit_info:
        pretrain.run_pretraining("gpt", None, "pretrain_gpt.py", argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1
    assert [line for line in err.splitlines() if "error" in line] == [f'pretrain_gpt.py: error: {chat}:1: messages[1].role is wrong: '
                                f'"Assistant". Roles are lower case, as in OpenAI\'s chat '
                                f'format: write "assistant".']
    assert "arguments" not in out  # no dump, not even its header


def test_the_argument_dump_follows_every_start_up_check(tmp_path, monkeypatch, capsys):
    """Good data: the summary line, the GPU check, then the dump (training starts after it)."""
    import megatron.training.global_vars as global_vars

    order = []
    monkeypatch.setattr(initialize, "require_cuda",
                        lambda script: order.append(capsys.readouterr().out))
    # Megatron-LM's start-up, the first step after the checks: stop there.
    monkeypatch.setattr(global_vars, "set_global_variables", _no_gpu)
    good = write_jsonl(tmp_path / "good.jsonl", doc(5), doc(9))
    with pytest.raises(GPUTouched):
        pretrain.run_pretraining("gpt", None, "pretrain_gpt.py", BASE + ["--data-path", good])
    (before_gpu,) = order
    assert before_gpu.startswith("token cache built: ") and "arguments" not in before_gpu
    assert "\ndata check: " in before_gpu
    assert "end of arguments" in capsys.readouterr().out


def test_run_pretraining_on_another_rank_skips_the_check(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(initialize, "require_cuda", _no_gpu)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(GPUTouched):
        pretrain.run_pretraining("gpt", None, "pretrain_gpt.py",
                                 BASE + ["--data-path", str(tmp_path / "missing.jsonl")])
    assert "data check" not in capsys.readouterr().out


def test_training_reuses_the_rows_the_check_packed(tmp_path, monkeypatch):
    from megatron.packed_training.datasets import builder

    path = write_jsonl(tmp_path / "t.jsonl", doc(5), doc(9), doc(3))
    args = args_for(sft=True, data_path=path)
    check = check_data(args)
    assert list(check.rows) == ["train"]
    fresh, _, _ = builder.build_datasets(args)

    def packed_again(*a, **k):
        raise AssertionError("rank 0 packed the file a second time")

    monkeypatch.setattr(builder, "pack_data", packed_again)
    reused, _, stats = builder.build_datasets(args, check.rows)
    assert reused.rows is check.rows["train"].rows and len(reused) == len(fresh)
    assert stats is check.train  # training logs the check's numbers, not an empty count
    assert [row.tokens.tolist() for row in fresh.rows] == [row.tokens.tolist() for row in reused.rows]


# --- --split: validation documents from --data-path ---------------------------------------------

@pytest.mark.parametrize("split, shares", [
    ("969,30,1", (0.969, 0.03, 0.001)),
    ("98/2", (0.98, 0.02, 0.0)),
    ("100", (1.0, 0.0, 0.0)),
    ("1, 1, 0", (0.5, 0.5, 0.0)),
])
def test_split_shares_read_megatrons_spellings(split, shares):
    from megatron.packed_training.datasets.sources import split_shares

    assert split_shares(split) == pytest.approx(shares)


@pytest.mark.parametrize("split", ["a,b", "1,2,3,4", "-1,2", "0,0,0", ""])
def test_a_bad_split_is_refused_by_the_data_check(split, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", doc(5))
    with pytest.raises(ValueError, match="Give up to three non-negative numbers"):
        check_data(args_for(data_path=path, split=split))


def test_split_boundaries_follow_the_cumulative_shares():
    from megatron.packed_training.datasets.sources import split_boundaries

    assert split_boundaries((0.969, 0.03, 0.001), 1000) == [969, 999, 1000]
    assert split_boundaries((0.5, 0.5, 0.0), 3) == [2, 3, 3]
    assert split_boundaries((1.0, 0.0, 0.0), 7) == [7, 7, 7]


def test_split_trains_on_the_first_documents_and_validates_on_the_next(tmp_path):
    from megatron.packed_training.datasets.builder import build_datasets

    # Ten documents in file order, document i of tokens 9 i + 1 ... 9 i + 8.
    path = write_jsonl(tmp_path / "t.jsonl", *(doc(8, start=9 * i + 1) for i in range(10)))
    args = args_for(data_path=path, split="7,2,1", eval_interval=1, eval_iters=1)
    check = check_data(args)
    assert check.train.documents == 7 and check.valid.documents == 2  # the last one is test
    assert (f"--data-path {path} (--split 7,2,1, train): 7 documents" in check.line
            and f"; --data-path {path} (--split 7,2,1, valid): 2 documents" in check.line)
    train, valid, _ = build_datasets(args, check.rows)

    def tokens(dataset) -> set:
        return {int(t) for row in dataset.rows for t in row.tokens} - {0}  # 0: padding

    assert tokens(train) <= set(range(1, 64))  # documents 0-6
    assert tokens(valid) <= set(range(64, 82)) and {64, 73} <= tokens(valid)  # documents 7, 8


def test_split_without_a_validation_share_builds_no_validation_set(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", doc(5), doc(6))
    check = check_data(args_for(data_path=path, split="100,0,0"))
    assert check.valid is None and list(check.rows) == ["train"]


def test_a_validation_share_too_small_for_the_file_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", doc(5), doc(6), doc(7))
    with pytest.raises(ValueError, match=re.escape(
            f"--split is wrong: 99,1,0 gives validation none of the 3 documents of {path}. "
            f"Raise the validation share")):
        check_data(args_for(data_path=path, split="99,1,0"))
