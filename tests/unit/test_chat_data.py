"""Chat SFT data: --tokenizer-type / --tokenizer-model, chat templates and the assistant-only
loss mask (megatron/packed_training/tokenizer.py, megatron/packed_training/datasets/chat.py).

CPU and offline: every tokenizer is a small byte-level BPE trained here on the repo's own docs
and saved to tmp_path, as a folder (tokenizer.json + tokenizer_config.json) or a bare
tokenizer.json.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.packed_training.datasets.builder import build_datasets
from megatron.packed_training.datasets.chat import (
    ChatStats,
    detect_format,
    encode_conversation,
    read_chat_documents,
    read_documents,
)
from megatron.packed_training.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    HuggingFaceTokenizer,
    load_tokenizer,
    tokenizer_from_args,
)

REPO = Path(__file__).resolve().parents[2]
CORPUS = [REPO / "README.md", REPO / "docs" / "data-format.md"]
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# A template of the tokenizer's own: BOS, and assistant turns closed by </s> instead of <|im_end|>.
CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] }}</s>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Marks assistant text with {% generation %}: transformers' assistant mask is used.
GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
    "{% endgeneration %}\n{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "You pack documents into rows."},
    {"role": "user", "content": "What is a packed row?"},
    {"role": "assistant", "content": "Documents laid back to back, each its own segment."},
    {"role": "user", "content": "And the padding? (ünïcode ✓)"},
    {"role": "tool", "content": "{\"pad_id\": 0}"},
    {"role": "assistant", "content": "The unused end of a row: pad id 0,\nloss mask 0."},
]


def make_tokenizer(folder: Path, chat_template: str | None = None) -> str:
    """Train a ~500-token byte-level BPE on the repo's docs; save it as a tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train([str(path) for path in CORPUS], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def write_jsonl(path: Path, records) -> str:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in records))
    return str(path)


