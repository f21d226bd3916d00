"""Row layout of `pack_documents` and the micro-batch dict of `collate_packed_rows`."""

import numpy as np
import pytest
import torch

from megatron.packed_training.datasets.packing import (
    PAD_TOKEN_ID,
    Document,
    PackingStats,
    collate_packed_rows,
)
from megatron.packed_training.datasets.row_plan import pack_documents


def doc(ids, mask=None, origin="t.jsonl:1"):
    ids = np.asarray(ids, dtype=np.int64)
    return Document(ids, None if mask is None else np.asarray(mask, dtype=np.float32), origin)


def docs_of_lengths(*lengths):
    """Documents whose ids encode (document, index): doc d token j is 100*(d+1) + j."""
    return [doc(100 * (d + 1) + np.arange(n), origin=f"t.jsonl:{d + 1}") for d, n in enumerate(lengths)]


def test_cu_seqlens_follow_document_lengths_with_padding_tail():
    stats = PackingStats()
    (row,) = pack_documents(docs_of_lengths(5, 3, 4), 10, stats=stats)
    assert row.cu_seqlens.tolist() == [0, 4, 6, 9, 10]
    assert row.cu_seqlens.dtype == np.int32
    assert row.num_documents == 3 and row.num_segments == 4
    assert (stats.documents, stats.rows, stats.padding_tokens, stats.tokens) == (3, 1, 1, 9)


def test_exact_fit_has_no_padding_segment():
    stats = PackingStats()
    rows = list(pack_documents(docs_of_lengths(6, 6), 10, stats=stats))
    assert len(rows) == 1
    assert rows[0].cu_seqlens.tolist() == [0, 5, 10]
    assert rows[0].num_documents == 2 and rows[0].num_segments == 2
    assert rows[0].loss_mask.tolist() == [1.0] * 10
    assert stats.padding_tokens == 0


def test_greedy_sequential_closes_row_and_keeps_order():
    # The third document (2 positions) would fit in row 1, but greedy packing never looks back.
    rows = list(pack_documents(docs_of_lengths(8, 5, 3), 10))
    assert [r.cu_seqlens.tolist() for r in rows] == [[0, 7, 10], [0, 4, 6, 10]]
    assert [r.num_documents for r in rows] == [1, 2]
    assert rows[1].tokens[:6].tolist() == [200, 201, 202, 203, 300, 301]


def test_position_ids_restart_per_document_and_in_padding():
    (row,) = pack_documents(docs_of_lengths(5, 3, 4), 12)
    assert row.position_ids.dtype == np.int64
    assert row.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 1, 2]


