"""The log-prob head's outputs on CPU (megatron/packed_training/rl/steps.py, docs/rl.md
"logprobs"): `chunked_head` against torch's log_softmax, entropy and topk on the full
vocabulary, over one chunk (bitwise megatron-core's cross entropy) and several, in one process
and vocabulary-sharded over two gloo ranks; the option checks; and `PackedPolicy.logprobs`
with entropy and top-k through the graph runtime (forward-only graphs replayed by
conftest.replaying_capture). The CUDA runs: tests/gpu/test_rl_logprob_outputs.py.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from megatron.packed_training.rl.policy import LogProbOutputs, rows_to_tokens
from megatron.packed_training.rl.steps import (
    HEAD_FIELDS,
    MAX_TOP_K,
    HeadOutputs,
    LogProbStep,
    check_head_options,
    chunked_head,
    token_logprobs,
)
from tests.unit.test_rl_library import (  # noqa: F401  (no_rng_tracker: an autouse fixture)
    VOCAB,
    direct_logprobs,
    make_policy,
    no_rng_tracker,
    rollouts,
)

POSITIONS, WIDE = 24, 128  # the head's own tests: a vocabulary of 128, two shards of 64


def full_vocabulary(seed=0, dtype=torch.float32):
    """Logits ``[1, POSITIONS, WIDE]`` and labels ``[1, POSITIONS]`` (every label id range)."""
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(1, POSITIONS, WIDE, generator=generator)).to(dtype)
    labels = torch.randint(0, WIDE, (1, POSITIONS), generator=generator)
    return logits, labels


def reference(logits, labels, temperature=1.0, top_k=0):
    """torch on the whole vocabulary: log-probs, entropy, top-k log-probs and ids."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    top = log_p.topk(max(top_k, 1), dim=-1)
    return HeadOutputs(log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy,
                       top.values, top.indices)


def assert_matches(got: HeadOutputs, want: HeadOutputs, top_k: int):
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=2e-5)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=2e-5)
    assert got.topk_ids.shape == got.topk_logprobs.shape == (1, POSITIONS, top_k)
    assert got.topk_ids.dtype == torch.int64 and got.topk_logprobs.dtype == torch.float32
    torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs[..., :top_k], rtol=0,
                               atol=2e-5)
    assert torch.equal(got.topk_ids, want.topk_ids[..., :top_k])  # float logits: no ties


# -- the head in one process --------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [7, 32, WIDE, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_chunked_head_is_log_softmax_entropy_and_topk_of_the_whole_vocabulary(
        chunk, temperature):
    logits, labels = full_vocabulary()
    before = logits.clone()
    for top_k in (1, 5, MAX_TOP_K):
        got = chunked_head(logits, labels, torch.tensor([1 / temperature]), entropy=True,
                           top_k=top_k, chunk=chunk)
        assert_matches(got, reference(logits, labels, temperature, top_k), top_k)
        # The top log-prob is the same expression as a label's: the argmax label's, bitwise.
        argmax = got.topk_ids[..., 0]
        again = chunked_head(logits, argmax, torch.tensor([1 / temperature]), chunk=chunk)
        assert torch.equal(again.logprobs, got.topk_logprobs[..., 0])
    assert torch.equal(logits, before)  # the logits are read, never written


def test_one_chunk_is_bitwise_megatron_cores_cross_entropy_and_several_are_within_rounding(
        cpu_dist):
    logits, labels = full_vocabulary(seed=1, dtype=torch.bfloat16)
    inv = torch.tensor([1 / 0.9])
    before = token_logprobs(logits, labels, inv)
    one = chunked_head(logits, labels, inv, chunk=WIDE)
    assert torch.equal(one.logprobs, before)
    assert one.entropy is None and one.topk_ids is None
    for chunk in (1, 10, 64):
        several = chunked_head(logits, labels, inv, chunk=chunk)
        torch.testing.assert_close(several.logprobs, before, rtol=0, atol=2e-6)
    # Entropy and top-k do not change the log-probs.
    extras = chunked_head(logits, labels, inv, chunk=10, entropy=True, top_k=3)
    assert torch.equal(extras.logprobs, chunked_head(logits, labels, inv, chunk=10).logprobs)


