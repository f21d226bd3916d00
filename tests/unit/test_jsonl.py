"""Reading pre-tokenized JSONL: good files, and every rejection with its path:line."""

import re

import numpy as np
import pytest

from megatron.packed_training.datasets.jsonl import read_jsonl_documents
from megatron.packed_training.datasets.row_plan import pack_documents

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
    # JSON syntax errors also give the column: path:3:col.
    with pytest.raises(ValueError, match=re.escape(f"{path}:3:") + r"(\d+:)? .*" + message):
        list(documents)


def test_missing_file_fails_at_call_time(tmp_path):
    with pytest.raises(ValueError, match=r"--data-path is wrong: .*nope\.jsonl"
                                         r"' does not exist"):
        read_jsonl_documents(tmp_path / "nope.jsonl", vocab_size=10)


JSON_FAULTS = [
    # (line, column of the fault, reason and fix)
    ('{"input_ids": [1, 2', 20, r"Expecting ',' delimiter\. The line ends before the JSON object "
                               r"does: write each object whole, on one line"),
    ("{'input_ids': [1, 2]}", 2, r"Expecting property name enclosed in double quotes\. Write keys "
                                 r"in double quotes"),
    ('{"input_ids": [1, 2,]}', 20, r"a comma before '\]'\. Remove the trailing comma"),
    ('{"input_ids": [1, 2], }', 21, r"a comma before '\}'\. Remove the trailing comma"),
    ('{"input_ids": [1, 2]} {"input_ids": [3]}', 23, r"Extra data\. Put one JSON object per line"),
    ('{"input_ids": [1 2]}', 18, r"Expecting ',' delimiter\. Separate list items"),
    ('  {"input_ids": [1, x]}', 21, r"Expecting value\. Write a JSON value here"),
]


@pytest.mark.parametrize("line, column, message", JSON_FAULTS, ids=[f[0] for f in JSON_FAULTS])
def test_json_syntax_error_names_file_line_and_the_faults_column(tmp_path, line, column, message):
    path = write(tmp_path, GOOD_LINE, line)
    with pytest.raises(ValueError) as error:
        list(read_jsonl_documents(path, vocab_size=100))
    first, excerpt, caret = str(error.value).split("\n")
    assert re.match(re.escape(f"{path}:2:{column}: JSON is wrong: ") + message, first), first
    # The caret stands under the fault in the excerpt of the line.
    assert excerpt == "    " + line and caret == "    " + " " * (column - 1) + "^"


def test_json_error_excerpt_of_a_long_line_is_cut_around_the_fault(tmp_path):
    line = '{"input_ids": [' + ", ".join(map(str, range(200))) + ', x]}'
    path = write(tmp_path, line)
    with pytest.raises(ValueError) as error:
        list(read_jsonl_documents(path, vocab_size=1000))
    first, excerpt, caret = str(error.value).split("\n")
    column = line.index("x") + 1
    assert first.startswith(f"{path}:1:{column}: JSON is wrong: Expecting value")
    assert excerpt.startswith("    ...") and excerpt.endswith("x]}") and len(excerpt) < 80
    assert excerpt[caret.index("^")] == "x"


def test_utf8_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b'\n{"input_ids": [1, \xff2]}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2:19: text is wrong: byte 0xff is not "
                                                   "UTF-8. Save the file as UTF-8.")):
        list(read_jsonl_documents(path, vocab_size=100))


def test_byte_order_mark_is_named_with_its_fix(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\ufeff" + GOOD_LINE + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{path}:1:1: JSON is wrong: Unexpected UTF-8 "
                                                   "BOM") + ".*without a byte-order mark"):
        list(read_jsonl_documents(path, vocab_size=100))


def test_windows_line_endings_are_read(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"input_ids": [1, 2]}\r\n{"input_ids": [3, 4]}\r\n')
    assert [d.input_ids.tolist() for d in read_jsonl_documents(path, vocab_size=10)] == [[1, 2], [3, 4]]


def test_directory_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"is not a file"):
        read_jsonl_documents(tmp_path, vocab_size=10)


@pytest.mark.parametrize("bad", [0, -1, 3.0, None])
def test_bad_vocab_size_is_rejected(tmp_path, bad):
    with pytest.raises(ValueError, match="--vocab-size"):
        read_jsonl_documents(write(tmp_path, GOOD_LINE), vocab_size=bad)
