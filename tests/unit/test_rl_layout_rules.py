"""The library API's pipeline and context parallel layouts (megatron.packed_training.rl.layouts)
on CPU: which layouts `check_library_layout` takes, rows laid out with each sequence padded
for CP, the interleaved schedule's micro-batch count, and, in gloo worlds of two processes
with megatron-core's parallel state at CP = 2 or PP = 2: the CP shares gathered back in row
order, results broadcast from the last pipeline stage, a train step's sums and metric
names on every stage, the policy step's staging of each CP rank's share, and
sequence-level normalization over the CP group against one process holding the whole row.
The CUDA runs: tests/gpu/test_rl_layouts.py.
"""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.packed_model.context_parallel import thd_partition_index
from megatron.packed_training.rl import LossInputs, PackedSequences, pack_sequences
from megatron.packed_training.rl.batches import SEQUENCE_IDS, lay_out
from megatron.packed_training.rl.layouts import (
    Layout,
    cp_share,
    gather_cp_rows,
    schedule_count,
    sequence_count,
    step_totals,
)
from megatron.packed_training.rl.policy import check_library_layout
from megatron.packed_training.rl.steps import METRIC_NAMES, PolicyLossStep, per_sequence_means

ROW, VOCAB = 32, 64
LENGTHS = [(5, 2, 9), (3, 3, 3, 3), (13,), (1, 6)]  # 1: a one-token sequence (no position)


def sequences(lengths, seed=0, **tensors):
    generator = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return PackedSequences(torch.randint(1, VOCAB, (n,), generator=generator),
                           lengths=list(lengths),
                           loss_weights=(torch.rand(n, generator=generator) > 0.2).float(),
                           tensors={name: make(n, generator) for name, make in tensors.items()})


def laid_out(multiple, **tensors):
    return [lay_out(sequences(lengths, seed=i, **tensors), i, ROW, sorted(tensors), multiple)
            for i, lengths in enumerate(LENGTHS)]


# -- host rules ----------------------------------------------------------------------------------

def test_the_library_takes_pipeline_and_static_context_parallelism():
    ok = SimpleNamespace(pipeline_model_parallel_size=2, context_parallel_size=2,
                         micro_batch_size=1, seq_length=1024, dynamic_cp_sizes=None,
                         calculate_per_token_loss=True)
    check_library_layout(ok)
    check_library_layout(SimpleNamespace(**(vars(ok) | {"context_parallel_size": 1,
                                                        "seq_length": 1022})))
    with pytest.raises(ValueError, match=r"dynamic_cp_sizes is wrong for the library API: "
                                         r"\[1, 2\]\. Leave it unset; a static"):
        check_library_layout(SimpleNamespace(**(vars(ok) | {"dynamic_cp_sizes": [1, 2]})))
    with pytest.raises(ValueError, match=r"context_parallel_size is wrong for the library API: "
                                         r"4 with a packed row of 1020 positions .* Set "
                                         r"seq_length to a multiple of 8\."):
        check_library_layout(SimpleNamespace(**(vars(ok) | {"context_parallel_size": 4,
                                                            "seq_length": 1020})))
    with pytest.raises(ValueError, match=r"calculate_per_token_loss is wrong for "
                                         r"context_parallel_size 2: False\. Leave it unset"):
        check_library_layout(SimpleNamespace(**(vars(ok) | {"calculate_per_token_loss": False})))


def test_cp_padding_pads_each_sequence_and_maps_positions_back_to_tokens():
    mb = sequences((5, 2, 9, 1, 6), advantages=lambda n, g: torch.randn(n, generator=g))
    plain, padded = lay_out(mb, 0, ROW), lay_out(mb, 0, ROW, ["advantages"], 4)
    # 4, 1, 8, 5 positions -> segments 4, 4, 8, 8 and the row's padding tail.
    assert padded["cu_seqlens"].tolist() == [0, 4, 8, 16, 24, 32]
    assert padded["num_documents"] == 4 and padded["num_segments"] == 5
    assert np.diff(padded["cu_seqlens"].numpy()).tolist() == [4, 4, 8, 8, 8]
    used = padded["layout"].positions
    assert used.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    # The used positions hold what the unpadded row holds, in order; the rest is padding.
    for key in ("tokens", "labels", "loss_mask"):
        assert torch.equal(padded[key][0, used], plain[key][0, :18]), key
    for name in ("advantages", SEQUENCE_IDS):
        assert torch.equal(padded["loss_tensors"][name][0, used],
                           plain["loss_tensors"][name][0, :18]), name
    pad = torch.ones(ROW, dtype=torch.bool)
    pad[used] = False
    assert torch.equal(padded["padding_mask"][0], pad)
    assert (padded["loss_mask"][0, pad] == 0).all()
    assert (padded["loss_tensors"][SEQUENCE_IDS][0, pad] == -1).all()
    assert padded["position_ids"][0, :8].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # Back to tokens: each position's label is the token it predicts; first tokens get 0.
    tokens = padded["layout"].to_tokens(padded["labels"][0])
    first = torch.tensor([0, 5, 7, 16, 17])
    expected = mb.tokens.clone()
    expected[first] = 0
    assert torch.equal(tokens, expected)
    assert torch.equal(tokens, plain["layout"].to_tokens(plain["labels"][0]))


