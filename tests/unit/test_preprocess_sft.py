"""tools/preprocess_sft.py: chat JSONL -> pre-tokenized JSONL, and the same packed batches as
reading the chat file on the fly. CPU and offline (tokenizers trained in tmp_path)."""

import dataclasses
import json
import os
import re
import sys
from unittest import mock

import numpy as np
import pytest
import torch

import tools.preprocess_sft as pre
from megatron.packed_training import extra_args
from megatron.packed_training.arguments import parse_args
from megatron.packed_training.datasets.builder import build_data_iterator, build_datasets
from megatron.packed_training.datasets.chat import encode_conversation
from megatron.packed_training.tokenizer import load_tokenizer
from tests.unit.test_chat_data import CONVERSATION, CUSTOM_TEMPLATE, make_tokenizer, write_jsonl

WORDS = ("packed rows hold whole documents back to back; the padding tail is one more segment "
         "and the loss mask marks prediction targets").split()


def conversations(count: int, seed: int = 0) -> list[dict]:
    """Varied multi-turn conversations, every fifth without an assistant turn."""
    rng = np.random.default_rng(seed)

    def text():
        return " ".join(rng.choice(WORDS, size=int(rng.integers(1, 12))))

    records = []
    for index in range(count):
        messages = [{"role": "system", "content": text()}] if index % 3 == 0 else []
        for _ in range(int(rng.integers(1, 4))):
            messages.append({"role": "user", "content": text()})
            if index % 5 != 4:
                messages.append({"role": "assistant", "content": text()})
        records.append({"messages": messages})
    return records


@pytest.fixture(autouse=True)
def no_optional_packages(monkeypatch):
    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)


@pytest.fixture(scope="module", params=["default template", "tokenizer template"])
def folder(request, tmp_path_factory):
    template = None if request.param == "default template" else CUSTOM_TEMPLATE
    return make_tokenizer(tmp_path_factory.mktemp("tok"), template)


def test_writes_pre_tokenized_jsonl_and_a_summary(tmp_path, folder, capsys):
    records = conversations(20)
    chat = write_jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "train.jsonl"
    assert pre.main(["--input", chat, "--output", str(out), "--tokenizer-model", folder]) == 0
    tokenizer = load_tokenizer("HuggingFaceTokenizer", folder)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    kept = [r for r in records if any(m["role"] == "assistant" for m in r["messages"])]
    assert len(written) == len(kept) == 16
    for record, line in zip(kept, written):
        ids, mask = encode_conversation(tokenizer, record["messages"])
        assert line == {"input_ids": ids.tolist(), "loss_mask": mask.astype(int).tolist()}
    tokens = sum(len(line["input_ids"]) for line in written)
    assistant = sum(sum(line["loss_mask"]) for line in written)
    captured = capsys.readouterr()
    assert captured.out.startswith(
        f"preprocess_sft: 20 conversations, {tokens} tokens, {assistant} assistant tokens (")
    assert "skipped 4 (no assistant turn)" in captured.out and "--vocab-size 500" in captured.out
    assert "20/20" in captured.err  # the progress bar


def test_simple_progress_bar_without_tqdm(tmp_path, folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import raises ImportError
    chat = write_jsonl(tmp_path / "chat.jsonl", conversations(3))
    out = tmp_path / "train.jsonl"
    assert pre.main(["--input", chat, "--output", str(out), "--tokenizer-model", folder]) == 0
    err = capsys.readouterr().err
    assert "preprocess_sft: 100% 3/3 conversations" in err and err.endswith("\n")
    assert isinstance(pre.progress_bar(3, "x"), pre._SimpleBar)


def test_workers_write_the_same_file(tmp_path, folder):
    chat = write_jsonl(tmp_path / "chat.jsonl", conversations(150))
    outputs = []
    for workers in (1, 3):
        out = tmp_path / f"out{workers}.jsonl"
        assert pre.main(["--input", chat, "--output", str(out), "--tokenizer-model", folder,
                         "--workers", str(workers), "--no-progress"]) == 0
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1] and outputs[0].count("\n") == 120


