import torch

from megatron.packed_graphs.packed_seq import PackedBatchParams, build_packed_batch_params, build_seq_idx


def test_seq_idx_marks_documents_and_skips_empty_segments():
    cu = torch.tensor([0, 3, 3, 5, 6, 6, 6], dtype=torch.int32)  # zero-length segments inside and at the end
    seq_idx = build_seq_idx(cu, 6)
    assert seq_idx.shape == (1, 6) and seq_idx.dtype == torch.int32
    assert seq_idx.tolist() == [[0, 0, 0, 2, 2, 3]]


def test_params_carry_thd_metadata_without_tensor_work_in_post_init():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    pos = torch.tensor([[0, 1, 0, 1, 2]])
    params = build_packed_batch_params(cu, pos, max_seqlen=5)
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 5
    assert params.cu_seqlens_q is cu and params.cu_seqlens_kv is cu
    assert params.position_ids.shape == (5,)
    assert params.seq_idx.tolist() == [[0, 0, 1, 1, 1]]
    # megatron-core's graph tree_map rebuilds dataclasses with replace(): no __post_init__ work.
    assert "__post_init__" not in PackedBatchParams.__dict__
    assert build_packed_batch_params(cu, pos, 5, with_seq_idx=False).seq_idx is None