def runs(mask) -> list[tuple[int, int]]:
    """[start, end) of every run of 1s."""
    edges = np.diff(np.concatenate([[0], np.asarray(mask, dtype=np.int64), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def decoded_turns(tokenizer, ids, mask) -> list[str]:
    return [tokenizer.detokenize(ids[start:end]) for start, end in runs(mask)]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """A tokenizer folder without a chat template: the built-in ChatML one is used."""
    with pytest.warns(UserWarning, match="no chat template"):
        return load_tokenizer("HuggingFaceTokenizer",
                              make_tokenizer(tmp_path_factory.mktemp("chatml")))


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    return load_tokenizer("HuggingFaceTokenizer",
                          make_tokenizer(tmp_path_factory.mktemp("custom"), CUSTOM_TEMPLATE))


# ------------------------------------------------------------------ masks and turn boundaries

def test_default_template_masks_prompt_and_unmasks_assistant_turns(chatml):
    assert chatml.uses_default_template and chatml.chat_template == DEFAULT_CHAT_TEMPLATE
    ids, mask = encode_conversation(chatml, CONVERSATION)
    text = chatml.render(CONVERSATION)
    assert text.startswith("<|im_start|>system\nYou pack documents into rows.<|im_end|>\n")
    # The whole conversation, tokenized once.
    assert ids.tolist() == chatml.tokenize(text) and chatml.detokenize(ids) == text
    # Each masked-in run is one assistant turn: its text and the end-of-turn mark, no header.
    assert decoded_turns(chatml, ids, mask) == [
        m["content"] + "<|im_end|>\n" for m in CONVERSATION if m["role"] == "assistant"]
    # Everything else (system, user, tool turns, every header) is masked out.
    prompt = chatml.detokenize(ids[mask == 0])
    assert "What is a packed row?" in prompt and "<|im_start|>assistant\n" in prompt
    assert "Documents laid back" not in prompt and '{"pad_id": 0}' in prompt
    assert mask.dtype == np.float32 and set(np.unique(mask)) == {0.0, 1.0}


def test_tokenizer_template_is_used_and_its_turn_ends_are_trained(custom):
    assert not custom.uses_default_template and custom.chat_template == CUSTOM_TEMPLATE
    ids, mask = encode_conversation(custom, CONVERSATION)
    assert custom.detokenize(ids[:1]) == "<s>" and mask[0] == 0  # BOS from the template
    assert decoded_turns(custom, ids, mask) == [
        m["content"] + "</s>\n" for m in CONVERSATION if m["role"] == "assistant"]
    assert "<|im_start|>assistant\n" not in "".join(decoded_turns(custom, ids, mask))


def test_generation_blocks_use_transformers_assistant_mask(tmp_path):
    tokenizer = load_tokenizer("HuggingFaceTokenizer",
                               make_tokenizer(tmp_path / "tok", GENERATION_TEMPLATE))
    assert tokenizer.marks_assistant_tokens
    ids, mask = encode_conversation(tokenizer, CONVERSATION)
    assert ids.tolist() == tokenizer.tokenize(tokenizer.render(CONVERSATION))
    assert decoded_turns(tokenizer, ids, mask) == [
        m["content"] + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant"]


def test_conversation_starting_with_the_assistant_and_empty_reply(chatml):
    messages = [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "x"},
                {"role": "assistant", "content": ""}]
    ids, mask = encode_conversation(chatml, messages)
    assert decoded_turns(chatml, ids, mask) == ["Hi.<|im_end|>\n", "<|im_end|>\n"]


def test_tokenizer_json_file_uses_the_default_template(tmp_path):
    path = Path(make_tokenizer(tmp_path / "tok", CUSTOM_TEMPLATE)) / "tokenizer.json"
    with pytest.warns(UserWarning, match="pass its folder"):
        tokenizer = load_tokenizer("HuggingFaceTokenizer", path)
    assert tokenizer.uses_default_template and tokenizer.vocab_size == 500
    ids, mask = encode_conversation(tokenizer, CONVERSATION)
    assert decoded_turns(tokenizer, ids, mask)[0] == CONVERSATION[2]["content"] + "<|im_end|>\n"


# ------------------------------------------------------------------------- reading files

def test_reads_conversations_with_origin_and_skips_those_without_assistant(tmp_path, chatml):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": CONVERSATION}, "\n",
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": CONVERSATION[:3], "id": 7},
    ])
    stats = ChatStats()
    documents = list(read_chat_documents(path, chatml, stats))
    assert [d.origin for d in documents] == [f"{path}:1", f"{path}:4"]
    assert (stats.conversations, stats.skipped) == (3, 1)
    assert stats.tokens == sum(len(d.input_ids) for d in documents)
    assert stats.assistant_tokens == sum(int(d.loss_mask.sum()) for d in documents)
    ids, mask = encode_conversation(chatml, CONVERSATION)
    assert np.array_equal(documents[0].input_ids, ids)
    assert np.array_equal(documents[0].loss_mask, mask)


def test_format_is_detected_per_file(tmp_path, chatml):
    chat = write_jsonl(tmp_path / "chat.jsonl", ["\n", {"messages": CONVERSATION}])
    tokenized = write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": [5, 6, 7]}])
    assert detect_format(chat) == "chat" and detect_format(tokenized) == "tokenized"
    assert detect_format(tmp_path / "missing.jsonl") is None
    (document,) = read_documents(tokenized, vocab_size=500, tokenizer=chatml)
    assert document.input_ids.tolist() == [5, 6, 7] and document.loss_mask is None
    (document,) = read_documents(chat, vocab_size=500, tokenizer=chatml)
    assert document.origin == f"{chat}:2"
    with pytest.raises(ValueError, match=rf"{chat}:2: data is wrong: a chat conversation.*"
                                         r"--tokenizer-model.*tools/preprocess_sft.py"):
        read_documents(chat, vocab_size=500, tokenizer=None)


GOOD = {"messages": CONVERSATION[1:3]}


@pytest.mark.parametrize("bad, message", [
    ('{"messages": [\n', r"JSON is wrong: .*Write one JSON object per line"),
    ("[1, 2]\n", r"record is wrong: a JSON list, not an object"),
    ({"input_ids": [1, 2, 3]}, r"record is wrong: no messages \(input_ids, a pre-tokenized record\).*one format per file"),
    ({"messages": []}, r"messages is wrong: an empty list"),
    ({"messages": "hi"}, r"messages is wrong: a JSON str"),
    ({"messages": ["hi"]}, r"messages\[0\] is wrong: a JSON str"),
    ({"messages": [{"content": "hi"}]}, r"messages\[0\].role is wrong: null"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, r"messages\[0\].content is wrong: \[\"a\"\]"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\].content is wrong: null.*as a string"),
    ({"messages": CONVERSATION, "tools": "x"}, r"tools is wrong: a JSON str"),
])
def test_errors_name_file_line_and_fix(tmp_path, chatml, bad, message):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, "\n", bad])
    documents = read_chat_documents(path, chatml)
    next(documents)
    with pytest.raises(ValueError, match=rf"^{path}:3: {message}"):
        next(documents)


