import torch

from megatron.packed_training.datasets.packing import Document, collate_packed_rows
from megatron.packed_training.datasets.row_plan import pack_documents
from megatron.packed_training.packed_step import masked_lm_loss, to_device_micro_batch


def _batch():
    docs = [Document(torch.arange(1, n + 1).numpy(), None, f"doc{n}") for n in (5, 3, 7, 4)]
    rows = list(pack_documents(docs, seq_length=8))
    return collate_packed_rows(rows[:2])


def test_micro_batch_is_one_thd_stream_with_host_side_metadata():
    batch = _batch()
    mb = to_device_micro_batch(batch, with_seq_idx=True, static_max_seqlen=False,
                               device=torch.device("cpu"))
    assert mb.tokens.shape == (1, 16) and mb.position_ids.shape == (1, 16)
    assert mb.params.cu_seqlens_q.tolist() == batch["cu_seqlens"].tolist()
    cu = batch["cu_seqlens"]
    assert mb.params.max_seqlen_q == int((cu[1:] - cu[:-1]).max()) == 6  # 7-token document
    assert mb.params.seq_idx.shape == (1, 16)
    assert mb.num_segments == len(batch["cu_seqlens"]) - 1
    static = to_device_micro_batch(batch, with_seq_idx=False, static_max_seqlen=True,
                                   device=torch.device("cpu"))
    assert static.params.max_seqlen_q == 16 and static.params.seq_idx is None


def test_masked_loss_sums_masked_tokens_and_counts_them():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    loss, num_tokens, report = masked_lm_loss(mask, per_token)
    assert loss.item() == 4.0 and num_tokens.item() == 2
    assert report["lm loss"].tolist() == [4.0, 2.0]


def test_cp_rank_keeps_its_share_and_mamba_sees_the_whole_stream():
    docs = [Document(torch.arange(1, n + 1).numpy(), None, f"doc{n}") for n in (6, 3)]
    batch = collate_packed_rows(list(pack_documents(docs, seq_length=16, segment_multiple=4)))
    mb = to_device_micro_batch(batch, with_seq_idx=True, static_max_seqlen=True, capacity=6,
                               device=torch.device("cpu"), cp_size=2, cp_rank=1)
    assert mb.tokens.shape == (1, 8)  # this rank's half of the 16 positions
    assert mb.params.cu_seqlens_q_padded is mb.params.cu_seqlens_q
    # seq_idx indexes the whole 16-position stream: Mamba's all-to-all gathers it.
    assert mb.params.seq_idx.tolist() == [[0] * 8 + [1] * 4 + [2] * 4]