def test_bf16_logits_give_topk_ids_whose_log_probs_are_the_values():
    logits, labels = full_vocabulary(seed=2, dtype=torch.bfloat16)  # ties are likely
    got = chunked_head(logits, labels, torch.tensor([1.0]), top_k=16, chunk=9)
    want = reference(logits, labels, top_k=16)
    torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, rtol=0, atol=2e-5)
    at_ids = torch.log_softmax(logits.float(), -1).gather(-1, got.topk_ids)
    torch.testing.assert_close(got.topk_logprobs, at_ids, rtol=0, atol=2e-5)
    assert all(row.unique().numel() == 16 for row in got.topk_ids.reshape(-1, 16))


# -- vocabulary-sharded over two ranks ----------------------------------------------------------

CASES = [  # (chunk, top_k, temperature)
    (7, 5, 1.0), (64, MAX_TOP_K, 0.7), (16, 1, 1.3), (1000, 3, 1.0)]


def _tp_worker(rank: int, store: str, out: str):
    """One of two gloo ranks: its half of the vocabulary through `chunked_head`."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                         world_size=2)
    try:
        group = torch.distributed.new_group([0, 1])
        results = []
        for seed, (chunk, top_k, temperature) in enumerate(CASES):
            logits, labels = full_vocabulary(seed)
            shard = logits[..., rank * WIDE // 2:(rank + 1) * WIDE // 2]
            results.append(chunked_head(shard, labels, torch.tensor([1 / temperature]),
                                        entropy=True, top_k=top_k, chunk=chunk, group=group))
        torch.save([dict(zip(HEAD_FIELDS, r)) for r in results], os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_sharded_over_two_ranks_the_head_equals_the_whole_vocabulary(tmp_path):
    mp.spawn(_tp_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for seed, (chunk, top_k, temperature) in enumerate(CASES):
        logits, labels = full_vocabulary(seed)
        want = reference(logits, labels, temperature, top_k)
        for rank in ranks:
            assert_matches(HeadOutputs(**rank[seed]), want, top_k)
        for name in HEAD_FIELDS:  # every rank holds the same result
            assert torch.equal(ranks[0][seed][name], ranks[1][seed][name])


def test_the_reports_keys_are_the_head_outputs_fields_in_order():
    assert HEAD_FIELDS == HeadOutputs._fields  # report_logprobs zips them


# -- options -------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, match", [
    ({"top_k": -1}, r"top_k is wrong: -1\. Pass an int from 0 \(no top-k\) to 64"),
    ({"top_k": 65}, "top_k is wrong: 65"),
    ({"top_k": 2.0}, "top_k is wrong: 2.0"),
    ({"top_k": True}, "top_k is wrong: True"),
    ({"entropy": 1}, r"entropy is wrong: 1\. Pass True or False"),
    ({"vocab_chunk": -8}, r"vocab_chunk is wrong: -8\. Pass a positive int"),
    ({"vocab_chunk": 0, "top_k": 4}, r"vocab_chunk is wrong for entropy=False, top_k=4: 0"),
])
def test_bad_head_options_name_the_value_and_the_fix(options, match):
    settings = {"entropy": False, "top_k": 0, "vocab_chunk": 8192} | options
    with pytest.raises(ValueError, match=match):
        check_head_options(settings["entropy"], settings["top_k"], settings["vocab_chunk"])
    with pytest.raises(ValueError, match=match):
        LogProbStep(with_seq_idx=False, **options)


def test_per_position_rows_land_on_their_tokens_and_first_tokens_get_zeros():
    from megatron.packed_training.rl.batches import lay_out
    from tests.unit.test_rl_library import ROW, sequences

    mb = sequences(4, 1, 3)
    layout = lay_out(mb, 0, ROW)["layout"]
    rows = torch.arange(ROW * 2, dtype=torch.float32).reshape(ROW, 2) + 1
    got = rows_to_tokens(layout, rows)
    assert got.shape == (8, 2)
    for column in range(2):
        assert torch.equal(got[:, column], layout.to_tokens(rows[:, column]))
    assert got[[0, 4, 5]].eq(0).all() and got[[1, 2, 3, 6, 7]].gt(0).all()


# -- the policy ----------------------------------------------------------------------------------

def test_entropy_and_top_k_come_back_token_aligned_graphed_as_eager(cpu_dist):
    policy = make_policy(dropout=0.1)
    policy.logprob_vocab_chunk = 24  # three chunks of the 64 ids
    mbs = rollouts(5)
    plain = policy.logprobs(mbs)
    assert all(torch.is_tensor(value) for value in plain)  # no extras: the old return type
    outputs = policy.logprobs(mbs, entropy=True, top_k=8, temperature=0.8)
    stats = policy.last_stats
    assert stats["forward graphs captured"] == 1  # graphs of their own, not the plain call's
    assert stats["forward graphs"] == 3 and stats["eager overflow"] == 2
    eager = policy.logprobs(mbs, entropy=True, top_k=8, temperature=0.8, eager=True)
    for mb, got, forced, lp in zip(mbs, outputs, eager, plain):
        assert isinstance(got, LogProbOutputs)
        n = mb.tokens.numel()
        assert got.logprobs.shape == got.entropy.shape == (n,)
        assert got.topk_logprobs.shape == got.topk_ids.shape == (n, 8)
        for name in ("logprobs", "entropy", "topk_logprobs", "topk_ids"):
            assert torch.equal(getattr(got, name), getattr(forced, name)), name
        torch.testing.assert_close(got.logprobs, direct_logprobs(policy.model[0], mb, 0.8),
                                   rtol=0, atol=1e-5)
        want = direct_outputs(policy.model[0], mb, 0.8, 8)
        torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, rtol=0, atol=1e-5)
        assert torch.equal(got.topk_ids, want.topk_ids)
        starts = torch.tensor([0, *torch.tensor(mb.lengths).cumsum(0)[:-1].tolist()])
        assert got.entropy[starts].eq(0).all() and got.topk_ids[starts].eq(0).all()
        assert got.entropy.gt(0).sum() == n - len(starts)
    policy.logprobs(mbs)  # the plain call again: its own graphs, captured already
    assert "forward graphs captured" not in policy.last_stats
    only_entropy = policy.logprobs(mbs, entropy=True)
    assert policy.last_stats["forward graphs captured"] == 1
    assert only_entropy[0].topk_ids is None and only_entropy[0].entropy is not None


def direct_outputs(model, mb, temperature, top_k) -> LogProbOutputs:
    """Entropy and top-k from the model's whole logits by hand (torch, token aligned)."""
    from tests.unit.test_rl_library import direct_logits

    batch, staged, logits = direct_logits(model, mb)
    want = reference(logits[0], staged.labels[0], temperature, top_k)
    layout = batch["layout"]
    return LogProbOutputs(None, layout.to_tokens(want.entropy),
                          rows_to_tokens(layout, want.topk_logprobs),
                          rows_to_tokens(layout, want.topk_ids))


