import pytest
import torch

from megatron.packed_graphs.capacity import fits_capacity, pad_cu_seqlens


def test_pad_repeats_last_offset_to_capacity_plus_one():
    cu = torch.tensor([0, 3, 7, 10], dtype=torch.int32)
    padded = pad_cu_seqlens(cu, 6)
    assert padded.tolist() == [0, 3, 7, 10, 10, 10, 10]
    assert padded.dtype == torch.int32
    assert pad_cu_seqlens(cu, 3).tolist() == cu.tolist()  # exact fit


def test_overflow_is_refused_with_the_flag_name():
    cu = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"4 packed segments.*capacity 3.*--cuda-graph-max-packed-seqs"):
        pad_cu_seqlens(cu, 3)
    assert fits_capacity(3, 3) and not fits_capacity(4, 3) and not fits_capacity(0, 3)