def test_template_errors_name_file_line(tmp_path):
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must "
                "start with the user') }}{% endif %}" + DEFAULT_CHAT_TEMPLATE)
    tokenizer = load_tokenizer("HuggingFaceTokenizer", make_tokenizer(tmp_path / "t", template))
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"messages": CONVERSATION}])
    with pytest.raises(ValueError, match=rf"^{path}:2: chat template is wrong for this "
                                         r"conversation: .*must start with the user.*Fix"):
        list(read_chat_documents(path, tokenizer))


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # Renders the turn count first: a prefix of the conversation renders differently.
    template = "{{ messages | length }}" + DEFAULT_CHAT_TEMPLATE
    tokenizer = load_tokenizer("HuggingFaceTokenizer", make_tokenizer(tmp_path / "t", template))
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ValueError, match=rf"^{path}:1: chat template is wrong .*messages\[2\] "
                                         r".*renders differently.*\{% generation %\}"):
        list(read_chat_documents(path, tokenizer))


# ------------------------------------------------ --tokenizer-type / --tokenizer-model

def data_args(**values) -> argparse.Namespace:
    """What the data builder reads of a run's args (host logic: no launch line parsed)."""
    defaults = dict(mock_data=False, data_path=None, valid_data_path=None, split=None,
                    vocab_size=32000, tokenizer_type=None, tokenizer_model=None, sft=False,
                    seq_length=64, long_document_policy="split",
                    max_truncated_token_fraction=None, dynamic_cp_sizes=None,
                    context_parallel_size=1, train_iters=2, global_batch_size=1,
                    eval_interval=1000, eval_iters=0, seed=1234)
    return argparse.Namespace(**(defaults | values))


def hf(folder) -> dict:
    return dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("flags"), CUSTOM_TEMPLATE)


def test_vocab_size_is_the_tokenizers_length(folder):
    tokenizer = tokenizer_from_args(data_args(**hf(folder)))
    assert tokenizer.vocab_size == 500 and tokenizer.path == folder
    assert tokenizer_from_args(data_args()) is None  # pre-tokenized data: no tokenizer


@pytest.mark.parametrize("kind, path, message", [
    ("GPT2BPETokenizer", "x",
     "--tokenizer-type is wrong: GPT2BPETokenizer. This fork builds HuggingFaceTokenizer only"),
    ("HuggingFaceTokenizer", None, "--tokenizer-model is wrong: None. Pass a local tokenizer"),
    ("HuggingFaceTokenizer", "gpt2",
     r"--tokenizer-model is wrong: .*gpt2. No such file or folder \(it is read locally, never "
     r"downloaded\)"),
    ("HuggingFaceTokenizer", ".", r"--tokenizer-model is wrong: .*The folder has no tokenizer.json"),
])
def test_tokenizer_flag_errors(tmp_path, monkeypatch, kind, path, message):
    monkeypatch.chdir(tmp_path)  # "gpt2" is a hub name: it must not be looked up anywhere
    with pytest.raises(ValueError, match=message):
        load_tokenizer(kind, path)


def test_unloadable_tokenizer_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="--tokenizer-model is wrong: .*transformers could not "
                                         "load a tokenizer from it"):
        load_tokenizer("HuggingFaceTokenizer", tmp_path)