def test_the_whole_shard_equals_one_chunk_bitwise_and_several_chunks_within_rounding(cpu_dist):
    policy = make_policy()
    mbs = rollouts(2)
    policy.logprob_vocab_chunk = 0  # megatron-core's cross entropy, as train_step
    whole = policy.logprobs(mbs)
    policy.logprob_vocab_chunk = VOCAB
    one = policy.logprobs(mbs)
    policy.logprob_vocab_chunk = 16
    several = policy.logprobs(mbs)
    for a, b, c in zip(whole, one, several):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, a, rtol=0, atol=2e-6)
    policy.logprob_vocab_chunk = 0
    with pytest.raises(ValueError, match=r"policy\.logprob_vocab_chunk is wrong for entropy=True"):
        policy.logprobs(mbs, entropy=True)


def test_bad_options_are_refused_before_anything_runs(cpu_dist):
    policy = make_policy()
    mbs = rollouts(1)
    for options, match in (({"top_k": 100}, "top_k is wrong: 100"),
                           ({"top_k": "8"}, "top_k is wrong: '8'")):
        with pytest.raises(ValueError, match=match):
            policy.logprobs(mbs, **options)
    assert policy.last_stats == {} and not policy.runtime.forward_graphs
    small = make_policy()
    small.vocab_size = 32  # a vocabulary smaller than k
    with pytest.raises(ValueError, match="top_k is wrong: 40, more than the vocabulary's 32"):
        small.logprobs(mbs, top_k=40)