def test_labels_are_next_token_within_the_document():
    (row,) = pack_documents(docs_of_lengths(5, 3, 4), 10)
    assert row.tokens.tolist() == [100, 101, 102, 103, 200, 201, 300, 301, 302, PAD_TOKEN_ID]
    assert row.labels.tolist() == [101, 102, 103, 104, 201, 202, 301, 302, 303, PAD_TOKEN_ID]
    real = row.loss_mask > 0
    # Same hundreds digit: no label comes from another document.
    assert np.array_equal(row.tokens[real] // 100, row.labels[real] // 100)


def test_loss_mask_is_shifted_to_prediction_targets():
    # Prompt tokens 0-1 are not targets, answer tokens 2-4 are.
    (row,) = pack_documents([doc([1, 2, 3, 4, 5], mask=[0, 0, 1, 1, 1]), doc([7, 8, 9])], 8)
    # Position j predicts token j+1: positions 0..3 predict tokens 1..4 -> mask [0, 1, 1, 1].
    assert row.loss_mask.tolist() == [0, 1, 1, 1, 1, 1, 0, 0]
    assert row.loss_mask.dtype == np.float32


def test_padding_tail_is_pad_ids_without_loss():
    (row,) = pack_documents(docs_of_lengths(4), 8)
    assert row.tokens[3:].tolist() == [PAD_TOKEN_ID] * 5
    assert row.labels[3:].tolist() == [PAD_TOKEN_ID] * 5
    assert row.loss_mask[3:].tolist() == [0.0] * 5
    assert row.position_ids[3:].tolist() == [0, 1, 2, 3, 4]
    assert row.cu_seqlens.tolist() == [0, 3, 8]


def test_long_document_is_truncated_under_truncate():
    ids = np.arange(1, 16)
    stats = PackingStats()
    (row,) = pack_documents([doc(ids, mask=np.ones(15))], 10, long_document_policy="truncate",
                            stats=stats)
    assert row.tokens.tolist() == ids[:10].tolist()
    assert row.labels.tolist() == ids[1:11].tolist()
    assert row.cu_seqlens.tolist() == [0, 10]
    assert stats.truncated == 1 and stats.documents == 1
    # 15 tokens, 11 kept: 4 tokens (training positions) dropped of the document's 14.
    assert (stats.truncated_tokens, stats.tokens, stats.longest) == (4, 10, 15)
    assert stats.truncated_fraction == pytest.approx(4 / 14)
    assert stats.split == 0


@pytest.mark.parametrize("spelling", [dict(long_document_policy="reject"),
                                      dict(reject_long_documents=True)])
def test_long_document_is_rejected_under_reject(spelling):
    rows = pack_documents([doc(np.arange(1, 16), origin="train.jsonl:7")], 10, **spelling)
    with pytest.raises(ValueError, match=r"train\.jsonl:7 has 15 tokens \(14 training positions\), "
                                         r"more than --seq-length 10\. Use --long-document-policy "
                                         r"split .* or truncate, or raise --seq-length"):
        list(rows)


def test_document_of_exactly_seq_length_plus_one_tokens_is_kept_whole():
    for policy in ("truncate", "split", "reject"):
        stats = PackingStats()
        (row,) = pack_documents([doc(np.arange(1, 12))], 10, long_document_policy=policy,
                                stats=stats)
        assert row.labels[-1] == 11 and (stats.truncated, stats.split) == (0, 0)


def test_long_document_is_split_by_default_into_row_sized_pieces():
    # 26 tokens = 25 positions; rows of 10: pieces of 10, 10 and 5 positions, consecutive
    # pieces sharing one token, so every (token -> next token) prediction is kept exactly once.
    ids = np.arange(1, 27)
    mask = (np.arange(26) % 3 != 0).astype(np.float32)
    stats = PackingStats()
    rows = list(pack_documents([doc(ids, mask=mask, origin="t.jsonl:4"), doc([90, 91, 92])],
                               10, stats=stats))
    assert [r.cu_seqlens.tolist() for r in rows] == [[0, 10], [0, 10], [0, 5, 7, 10]]
    assert [r.num_documents for r in rows] == [1, 1, 2]
    tokens = np.concatenate([r.tokens[:10] for r in rows[:2]] + [rows[2].tokens[:5]])
    labels = np.concatenate([r.labels[:10] for r in rows[:2]] + [rows[2].labels[:5]])
    masks = np.concatenate([r.loss_mask[:10] for r in rows[:2]] + [rows[2].loss_mask[:5]])
    assert tokens.tolist() == ids[:-1].tolist() and labels.tolist() == ids[1:].tolist()
    assert masks.tolist() == mask[1:].tolist()  # the same targets as the whole document
    # Each piece is a document of its own: positions restart, attention stops at the cut.
    assert rows[1].position_ids[:10].tolist() == list(range(10))
    assert (stats.split, stats.pieces, stats.documents, stats.truncated) == (1, 3, 4, 0)
    assert (stats.truncated_tokens, stats.tokens, stats.longest) == (0, 27, 26)


def test_split_pieces_name_their_origin():
    from megatron.packed_training.datasets.packing import admit_document

    pieces = admit_document(doc(np.arange(1, 23), origin="d.jsonl:3"), 10, policy="split",
                            stats=PackingStats(), too_long=str)
    assert [p.origin for p in pieces] == ["d.jsonl:3 piece 1/3", "d.jsonl:3 piece 2/3",
                                          "d.jsonl:3 piece 3/3"]
    assert [p.input_ids.tolist()[0] for p in pieces] == [1, 11, 21]
    assert [len(p.input_ids) for p in pieces] == [11, 11, 2]


def test_split_pieces_are_padded_like_documents_for_context_parallelism():
    stats = PackingStats()
    rows = list(pack_documents([doc(np.arange(1, 16))], 8, stats=stats, segment_multiple=4))
    # 14 positions: pieces of 8 and 6, the second padded to 8 inside its segment.
    assert [r.cu_seqlens.tolist() for r in rows] == [[0, 8], [0, 8]]
    assert [r.cu_seqlens_actual.tolist() for r in rows] == [[0, 8], [0, 6]]
    assert (stats.tokens, stats.split) == (14, 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(long_document_policy="drop"), r"long-document policy is wrong: 'drop'.*truncate, split, reject"),
    (dict(long_document_policy="split", reject_long_documents=True),
     r"'split' together with reject_long_documents"),
])
def test_bad_long_document_policy_is_rejected_at_call_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pack_documents(docs_of_lengths(3), 10, **kwargs)


def test_truncated_fraction_check_names_both_fixes():
    from megatron.packed_training.datasets.packing import check_truncated_fraction

    stats = PackingStats()
    list(pack_documents([doc(np.arange(1, 31)), doc(np.arange(1, 11))], 10,
                        long_document_policy="truncate", stats=stats))
    # 29 + 9 positions in the data, 19 dropped: 50%.
    assert stats.truncated_fraction == pytest.approx(19 / 38)
    check_truncated_fraction(stats, 0.5, "t.jsonl")  # at the limit: allowed
    with pytest.raises(ValueError, match=r"truncation is wrong: t\.jsonl: cutting 1 long "
                                         r"documents to a row drops 19 of 38 tokens \(50\.00%\), "
                                         r"more than --max-truncated-token-fraction 0\.05\. Raise "
                                         r"--seq-length \(the longest document has 30 tokens\) or "
                                         r"use --long-document-policy split"):
        check_truncated_fraction(stats, None, "t.jsonl")  # None: the default 0.05
    check_truncated_fraction(PackingStats(), 0.0, "empty.jsonl")