def test_a_micro_batch_too_long_once_padded_names_the_padding():
    with pytest.raises(ValueError, match=r"micro-batch 0 is wrong: its sequences hold 40 "
                                         r"training positions \(tokens minus one per sequence; "
                                         r"28 before each sequence is padded to a multiple of "
                                         r"4, 2 x the context parallel size\), more than a "
                                         r"packed row's 32"):
        lay_out(sequences((10, 10, 10, 2)), 0, ROW, None, 4)


def test_pack_sequences_packs_for_the_policys_segment_multiple():
    generator = torch.Generator().manual_seed(3)
    tokens = [torch.randint(1, VOCAB, (int(n),), generator=generator)
              for n in torch.randint(2, 14, (24,), generator=generator)]
    packed = pack_sequences(tokens, ROW, segment_multiple=4)
    assert sorted(i for mb in packed for i in mb.indices) == list(range(24))
    for index, mb in enumerate(packed):
        lay_out(mb, index, ROW, None, 4)  # fits its row once padded


@pytest.mark.parametrize("count, pipeline, chunks, group, runs", [
    (3, 2, 1, 2, 3),  # no virtual stages: as given
    (1, 2, 2, 2, 2), (3, 2, 2, 2, 4), (4, 2, 2, 2, 4),
    (5, 2, 2, 4, 6),  # a last group of 1 < PP: one more
    (4, 4, 2, 4, 4), (5, 4, 2, 4, 8), (1, 2, 2, 3, 3),
])
def test_virtual_stages_run_a_micro_batch_count_the_interleaved_schedule_takes(
        count, pipeline, chunks, group, runs):
    assert schedule_count(count, pipeline, chunks, group) == runs


# -- two processes -------------------------------------------------------------------------------

