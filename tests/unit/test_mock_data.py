"""Synthetic packed rows: determinism, layout invariants, variability, learnable content."""

import numpy as np
import pytest

from megatron.packed_training.datasets.mock import MockPackedDataset, draw_document_lengths

S, V = 4096, 32000


def fields(row):
    return [row.tokens, row.labels, row.loss_mask, row.position_ids, row.cu_seqlens]


def same_row(a, b):
    return a.num_documents == b.num_documents and all(np.array_equal(x, y) for x, y in zip(fields(a), fields(b)))


def test_same_seed_and_index_give_identical_rows_in_any_access_order():
    first = MockPackedDataset(50, S, V, seed=7)
    second = MockPackedDataset(50, S, V, seed=7)
    forward = [first[i] for i in range(10)]
    backward = [second[i] for i in reversed(range(10))][::-1]
    assert all(same_row(a, b) for a, b in zip(forward, backward))


def test_different_index_or_seed_gives_different_rows():
    data = MockPackedDataset(50, S, V, seed=7)
    assert not np.array_equal(data[0].tokens, data[1].tokens)
    assert not np.array_equal(data[0].tokens, MockPackedDataset(50, S, V, seed=8)[0].tokens)


def test_row_layout_invariants():
    data = MockPackedDataset(40, S, V, seed=3)
    for i in range(len(data)):
        row = data[i]
        cu = row.cu_seqlens
        lengths = np.diff(cu)
        assert cu[0] == 0 and cu[-1] == S and (lengths >= 1).all()
        assert row.num_segments in (row.num_documents, row.num_documents + 1)
        used = int(cu[row.num_documents])
        assert row.tokens.shape == row.labels.shape == row.position_ids.shape == (S,)
        assert (row.tokens[:used] >= 1).all() and (row.tokens[:used] < V).all()
        assert (row.labels[:used] >= 1).all() and (row.labels[:used] < V).all()
        assert (row.loss_mask[:used] == 1).all() and (row.loss_mask[used:] == 0).all()
        assert (row.tokens[used:] == 0).all() and (row.labels[used:] == 0).all()
        expected_positions = np.concatenate([np.arange(n) for n in lengths])
        assert np.array_equal(row.position_ids, expected_positions)


def test_tokens_follow_a_per_document_stride_walk():
    data = MockPackedDataset(20, S, V, seed=11)
    strides_seen = set()
    for i in range(len(data)):
        row = data[i]
        for d in range(row.num_documents):
            start, end = row.cu_seqlens[d], row.cu_seqlens[d + 1]
            tokens, labels = row.tokens[start:end], row.labels[start:end]
            steps = (labels - tokens) % (V - 1)
            assert len(set(steps.tolist())) == 1, "one stride per document"
            assert steps[0] in (1, 2, 3)
            strides_seen.add(int(steps[0]))
            # The label of position j is the input of position j+1 inside the document.
            assert np.array_equal(labels[:-1], tokens[1:])
    assert strides_seen == {1, 2, 3}


def test_document_lengths_match_the_row():
    data = MockPackedDataset(10, S, V, seed=5)
    for i in range(len(data)):
        lengths = data.document_lengths(i)
        row = data[i]
        assert len(lengths) == row.num_documents
        assert np.array_equal(np.diff(row.cu_seqlens)[: row.num_documents], lengths - 1)
        assert lengths.min() >= 2 and lengths.max() <= S + 1


def test_documents_per_row_vary_like_real_packing():
    data = MockPackedDataset(300, S, V, seed=1234, doc_length_median=512, doc_length_sigma=1.0)
    counts = np.array([data[i].num_documents for i in range(len(data))])
    assert len(np.unique(counts)) >= 6
    assert 3 <= np.median(counts) <= 8
    assert counts.min() >= 1


def test_drawn_lengths_are_log_normal_around_the_median():
    lengths = draw_document_lengths(np.random.default_rng(0), 20000, 512, 1.0, S)
    assert abs(np.median(lengths) - 512) < 0.03 * 512
    assert 0.9 < np.std(np.log(lengths)) < 1.1
    # Documents that made it into rows: slightly shorter (a long one is likelier not to fit).
    data = MockPackedDataset(300, S, V, seed=2)
    packed = np.concatenate([data.document_lengths(i) for i in range(len(data))])
    assert 0.75 * 512 < np.median(packed) < 1.05 * 512


def test_lengths_are_clipped_to_a_full_row():
    lengths = draw_document_lengths(np.random.default_rng(0), 1000, 5000, 2.0, 64)
    assert lengths.min() >= 2 and lengths.max() == 65
    row = MockPackedDataset(1, 64, V, seed=0, doc_length_median=5000)[0]
    assert row.num_documents == 1 and row.cu_seqlens.tolist() == [0, 64]