def test_missing_transformers_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    with pytest.raises(ValueError, match=r"needs the transformers package.*pip install \.\[chat\]"):
        HuggingFaceTokenizer(make_tokenizer(tmp_path / "t"))


def test_chat_data_needs_a_tokenizer(tmp_path, folder):
    chat = write_jsonl(tmp_path / "chat.jsonl", ["\n", GOOD])
    with pytest.raises(ValueError, match=rf"{chat}:2: data is wrong: a chat conversation .*no "
                                         r"tokenizer is given. Add --tokenizer-type "
                                         r"HuggingFaceTokenizer --tokenizer-model.*"
                                         r"tools/preprocess_sft.py"):
        build_datasets(data_args(data_path=chat, sft=True))
    tokenized = write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": [1, 2, 3]}])
    with pytest.raises(ValueError, match=rf"{chat}:2: data is wrong: a chat conversation"):
        build_datasets(data_args(data_path=tokenized, valid_data_path=chat, sft=True,
                                 eval_iters=1))
    train, valid, _ = build_datasets(data_args(data_path=chat, valid_data_path=tokenized,
                                               sft=True, eval_iters=1, **hf(folder)))
    assert len(train.rows) == 1 and len(valid.rows) == 1


def test_on_the_fly_chat_data_through_the_builder(tmp_path, folder):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, GOOD])
    train, _, stats = build_datasets(data_args(data_path=chat, sft=True, seq_length=256,
                                               **hf(folder)))
    assert stats.documents == 2 and stats.rows == 1
    row = train[0]
    tokenizer = load_tokenizer("HuggingFaceTokenizer", folder)
    ids, mask = encode_conversation(tokenizer, CONVERSATION)
    n = len(ids) - 1
    assert np.array_equal(row.tokens[:n], ids[:-1]) and np.array_equal(row.labels[:n], ids[1:])
    # Position j predicts token j + 1: its loss mask is that token's.
    assert np.array_equal(row.loss_mask[:n], mask[1:])
    assert row.cu_seqlens[1] == n


@pytest.mark.parametrize("user, assistant, wrong, meant", [
    ("user", "Assistant", "Assistant", "assistant"),  # another case
    ("human", "gpt", "human", "user"),  # ShareGPT's names
    ("user", "bot", "bot", "assistant"),
])
def test_a_role_under_another_name_is_refused_naming_the_fix(user, assistant, wrong, meant):
    from megatron.packed_training.datasets.chat import encode_line

    line = json.dumps({"messages": [{"role": user, "content": "Hi"},
                                    {"role": assistant, "content": "Hello"}]})
    index = 0 if wrong == user else 1
    with pytest.raises(ValueError, match=rf'f.jsonl:3: messages\[{index}\].role is wrong: '
                                         rf'"{wrong}"\. Roles are lower case, as in OpenAI\'s '
                                         rf'chat format: write "{meant}"'):
        encode_line(line, "f.jsonl:3", tokenizer=None)


def test_conversations_without_an_assistant_turn_are_counted_in_the_summary():
    from megatron.packed_training.datasets.builder import describe_packing
    from megatron.packed_training.datasets.packing import PackingStats

    line = describe_packing(PackingStats(documents=3, rows=1, skipped_no_target=2))
    assert "skipped 0 empty and 2 without an assistant turn," in line
    assert "without an assistant turn" not in describe_packing(PackingStats(documents=3, rows=1))


def test_on_the_fly_packing_counts_conversations_without_an_assistant_turn(folder, tmp_path):
    from megatron.packed_training.datasets.sources import pack_data

    data = tmp_path / "chat.jsonl"
    talk = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    data.write_text("\n".join(json.dumps({"messages": m}) for m in (
        talk, [{"role": "user", "content": "only a question"}], talk)) + "\n")
    stats = pack_data(data_args(data_path=str(data), sft=True, **hf(folder)))["train"].stats
    assert stats.skipped_no_target == 1 and stats.documents == 2