def test_empty_and_one_token_documents_are_skipped_and_counted():
    stats = PackingStats()
    rows = list(pack_documents([doc([]), doc([5]), doc([1, 2, 3]), doc([9])], 4, stats=stats))
    assert len(rows) == 1
    assert rows[0].tokens.tolist() == [1, 2, 0, 0]
    assert (stats.skipped_empty, stats.documents) == (3, 1)


def test_only_empty_documents_give_no_rows():
    assert list(pack_documents([doc([]), doc([3])], 4)) == []


def test_stats_positions_add_up():
    stats = PackingStats()
    rows = list(pack_documents(docs_of_lengths(*np.random.default_rng(0).integers(2, 30, 200)), 64, stats=stats))
    assert stats.rows == len(rows)
    assert stats.tokens + stats.padding_tokens == 64 * len(rows)
    assert stats.documents == sum(r.num_documents for r in rows) == 200
    assert stats.padding_tokens == sum(int((r.loss_mask == 0).sum()) for r in rows)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_seq_length_is_rejected(bad):
    with pytest.raises(ValueError, match="--seq-length"):
        pack_documents(docs_of_lengths(3), bad)  # raises at call time, before iteration


def test_document_mask_length_mismatch_is_rejected():
    with pytest.raises(ValueError, match=r"x\.jsonl:3 has 2 mask values for 3 tokens"):
        doc([1, 2, 3], mask=[1, 1], origin="x.jsonl:3")


def test_collate_offsets_cu_seqlens_into_the_flat_stream():
    rows = list(pack_documents(docs_of_lengths(5, 3, 4, 6, 6), 10))
    assert [r.cu_seqlens.tolist() for r in rows] == [[0, 4, 6, 9, 10], [0, 5, 10]]
    batch = collate_packed_rows(rows)
    assert batch["cu_seqlens"].tolist() == [0, 4, 6, 9, 10, 15, 20]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["num_segments"] == 6 == len(batch["cu_seqlens"]) - 1
    assert batch["num_documents"] == 5
    assert batch["max_seqlen"] == 5
    for key, dtype in [("tokens", torch.int64), ("labels", torch.int64),
                       ("loss_mask", torch.float32), ("position_ids", torch.int64)]:
        assert batch[key].shape == (2, 10) and batch[key].dtype == dtype, key
    assert batch["tokens"][1].tolist() == rows[1].tokens.tolist()
    # Flattened positions restart exactly at the cu_seqlens boundaries.
    starts = batch["cu_seqlens"][:-1].long()
    assert (batch["position_ids"].reshape(-1)[starts] == 0).all()


def test_collate_single_row_keeps_its_cu_seqlens():
    (row,) = pack_documents(docs_of_lengths(5, 3), 10)
    batch = collate_packed_rows([row])
    assert batch["cu_seqlens"].tolist() == row.cu_seqlens.tolist()
    assert batch["num_segments"] == 3 and batch["num_documents"] == 2


def test_collate_rejects_mixed_lengths_and_empty():
    (short,) = pack_documents(docs_of_lengths(3), 4)
    (long,) = pack_documents(docs_of_lengths(3), 8)
    with pytest.raises(ValueError, match=r"lengths \[4, 8\] differ"):
        collate_packed_rows([short, long])
    with pytest.raises(ValueError, match="0 rows"):
        collate_packed_rows([])


def test_segment_multiple_pads_every_document_for_context_parallelism():
    # CP = 2: segments padded to multiples of 4. Positions: 4, 2 -> 4, 5 -> 8 (a new row).
    stats = PackingStats()
    rows = list(pack_documents(docs_of_lengths(5, 3, 6), 12, stats=stats, segment_multiple=4))
    assert [r.cu_seqlens.tolist() for r in rows] == [[0, 4, 8, 12], [0, 8, 12]]
    assert [r.cu_seqlens_actual.tolist() for r in rows] == [[0, 4, 6, 10], [0, 5, 9]]
    first = rows[0]
    assert first.tokens[4:8].tolist() == [200, 201, PAD_TOKEN_ID, PAD_TOKEN_ID]
    assert first.labels[4:8].tolist() == [201, 202, PAD_TOKEN_ID, PAD_TOKEN_ID]
    assert first.loss_mask[4:8].tolist() == [1, 1, 0, 0]
    assert (stats.tokens, stats.padding_tokens) == (11, 13)
    batch = collate_packed_rows(rows)
    assert batch["cu_seqlens"].tolist() == [0, 4, 8, 12, 20, 24]
    assert batch["cu_seqlens_actual"].tolist() == [0, 4, 6, 10, 15, 19]
    assert "cu_seqlens_actual" not in collate_packed_rows(list(pack_documents(docs_of_lengths(5), 12)))


def test_segment_multiple_must_divide_seq_length():
    with pytest.raises(ValueError, match="segment multiple is wrong: 8 for seq_length 12"):
        pack_documents(docs_of_lengths(5), 12, segment_multiple=8)
