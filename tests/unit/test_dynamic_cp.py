"""The host side of dynamic context parallelism: a CP size per packed micro-batch."""

import pytest

from megatron.packed_model.dynamic_cp import (
    check_cp_sizes,
    cp_padded_length,
    fits,
    pack_for_dynamic_cp,
    schedule_cp_rounds,
    turns_of_rank,
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


def _check_rounds(rounds, sizes, num_ranks):
    placed = sorted(turn.micro_batch for turns in rounds for turn in turns)
    assert placed == list(range(len(sizes)))  # every micro-batch exactly once
    for turns in rounds:
        used = [rank for turn in turns for rank in turn.ranks()]
        assert len(used) == len(set(used)) and max(used) < num_ranks  # disjoint, in range
        for turn in turns:
            assert turn.cp_size == sizes[turn.micro_batch] and turn.first_rank % turn.cp_size == 0


def test_rounds_place_every_micro_batch_on_disjoint_aligned_blocks():
    sizes = [1, 4, 2, 1, 1, 2, 1]
    rounds = schedule_cp_rounds(sizes, 4)
    _check_rounds(rounds, sizes, 4)
    assert len(rounds) == 3  # 4 + 2x2 + 4x1 rank-turns fill three rounds of four ranks
    assert [turn.micro_batch for turn in turns_of_rank(rounds, 3)] == [1, 5, 6]


@pytest.mark.parametrize("seed", range(20))
def test_rounds_are_tight_for_random_power_of_two_mixes(seed):
    import random

    rng = random.Random(seed)
    num_ranks = rng.choice([1, 2, 4, 8])
    sizes = [rng.choice([c for c in (1, 2, 4, 8) if c <= num_ranks])
             for _ in range(rng.randint(1, 24))]
    rounds = schedule_cp_rounds(sizes, num_ranks)
    _check_rounds(rounds, sizes, num_ranks)
    # Buddy placement of powers of two wastes nothing but the last round's tail.
    assert len(rounds) == -(-sum(sizes) // num_ranks)


def test_group_members_see_their_shared_turns_in_the_same_order():
    rounds = schedule_cp_rounds([2, 1, 2, 2, 1, 1, 4], 4)
    for rank in range(4):
        for partner in range(4):
            mine = [t for t in turns_of_rank(rounds, rank) if partner in t.ranks()]
            theirs = [t for t in turns_of_rank(rounds, partner) if rank in t.ranks()]
            assert mine == theirs


@pytest.mark.parametrize("sizes,num_ranks,message", [
    ([1, 2], 3, "rank count is wrong: 3"),
    ([3], 4, "CP size is wrong: 3"),
    ([8], 4, "CP size is wrong: 8"),
])
def test_rounds_refuse_bad_sizes(sizes, num_ranks, message):
    with pytest.raises(ValueError, match=message):
        schedule_cp_rounds(sizes, num_ranks)


def test_micro_batch_cp_group_reads_the_params(cpu_dist):
    import torch

    from megatron.packed_model.dynamic_cp import micro_batch_cp_group
    from megatron.packed_graphs.packed_seq import PackedBatchParams

    group = torch.distributed.new_group([0])
    assert micro_batch_cp_group(None) is None
    assert micro_batch_cp_group(PackedBatchParams(qkv_format="thd")) is None
    assert micro_batch_cp_group(PackedBatchParams(qkv_format="thd", local_cp_size=1)) is None
    assert micro_batch_cp_group(PackedBatchParams(qkv_format="thd", cp_group=group,
                                                  local_cp_size=1)) is group
    with pytest.raises(ValueError, match="local_cp_size is 2 but cp_group is None"):
        micro_batch_cp_group(PackedBatchParams(qkv_format="thd", local_cp_size=2))
