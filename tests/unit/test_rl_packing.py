"""`pack_sequences` on the data path's packer, and `deal_micro_batches`: host bookkeeping of
the RL library's micro-batches (the training it feeds: test_rl_library.py)."""

import pytest
import torch

from megatron.packed_training.rl import PackedSequences, deal_micro_batches, pack_sequences
from megatron.packed_training.rl.batches import lay_out
from tests.unit.scripts import load_script


def grpo_rollouts(prompts: int) -> dict:
    """The GRPO example's synthetic rollouts (its length distribution)."""
    return load_script("examples", "rl", "grpo_packed.py").make_rollouts(0, prompts, 4, 1024)


def fill(micro_batches, row_positions) -> float:
    used = sum(sum(max(n - 1, 0) for n in mb.lengths) for mb in micro_batches)
    return used / (len(micro_batches) * row_positions)


def test_best_fit_fills_97_percent_on_the_grpo_examples_lengths_and_in_order_does_not():
    rollouts = grpo_rollouts(prompts=250)  # 1000 sequences
    best = pack_sequences(rollouts["tokens"], 1024, loss_weights=rollouts["masks"])
    in_order = pack_sequences(rollouts["tokens"], 1024, algorithm="in-order")
    assert fill(best, 1024) >= 0.97 > fill(in_order, 1024)


def test_every_sequence_lands_once_and_the_order_maps_results_back():
    rollouts = grpo_rollouts(prompts=20)
    tokens, masks = rollouts["tokens"], rollouts["masks"]
    advantages = [torch.full((len(t),), float(i)) for i, t in enumerate(tokens)]
    packed = pack_sequences(tokens, 512, loss_weights=masks, tensors={"advantages": advantages},
                            seed=3)
    order = [i for mb in packed for i in mb.indices]
    assert sorted(order) == list(range(len(tokens))) and order != sorted(order)
    for mb in packed:
        assert torch.equal(mb.tokens, torch.cat([tokens[i] for i in mb.indices]))
        assert torch.equal(mb.loss_weights, torch.cat([masks[i] for i in mb.indices]))
        assert torch.equal(mb.tensors["advantages"],
                           torch.cat([advantages[i] for i in mb.indices]))
        assert sum(max(n - 1, 0) for n in mb.lengths) <= 512
    again = pack_sequences(tokens, 512, seed=3)
    assert [mb.indices for mb in again] == [mb.indices for mb in packed]


def test_max_sequences_keeps_micro_batches_within_a_graph_capacity():
    tokens = [torch.arange(1, 4)] * 100  # 2 positions each: 50 fit a row of 100
    packed = pack_sequences(tokens, 100, max_sequences=15)
    assert max(len(mb.lengths) for mb in packed) == 15


def test_a_sequence_longer_than_a_row_is_named():
    with pytest.raises(ValueError, match=r"sequence 1 is wrong: 40 tokens, more than a packed "
                                         r"row's 32 positions \+ 1"):
        pack_sequences([torch.arange(5), torch.arange(40)], 32)


def test_dealt_ranks_run_as_many_micro_batches_with_near_equal_tokens():
    rollouts = grpo_rollouts(prompts=30)
    packed = pack_sequences(rollouts["tokens"], 512, loss_weights=rollouts["masks"],
                            tensors={"advantages": rollouts["masks"]}, algorithm="in-order")
    ranks = deal_micro_batches(packed, 4)
    assert len({len(taken) for taken in ranks}) == 1
    totals = [sum(mb.tokens.numel() for mb in taken) for taken in ranks]
    assert max(totals) / (sum(totals) / 4) < 1.1
    assert sorted(id(mb) for taken in ranks for mb in taken if mb.lengths) == sorted(
        id(mb) for mb in packed)
    uneven = deal_micro_batches(packed[:5], 4)  # 5 micro-batches: three ranks get an empty
    empties = [mb for taken in uneven for mb in taken if not mb.lengths]
    assert len(empties) == 3 and all(sorted(mb.tensors) == ["advantages"] for mb in empties)


def test_an_empty_micro_batch_lays_out_as_a_row_of_padding_that_weighs_nothing():
    batch = lay_out(PackedSequences.empty(["advantages"]), 0, row_positions=8,
                    names=["advantages"])
    assert batch["tokens"].tolist() == [[0] * 8] and batch["loss_mask"].sum() == 0
    assert batch["cu_seqlens"].tolist() == [0, 8] and batch["num_documents"] == 0
    assert batch["num_segments"] == 1 and batch["padding_mask"].all()
    assert batch["loss_tensors"]["advantages"].sum() == 0