def test_zero_sigma_packs_a_fixed_number_of_documents():
    row = MockPackedDataset(1, 100, V, seed=0, doc_length_median=11, doc_length_sigma=0.0)[0]
    assert row.num_documents == 10 and row.cu_seqlens.tolist() == list(range(0, 101, 10))


def test_index_out_of_range_raises_index_error():
    with pytest.raises(IndexError):
        MockPackedDataset(3, S, V, seed=0)[3]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(vocab_size=1), "--vocab-size"),
        (dict(seq_length=0), "--seq-length"),
        (dict(doc_length_median=1), "--mock-doc-length-median"),
        (dict(doc_length_sigma=-0.5), "--mock-doc-length-sigma"),
        (dict(seed=-1), "--seed"),
        (dict(num_samples=-1), "num_samples is wrong"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, message):
    arguments = dict(num_samples=4, seq_length=S, vocab_size=V, seed=0) | kwargs
    with pytest.raises(ValueError, match=message):
        MockPackedDataset(**arguments)


def test_segment_multiple_pads_every_document_for_context_parallelism():
    """CP layout: every segment a multiple of 2 * cp, the same documents' tokens at the front
    of their segments, pad positions (id 0, loss mask 0) after them."""
    import numpy as np

    from megatron.packed_training.datasets.mock import MockPackedDataset

    plain = MockPackedDataset(8, 1024, 1000, seed=3, doc_length_median=100)
    padded = MockPackedDataset(8, 1024, 1000, seed=3, doc_length_median=100, segment_multiple=4)
    for i in range(8):
        row, ref = padded[i], plain[i]
        assert (np.diff(row.cu_seqlens) % 4 == 0).all() and row.cu_seqlens[-1] == 1024
        actual = np.diff(row.cu_seqlens_actual)
        starts = row.cu_seqlens[:-1]
        for d in range(row.num_documents):
            n = actual[d]
            seg = slice(starts[d], starts[d] + n)
            ref_seg = slice(ref.cu_seqlens[d], ref.cu_seqlens[d] + n)
            assert (row.tokens[seg] == ref.tokens[ref_seg]).all()
            assert (row.loss_mask[seg] == 1).all()
            gap = slice(starts[d] + n, row.cu_seqlens[d + 1])
            assert (row.tokens[gap] == 0).all() and (row.loss_mask[gap] == 0).all()
        assert row.num_documents <= ref.num_documents


def test_long_draws_give_the_same_rows_under_split_and_truncate():
    """A drawn document longer than a row enters as its first seq_length + 1 tokens under both
    (a mock row never continues into the next), so the rows, and golden values recorded on
    them, do not depend on the policy."""
    split = MockPackedDataset(40, 256, V, seed=4, doc_length_median=200, doc_length_sigma=1.0)
    truncate = MockPackedDataset(40, 256, V, seed=4, doc_length_median=200,
                                 doc_length_sigma=1.0, long_document_policy="truncate")
    assert split.long_document_policy == "split"
    assert all(same_row(split[i], truncate[i]) for i in range(40))
    assert split.packing_stats().split > 0 and truncate.packing_stats().truncated > 0


def test_reject_policy_names_the_mock_row_and_the_fixes():
    data = MockPackedDataset(1, 64, V, seed=0, doc_length_median=5000, long_document_policy="reject")
    with pytest.raises(ValueError, match=r"document length is wrong: mock row 0 drew a document of "
                                         r"\d+ tokens \(\d+ training positions\), more than "
                                         r"--seq-length 64\. Use --long-document-policy split or "
                                         r"truncate, or lower --mock-doc-length-median"):
        data[0]
    # Short documents only: nothing to reject.
    assert MockPackedDataset(1, 100, V, seed=0, doc_length_median=11, doc_length_sigma=0.0,
                             long_document_policy="reject")[0].num_documents == 10


def test_packing_stats_count_the_rows_as_built():
    data = MockPackedDataset(30, 256, V, seed=2, doc_length_median=200, doc_length_sigma=1.0,
                             long_document_policy="truncate")
    stats = data.packing_stats()
    rows = [data[i] for i in range(30)]
    assert stats.rows == 30 and stats.documents == sum(r.num_documents for r in rows)
    assert stats.tokens == sum(int(r.loss_mask.sum()) for r in rows)
    assert stats.tokens + stats.padding_tokens == 30 * 256
    assert stats.truncated > 0 and stats.truncated_tokens > 0 and stats.longest > 257
    assert data.packing_stats(5).rows == 5


def test_bad_long_document_policy_is_rejected():
    with pytest.raises(ValueError, match="long-document policy is wrong: 'clip'"):
        MockPackedDataset(4, S, V, seed=0, long_document_policy="clip")