def test_worker_errors_name_file_line(tmp_path, folder, capsys):
    records = conversations(200) + [{"messages": [{"role": "user", "content": 3}]}]
    chat = write_jsonl(tmp_path / "chat.jsonl", records)
    assert pre.main(["--input", chat, "--output", str(tmp_path / "o.jsonl"),
                     "--tokenizer-model", folder, "--workers", "2", "--no-progress"]) == 2
    assert f"{chat}:201: messages[0].content is wrong: 3" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_no_progress(tmp_path, folder, capsys):
    chat = write_jsonl(tmp_path / "chat.jsonl", conversations(2))
    assert pre.main(["--input", chat, "--output", str(tmp_path / "o.jsonl"),
                     "--tokenizer-model", folder, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("seq_length, micro_batch_size", [(64, 2), (256, 1)])
def test_on_the_fly_and_preprocessed_give_identical_batches(tmp_path, folder, seq_length,
                                                             micro_batch_size):
    chat = write_jsonl(tmp_path / "chat.jsonl", conversations(40, seed=seq_length))
    out = str(tmp_path / "train.jsonl")
    assert pre.main(["--input", chat, "--output", out, "--tokenizer-model", folder,
                     "--no-progress"]) == 0
    # Every document trains, no evaluation.
    common = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
              "--train-iters", "6", "--lr", "1e-3", "--sft", "--split", "100,0,0",
              "--eval-iters", "0", "--micro-batch-size", str(micro_batch_size),
              "--global-batch-size", "4"]

    def batches(*extra):
        with mock.patch.dict(os.environ, {"WORLD_SIZE": "1", "RANK": "0"}):
            args = parse_args(common + list(extra), "gpt")
        train, _, stats = build_datasets(args)
        iterator = build_data_iterator(train, 0, micro_batch_size, 0, 1)
        return stats, list(iterator)

    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder]
    on_the_fly_stats, on_the_fly = batches("--data-path", chat, *tokenizer)
    preprocessed_stats, preprocessed = batches("--data-path", out, "--vocab-size", "500")
    _, preprocessed_with_tokenizer = batches("--data-path", out, *tokenizer)
    # The preprocessor dropped the conversations without an assistant turn already; on the
    # fly they are skipped while reading, and counted.
    assert on_the_fly_stats.skipped_no_target > 0 == preprocessed_stats.skipped_no_target
    assert dataclasses.replace(on_the_fly_stats, skipped_no_target=0) == preprocessed_stats
    assert on_the_fly_stats.rows > 1
    assert len(on_the_fly) == len(preprocessed) == 24 // micro_batch_size
    for first, second, third in zip(on_the_fly, preprocessed, preprocessed_with_tokenizer):
        assert first.keys() == second.keys() == third.keys()
        for key, value in first.items():
            for other in (second, third):
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, other[key]), key
                else:
                    assert value == other[key], key
    # Prompts really are masked out: some label positions of real tokens carry no loss.
    batch = on_the_fly[0]
    real = batch["labels"] != 0
    assert (batch["loss_mask"][real] == 0).any() and (batch["loss_mask"][real] == 1).any()
    assert batch["num_documents"] >= 1 and batch["cu_seqlens"][-1] == micro_batch_size * seq_length


def test_bad_line_is_reported_with_file_line_and_leaves_no_output(tmp_path, folder, capsys):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION},
                                                  {"messages": [{"role": "user"}]}])
    out = tmp_path / "train.jsonl"
    assert pre.main(["--input", chat, "--output", str(out), "--tokenizer-model", folder]) == 2
    err = capsys.readouterr().err
    assert f"preprocess_sft: error: {chat}:2: messages[0].content is wrong" in err
    assert list(tmp_path.iterdir()) == [tmp_path / "chat.jsonl"]


@pytest.mark.parametrize("case, message", [
    ("tokenized", "is not chat data"),
    ("missing", "is not a file"),
    ("same", "--output is wrong: .* is the input file"),
    ("no tokenizer", "--tokenizer-model is wrong: .*No such file or folder"),
    ("workers", "--workers is wrong: 0. Use 1 or more"),
])
def test_refusals(tmp_path, folder, capsys, case, message):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    source = {"tokenized": write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 2]}]),
              "missing": str(tmp_path / "none.jsonl")}.get(case, chat)
    output = chat if case == "same" else str(tmp_path / "out.jsonl")
    model = str(tmp_path / "no-tokenizer") if case == "no tokenizer" else folder
    workers = ["--workers", "0"] if case == "workers" else []
    assert pre.main(["--input", source, "--output", output, "--tokenizer-model", model,
                     *workers]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_no_assistant_turn_anywhere_is_refused_and_leaves_no_output(tmp_path, folder, capsys):
    chat = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "one question"}]},
        {"messages": [{"role": "system", "content": "terse"},
                      {"role": "user", "content": "another"}]}])
    out = tmp_path / "train.jsonl"
    assert pre.main(["--input", chat, "--output", str(out), "--tokenizer-model", folder,
                     "--no-progress"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"preprocess_sft: error: --input is wrong: none of the 2 conversations of {chat} has "
        'an assistant turn, so there is nothing to train on (a conversation trains on the '
        'turns whose role is "assistant"). Check the roles; no output was written.']
    assert list(tmp_path.iterdir()) == [tmp_path / "chat.jsonl"]


def test_sharegpt_input_is_named_with_the_rewrite(tmp_path, folder, capsys):
    from tests.unit.test_chat_data import SHAREGPT, SHAREGPT_MESSAGE

    source = write_jsonl(tmp_path / "sharegpt.jsonl", ["\n", SHAREGPT])
    assert pre.main(["--input", source, "--output", str(tmp_path / "train.jsonl"),
                     "--tokenizer-model", folder, "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.match(rf"preprocess_sft: error: {source}:2: {SHAREGPT_MESSAGE}", line), line
    assert list(tmp_path.iterdir()) == [tmp_path / "sharegpt.jsonl"]