def test_a_file_of_conversations_without_an_assistant_turn_says_so(folder, tmp_path):
    from megatron.packed_training.datasets.sources import pack_data

    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q}]})
                              for q in ("one question", "another")) + "\n")
    with pytest.raises(ValueError, match=r"\(0 shorter, 2 conversations without an assistant "
                                         r"turn\)\. .*role is \"assistant\""):
        pack_data(data_args(data_path=str(data), sft=True, **hf(folder)))


# ------------------------------------------------------------------ ShareGPT-style records

SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."},
                              {"from": "human", "value": "Hi"},
                              {"from": "gpt", "value": "Hello"}]}
SHAREGPT_MESSAGE = (
    r'data is wrong: a ShareGPT-style conversation \("conversations" of "from" / "value" '
    r'turns\)\. Rewrite each line as \{"messages": \[\{"role": \.\.\., "content": \.\.\.\}\]\}: '
    r'"conversations" -> "messages", "from" -> "role" \(human -> user, gpt -> assistant, '
    r'system -> system\), "value" -> "content" \(a converter: docs/data-format\.md, "ShareGPT '
    r'data"\)\.$')


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_sharegpt_data_is_named_with_the_rewrite(tmp_path, chatml, with_tokenizer):
    path = write_jsonl(tmp_path / "sharegpt.jsonl", ["\n", SHAREGPT])
    with pytest.raises(ValueError, match=rf"^{path}:2: {SHAREGPT_MESSAGE}"):
        list(read_documents(path, vocab_size=500, tokenizer=chatml if with_tokenizer else None))


def test_a_sharegpt_record_in_a_chat_file_is_named_at_its_line(tmp_path, chatml):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, SHAREGPT])
    with pytest.raises(ValueError, match=rf"^{path}:2: {SHAREGPT_MESSAGE}"):
        list(read_documents(path, vocab_size=500, tokenizer=chatml))


def test_messages_under_the_key_conversations_are_named(tmp_path, chatml):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": CONVERSATION}])
    with pytest.raises(ValueError, match=rf'^{path}:1: data is wrong: the conversation is '
                                         r'under "conversations"\. Rename the key to '
                                         r'"messages"'):
        list(read_documents(path, vocab_size=500, tokenizer=chatml))


def test_the_documented_sharegpt_converter_gives_data_training_reads(tmp_path, chatml):
    """docs/data-format.md's converter, run as a user would, on ShareGPT lines: its output is
    chat data whose conversations train on the gpt turns."""
    import re
    import subprocess

    doc = (REPO / "docs" / "data-format.md").read_text()
    section = doc[doc.index("### ShareGPT data"):]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    assert command.startswith("python ")
    source = write_jsonl(tmp_path / "sharegpt.jsonl", [SHAREGPT, SHAREGPT])
    subprocess.run(["bash", "-c", sys.executable + command.removeprefix("python")],
                   cwd=tmp_path, check=True)
    converted = tmp_path / "chat.jsonl"
    assert json.loads(converted.read_text().splitlines()[0]) == {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}]}
    stats = ChatStats()
    documents = list(read_documents(converted, vocab_size=500, tokenizer=chatml, stats=stats))
    assert len(documents) == 2 and stats.assistant_tokens > 0 and source


def test_training_refuses_sharegpt_data_in_one_line(tmp_path, monkeypatch, capsys):
    """pretrain_gpt.py's data check (before any GPU work): exit status 1, one error line."""
    import re

    from megatron.packed_training import extra_args, initialize, pretrain

    def no_gpu(script):
        raise AssertionError("the data check must stop the run before the GPU check")

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)
    monkeypatch.setattr(initialize, "require_cuda", no_gpu)
    path = write_jsonl(tmp_path / "sharegpt.jsonl", [SHAREGPT])
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--train-iters", "2", "--lr", "1e-3", "--vocab-size", "100", "--attention-backend",
            "local", "--eval-iters", "0", "--sft", "--data-path", path]
    with pytest.raises(SystemExit) as exit_info:
        pretrain.run_pretraining("gpt", None, "pretrain_gpt.py", argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert re.match(rf"pretrain_gpt\.py: error: {path}:1: {SHAREGPT_MESSAGE}", errors[0])
