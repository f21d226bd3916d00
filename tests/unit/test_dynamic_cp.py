"""The host side of dynamic context parallelism: a CP size per packed micro-batch."""

import pytest

from megatron.packed_graphs.dynamic_cp import (
    check_cp_sizes,
    cp_padded_length,
    fits,
    pack_for_dynamic_cp,
)


def test_cp_sizes_are_ascending_powers_of_two_within_the_ranks():
    assert check_cp_sizes([1, 2, 4], max_cp_size=4) == (1, 2, 4)
    for sizes in ([], [3], [2, 1], [1, 1, 2], [0, 2]):
        with pytest.raises(ValueError, match="Give powers of two in ascending order"):
            check_cp_sizes(sizes, max_cp_size=8)
    with pytest.raises(ValueError, match="8 exceeds the 4 ranks"):
        check_cp_sizes([1, 8], max_cp_size=4)


def test_padding_follows_the_thd_cp_layout():
    assert [cp_padded_length(n, 2) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert fits([5, 3], 2, 6) and not fits([5, 5], 2, 6)  # 8 + 4 <= 12; 8 + 8 > 12


def test_each_micro_batch_gets_the_smallest_cp_size_its_first_document_needs():
    # N = 16 positions per rank; sizes 1, 2, 4 hold 16, 32, 64 positions.
    batches = pack_for_dynamic_cp([10, 5, 40, 3, 2, 9, 30], (1, 2, 4), tokens_per_rank=16)
    assert [(b.documents, b.cp_size) for b in batches] == [
        ((0, 1), 1),        # 10 + 5 <= 16
        ((2, 3, 4), 4),     # 40 needs CP 4 (pads to 40 <= 64); 3 and 2 pad to 8 each: 56
        ((5,), 1),          # 9 + 30 does not fit CP 1; 9 opens a new micro-batch
        ((6,), 2),          # 30 needs CP 2 (pads to 32 <= 32)
    ]
    for b in batches:
        assert fits(b.lengths, b.cp_size, 16)
    assert sum(len(b.documents) for b in batches) == 7


def test_too_long_documents_and_bad_tokens_per_rank_are_refused():
    with pytest.raises(ValueError, match="document 1 has 70 positions, more than CP size 4 x 16"):
        pack_for_dynamic_cp([3, 70], (1, 2, 4), tokens_per_rank=16)
    with pytest.raises(ValueError, match="tokens per rank are wrong: 12"):
        pack_for_dynamic_cp([3], (1, 2, 4), tokens_per_rank=12)
