"""Reading pre-tokenized JSONL: good files, and every rejection with its path:line."""

import re

import numpy as np
import pytest

from megatron.training.datasets.jsonl import read_jsonl_documents
from megatron.training.datasets.packing import pack_documents

GOOD_LINE = '{"input_ids": [1, 2, 3]}'


def write(tmp_path, *lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_documents_with_origin_and_optional_mask(tmp_path):
    path = write(tmp_path, '{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}', "", "   ", '{"input_ids": [9, 8]}')
    documents = list(read_jsonl_documents(path, vocab_size=10))
    assert [d.origin for d in documents] == [f"{path}:1", f"{path}:4"]
    assert documents[0].input_ids.tolist() == [5, 6, 7] and documents[0].input_ids.dtype == np.int64
    assert documents[0].loss_mask.tolist() == [0.0, 1.0, 1.0] and documents[0].loss_mask.dtype == np.float32
    assert documents[1].loss_mask is None


def test_boolean_mask_and_null_mask_are_accepted(tmp_path):
    path = write(tmp_path, '{"input_ids": [1, 2], "loss_mask": [false, true]}', '{"input_ids": [1, 2], "loss_mask": null}')
    first, second = read_jsonl_documents(path, vocab_size=3)
    assert first.loss_mask.tolist() == [0.0, 1.0] and second.loss_mask is None


def test_jsonl_mask_reaches_the_row_shifted(tmp_path):
    path = write(tmp_path, '{"input_ids": [11, 12, 13, 14], "loss_mask": [1, 0, 1, 1]}')
    (row,) = pack_documents(read_jsonl_documents(path, vocab_size=20), 5)
    assert row.tokens.tolist() == [11, 12, 13, 0, 0]
    assert row.labels.tolist() == [12, 13, 14, 0, 0]
    assert row.loss_mask.tolist() == [0, 1, 1, 0, 0]


BAD_LINES = [
    ('{"input_ids": [1, 2', r"JSON is wrong"),
    ("[1, 2, 3]", r"a JSON list, not an object"),
    ('{"ids": [1, 2]}', r"no input_ids"),
    ('{"input_ids": 7}', r"input_ids is wrong: a JSON int"),
    ('{"input_ids": [1, true]}', r"element 1 is true"),
    ('{"input_ids": [1, 3.0]}', r"element 1 is 3\.0"),
    ('{"input_ids": [1, "2"]}', r'element 1 is "2"'),
    ('{"input_ids": [1, 2, -4]}', r"element 2 is -4, negative"),
    ('{"input_ids": [1, 100]}', r"element 1 is 100, not below the vocab size 100\. Set --vocab-size"),
    ('{"input_ids": [1, 2], "loss_mask": [1]}', r"1 values for 2 input_ids"),
    ('{"input_ids": [1, 2], "loss_mask": [1, 2]}', r"loss_mask is wrong: element 1 is 2\b"),
    ('{"input_ids": [1, 2], "loss_mask": [1, 0.5]}', r"loss_mask is wrong: element 1 is 0\.5"),
    ('{"input_ids": [1, 2], "loss_mask": "11"}', r"loss_mask is wrong: a JSON str"),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_bad_line_names_path_line_and_problem(tmp_path, line, message):
    path = write(tmp_path, GOOD_LINE, "", line)
    documents = read_jsonl_documents(path, vocab_size=100)
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + ".*" + message):
        list(documents)


def test_missing_file_fails_at_call_time(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*--data-path"):
        read_jsonl_documents(tmp_path / "nope.jsonl", vocab_size=10)


def test_directory_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"is not a file"):
        read_jsonl_documents(tmp_path, vocab_size=10)


@pytest.mark.parametrize("bad", [0, -1, 3.0, None])
def test_bad_vocab_size_is_rejected(tmp_path, bad):
    with pytest.raises(ValueError, match="--vocab-size"):
        read_jsonl_documents(write(tmp_path, GOOD_LINE), vocab_size=bad)