def _in_world(rank: int, world: int, store: str, case: str) -> None:
    """One rank of a gloo world of ``world`` processes running ``case``."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                         world_size=world)
    from megatron.core import parallel_state

    try:
        CASES[case](rank, parallel_state)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _run(tmp_path, case: str, world: int = 2) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_in_world, nprocs=world, args=(world, str(tmp_path / "store"), case))


def _cp_gather(rank, parallel_state):
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    layout = Layout.current([torch.nn.Linear(1, 1)], torch.device("cpu"))
    assert (layout.cp_size, layout.pipeline_size, layout.segment_multiple) == (2, 1, 4)
    batches = laid_out(4)
    rows = torch.stack([torch.randn(ROW, generator=torch.Generator().manual_seed(i))
                        for i in range(len(batches))])
    # Each rank's share by the index the model's staging uses, gathered and put back.
    shares = [thd_partition_index(b["cu_seqlens"], ROW, 2, rank) for b in batches]
    assert all(torch.equal(cp_share(row, b["cu_seqlens"], 2, rank)[0], row[index])
               for row, b, index in zip(rows, batches, shares))
    whole = layout.rows([row[index] for row, index in zip(rows, shares)], batches, ROW)
    assert torch.equal(whole, rows)
    # The function itself, on a group given explicitly, with capacity-padded boundaries.
    bounds = [torch.cat([b["cu_seqlens"], b["cu_seqlens"][-1:].repeat(3)]) for b in batches]
    local = torch.stack([row[thd_partition_index(c, ROW, 2, rank)] for row, c in zip(rows, bounds)])
    assert torch.equal(gather_cp_rows(local, bounds, ROW, layout.cp_group), rows)


def _pp_broadcast(rank, parallel_state):
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    layout = Layout.current([torch.nn.Linear(1, 1)], torch.device("cpu"))
    assert (layout.pipeline_size, layout.last_stage, layout.pipeline_last_rank) == (
        2, rank == 1, 1)
    batches = laid_out(1)
    rows = torch.randn(len(batches), ROW, generator=torch.Generator().manual_seed(5))
    shares = list(rows) if layout.last_stage else []  # the schedule's reports: last stage
    assert torch.equal(layout.rows(shares, batches, ROW), rows)
    # A train step's sums and metric names: on the last stage only, then on both.
    reports = [{"loss": torch.tensor([1.5 * k, 3.0, k, 2.0]), METRIC_NAMES: ["clip", "kl"]}
               for k in range(3)]
    total, names = step_totals(reports if layout.last_stage else [], layout, None, METRIC_NAMES)
    assert names == ["clip", "kl"] and total.tolist() == [4.5, 9.0, 3.0, 6.0]
    total, names = step_totals(reports[:1] if layout.last_stage else [], layout, names,
                               METRIC_NAMES)  # names known: one tensor broadcast
    assert names == ["clip", "kl"] and total.tolist() == [0.0, 3.0, 0.0, 2.0]
    if layout.last_stage:
        with pytest.raises(ValueError, match=r"loss_fn's metrics are wrong: \['kl'\], earlier "
                                             r"steps of this loss gave \['clip', 'kl'\]"):
            step_totals([{"loss": torch.zeros(3), METRIC_NAMES: ["kl"]}], layout, names,
                        METRIC_NAMES)


def _cp_train_step(rank, parallel_state):
    """A PolicyLossStep at CP 2 stages this rank's share of every row tensor (loss tensors
    as the labels), and its loss, sequence count and gradients add up over the two ranks
    to one process's on the whole row."""
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()

    def loss_fn(inputs: LossInputs):
        per_token = -inputs.logprobs * inputs["advantages"]
        return per_sequence_means(per_token, inputs).sum(), {
            "weighted": (inputs.weights * inputs["advantages"]).sum()}

    options = {"with_seq_idx": False, "static_max_seqlen": True, "device": torch.device("cpu")}
    whole_step = PolicyLossStep(loss_fn, "sequence", **options)  # CP 1: the whole row
    cp_step = PolicyLossStep(loss_fn, "sequence", cp_size=2, **options)
    for batch in laid_out(4, advantages=lambda n, g: torch.randn(n, generator=g)):
        logprobs = torch.randn(ROW, generator=torch.Generator().manual_seed(9)) - 2.0
        # One process: the whole row (no parallel state needed but its CP size).
        whole = whole_step.stage(batch, None)
        full = logprobs.clone().requires_grad_()
        loss, count, report = whole_step.loss(whole, full.view(1, -1))
        loss.backward()
        # This rank's share.
        staged = cp_step.stage(batch, None)
        index = thd_partition_index(batch["cu_seqlens"], ROW, 2, rank)
        assert torch.equal(staged.labels[0], batch["labels"][0, index])
        for name in ("advantages", SEQUENCE_IDS):
            assert torch.equal(staged.loss_tensors[name][0],
                               batch["loss_tensors"][name][0, index]), name
        share = logprobs[index].clone().requires_grad_()
        cp_loss, cp_count, cp_report = cp_step.loss(staged, share.view(1, -1))
        cp_loss.backward()  # both ranks: the backward all-reduces the sums' gradient
        summed = torch.stack([cp_loss.detach(), cp_count.float(), cp_report["loss"][2]])
        torch.distributed.all_reduce(summed, group=group)
        assert torch.allclose(summed[0], loss.detach(), atol=1e-5), (summed, loss)
        assert summed[1] == count, (summed, count)
        assert torch.allclose(summed[2], report["loss"][2], atol=1e-5)
        assert torch.allclose(share.grad, full.grad[index], atol=1e-6)
        # The count alone, with weight on rank 0's share only: a sequence counts once.
        first = thd_partition_index(batch["cu_seqlens"], ROW, 2, 0)
        weights = torch.zeros(ROW)
        weights[first] = batch["loss_mask"][0, first]
        ids = batch["loss_tensors"][SEQUENCE_IDS][0]
        mine = sequence_count(weights[index], ids[index], group)
        torch.distributed.all_reduce(mine, group=group)
        assert int(mine) == len(set(ids[weights > 0].tolist()))

CASES = {"cp_gather": _cp_gather, "pp_broadcast": _pp_broadcast,
         "cp_train_step": _cp_train_step}


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_processes(tmp_path, case):
    _run(tmp_path, case)
