"""Which positions of a packed stream each context-parallel rank keeps."""

import pytest
import torch

from megatron.packed_model.context_parallel import select_cp_tokens, thd_partition_index


def reference_index(segment_lengths, cp, rank):
    """Straight from the layout's definition: chunks r and 2cp-1-r of every segment."""
    kept, start = [], 0
    for length in segment_lengths:
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            kept += range(start + c * chunk, start + (c + 1) * chunk)
        start += length
    return kept


def cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_partition_matches_the_layout_and_covers_the_stream_once(cp):
    generator = torch.Generator().manual_seed(cp)
    units = torch.randint(1, 6, (7,), generator=generator).tolist()
    lengths = [2 * cp * u for u in units]
    lengths += [0, 0]  # capacity padding: empty segments at the end
    lengths.insert(3, 0)  # and an empty one in the middle
    total = sum(lengths)
    seen = []
    for rank in range(cp):
        index = thd_partition_index(cu(lengths), total, cp, rank)
        assert index.dtype == torch.int64 and index.shape == (total // cp,)
        assert index.tolist() == reference_index(lengths, cp, rank)
        seen += index.tolist()
    assert sorted(seen) == list(range(total))


def test_bad_cp_arguments_are_refused():
    with pytest.raises(ValueError, match="cp rank is wrong: rank 2 of context-parallel size 2"):
        thd_partition_index(cu([8]), 8, 2, 2)
    with pytest.raises(ValueError, match="total tokens are wrong: 6 is not a multiple of 2 \\* cp = 4"):
        thd_partition_index(cu([6]), 6, 2, 0)


def test_select_cp_tokens_gathers_the_stream_of_a_micro_batch():
    batch = {"tokens": torch.arange(16).reshape(2, 8), "labels": torch.arange(16).reshape(2, 8) + 1,
             "loss_mask": torch.ones(2, 8), "position_ids": torch.arange(8).repeat(2, 1),
             "num_documents": 3}
    index = thd_partition_index(cu([4, 4, 8]), 16, 2, 1)
    local = select_cp_tokens(batch, index)
    assert local["tokens"].tolist() == [[1, 2, 5, 6, 10, 11, 12, 13]]
    assert local["labels"].tolist() == [[2, 3, 6, 7, 11, 12, 13, 14]]
    assert local["position_ids"].shape == (1, 8) and local["num_documents"] == 3
