"""The library API (megatron.packed_training.rl) on CPU: micro-batch layout and input checks,
log-probs and losses, weight swaps and refits, and `PackedPolicy` on a real GPT through the
graph runtime and its seam, with megatron-core's PP = 1 schedule stood in for (it allocates
on CUDA) and forward-only graphs replayed by conftest.replaying_capture. The CUDA runs:
tests/gpu/test_rl_policy.py.
"""

import itertools
import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.packed_graphs.plan import GraphRuntimeConfig
from megatron.packed_graphs.runtime import GraphRuntime
from megatron.packed_graphs.schedule import GraphRuntimeSchedule
from megatron.packed_graphs.specs import gpt_layer_spec
from megatron.packed_training.packed_step import to_device_micro_batch
from megatron.packed_training.rl import (
    LossInputs,
    PackedPolicy,
    PackedSequences,
    WeightStore,
    policy_weights,
)
from megatron.packed_training.rl.batches import check_values, lay_out, lay_out_all
from megatron.packed_training.rl.losses import clipped_policy_loss, negative_log_likelihood
from megatron.packed_training.rl.steps import token_logprobs
from megatron.packed_training.rl.weights import load_weights, swapped_weights
from tests.unit.conftest import replaying_capture

ROW, VOCAB, HIDDEN = 32, 64, 32
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sequences(*lengths, seed=0, **tensors):
    generator = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return PackedSequences(torch.randint(1, VOCAB, (n,), generator=generator),
                           lengths=list(lengths), tensors=tensors)


# -- layout ------------------------------------------------------------------------------------

def test_a_micro_batch_is_laid_out_as_the_data_path_packs_it():
    tokens = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    advantages = torch.tensor([9.0, 1.0, 2.0, 3.0, 9.0, 4.0, 5.0])  # 9: first tokens, unused
    mb = PackedSequences(tokens, lengths=[4, 3], loss_weights=torch.tensor([0, 0, 1, 1, 0, 1, 1.]),
                         tensors={"advantages": advantages})
    batch = lay_out(mb, 0, row_positions=8)
    assert batch["tokens"].tolist() == [[5, 6, 7, 9, 10, 0, 0, 0]]
    assert batch["labels"].tolist() == [[6, 7, 8, 10, 11, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0, 0]]
    assert batch["loss_tensors"]["advantages"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 8]
    assert (batch["num_segments"], batch["num_documents"], batch["max_seqlen"]) == (3, 2, 3)
    assert batch["padding_mask"].tolist() == [[False] * 5 + [True] * 3]
    same = lay_out(PackedSequences(tokens, cu_seqlens=[0, 4, 7], loss_weights=mb.loss_weights,
                                   tensors=mb.tensors), 0, 8)
    assert all(torch.equal(same[key], batch[key]) for key in ("tokens", "labels", "cu_seqlens"))
    # Back to tokens: each position's value on the token it predicts, 0 on first tokens.
    assert batch["layout"].to_tokens(batch["labels"].float()).tolist() == [
        0, 6, 7, 8, 0, 10, 11]


def test_a_one_token_sequence_takes_no_position_and_gets_log_prob_zero():
    batch = lay_out(PackedSequences(torch.tensor([3, 4, 5, 6]), lengths=[2, 1, 1]), 0, 4)
    assert batch["cu_seqlens"].tolist() == [0, 1, 4] and batch["num_documents"] == 1
    assert batch["layout"].to_tokens(torch.arange(4.0) + 1).tolist() == [0, 1, 0, 0]


@pytest.mark.parametrize("mb, match", [
    (sequences(20, 20), r"micro-batch 0 is wrong: its sequences hold 38 training positions "
                        r"\(tokens minus one per sequence\), more than a packed row's 32 "
                        r"\(micro_batch_size x seq_length\). Split it"),
    (sequences(3, advantages=torch.zeros(4)), r"micro-batch 0: advantages is wrong: shape "
                                              r"\(4,\), expected \(3,\)"),
    (sequences(3, advantages=torch.zeros(3, dtype=torch.long)),
     r"advantages is wrong: dtype torch.int64. .* pass advantages.float\(\)"),
    (PackedSequences(torch.zeros(3)), r"tokens is wrong: shape \(3,\), dtype torch.float32"),
    (PackedSequences(torch.zeros(3, dtype=torch.long)),
     "neither lengths nor cu_seqlens given"),
    (PackedSequences(torch.zeros(3, dtype=torch.long), lengths=[2], cu_seqlens=[0, 3]),
     "lengths and cu_seqlens given"),
    (PackedSequences(torch.zeros(3, dtype=torch.long), lengths=[2]),
     "the sequences hold 2 tokens, tokens has 3"),
    (PackedSequences(torch.zeros(3, dtype=torch.long),
                     lengths=torch.tensor([3], device="meta")),
     "lengths is wrong: a meta tensor. Give it on the host"),
    (PackedSequences(torch.zeros(3, dtype=torch.long), cu_seqlens=[0, 3, 3]),
     "cu_seqlens is wrong"),
    (PackedSequences(torch.zeros(2, dtype=torch.long), lengths=[1, 1]),
     "no sequence has two tokens"),
])
def test_bad_micro_batches_name_what_is_wrong_and_the_fix(mb, match):
    with pytest.raises(ValueError, match=match):
        lay_out(mb, 0, ROW)


def test_every_micro_batch_of_a_call_carries_the_same_tensors():
    with pytest.raises(ValueError, match=r"micro-batch 1: tensors is wrong: \['kl'\], other "
                                         r"micro-batches carry \['advantages'\]"):
        lay_out_all([sequences(3, advantages=torch.zeros(3)),
                     sequences(3, kl=torch.zeros(3))], ROW)
    with pytest.raises(ValueError, match="give a non-empty list of PackedSequences"):
        lay_out_all(sequences(3), ROW)


def test_the_input_health_check_finds_a_nan_advantage_and_ids_outside_the_vocabulary():
    advantages = torch.tensor([0.0, 1.0, float("nan")])
    batches = lay_out_all([sequences(3, advantages=torch.zeros(3)),
                           sequences(3, advantages=advantages)], ROW)
    with pytest.raises(ValueError, match=r"micro-batch 1: advantages is wrong: it holds NaN or "
                                         r"infinite values.*0 \* nan is nan\). Fix where "
                                         r"advantages is computed"):
        check_values(batches, VOCAB)
    first_token_nan = torch.tensor([float("nan"), 1.0, 2.0])  # never a target: ignored
    check_values(lay_out_all([sequences(3, advantages=first_token_nan)], ROW), VOCAB)
    with pytest.raises(ValueError, match=r"micro-batch 0: tokens is wrong: an id outside "
                                         r"\[0, 64\)"):
        check_values(lay_out_all([PackedSequences(torch.tensor([1, 64]), lengths=[2])], ROW),
                     VOCAB)


# -- log-probs and losses ----------------------------------------------------------------------

def test_token_logprobs_are_log_softmax_at_the_temperature(cpu_dist):
    logits = torch.randn(1, 5, VOCAB)
    labels = torch.randint(0, VOCAB, (1, 5))
    for temperature in (1.0, 0.7):
        got = token_logprobs(logits, labels, torch.tensor([1.0 / temperature]))
        want = torch.log_softmax(logits * (1.0 / temperature), -1).gather(-1, labels[..., None])
        torch.testing.assert_close(got, want[..., 0])


def loss_inputs(logprobs, old, advantages, weights, ref=None):
    tensors = {"old_logprobs": torch.tensor(old), "advantages": torch.tensor(advantages)}
    if ref is not None:
        tensors["ref_logprobs"] = torch.tensor(ref)
    return LossInputs(torch.tensor(logprobs), torch.tensor(weights), tensors)


def test_the_clipped_loss_at_ratio_one_is_minus_the_weighted_advantage():
    inputs = loss_inputs([-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0], [1.0, -2.0, 5.0], [1, 1, 0.0])
    assert clipped_policy_loss(inputs).item() == pytest.approx(1.0)  # -(1 - 2)


def test_the_clipped_loss_clips_the_ratio_on_the_side_that_would_gain():
    log_two = torch.log(torch.tensor(2.0)).item()
    up = loss_inputs([log_two], [0.0], [1.0], [1.0])  # ratio 2, positive advantage: clipped
    assert clipped_policy_loss(up, clip_high=0.2).item() == pytest.approx(-1.2)
    down = loss_inputs([log_two], [0.0], [-1.0], [1.0])  # negative advantage: not clipped
    assert clipped_policy_loss(down, clip_high=0.2).item() == pytest.approx(2.0)


def test_the_kl_term_is_zero_at_the_reference_and_positive_elsewhere():
    same = loss_inputs([-1.0], [-1.0], [0.0], [1.0], ref=[-1.0])
    assert clipped_policy_loss(same, kl_coef=0.5).item() == 0.0
    other = loss_inputs([-1.0], [-1.0], [0.0], [1.0], ref=[-2.0])
    k3 = torch.exp(torch.tensor(-1.0)) - (-1.0) - 1.0
    assert clipped_policy_loss(other, kl_coef=0.5).item() == pytest.approx(0.5 * k3.item())


def test_positions_of_weight_zero_cannot_poison_the_loss():
    # A padding position: log-prob -200 against old 0 and reference 0 would overflow exp.
    inputs = loss_inputs([-1.0, -200.0], [-1.0, 0.0], [1.0, 1.0], [1.0, 0.0], ref=[-1.0, 0.0])
    assert torch.isfinite(clipped_policy_loss(inputs, kl_coef=1.0))
    with pytest.raises(KeyError, match="the loss asks for per-token tensor 'ref_logprobs'"):
        clipped_policy_loss(loss_inputs([0.0], [0.0], [0.0], [1.0]), kl_coef=1.0)


# -- weights -------------------------------------------------------------------------------------

def build_gpt(seed=0, dropout=0.0):
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_dropout_fusion=False, hidden_dropout=dropout,
        attention_dropout=0.0)
    return GPTModel(config=config, transformer_layer_spec=gpt_layer_spec("torch"),
                    vocab_size=VOCAB, max_sequence_length=ROW, position_embedding_type="none")


def test_policy_weights_list_tied_tensors_once(cpu_dist):
    model = build_gpt()
    names = policy_weights([model])
    assert {"embedding.word_embeddings.weight", "output_layer.weight"} <= set(names)
    assert set(policy_weights([model, build_gpt()])) == {
        f"chunk{i}.{name}" for i in range(2) for name in names}
    tied = torch.nn.Module()
    tied.first = tied.second = torch.nn.Linear(2, 2)  # one module under two names
    tied.register_buffer("steps", torch.zeros(1, dtype=torch.long))  # not a float: not listed
    assert list(policy_weights([tied])) == ["first.weight", "first.bias"]


def test_swaps_and_loads_copy_in_place_and_restore(cpu_dist):
    model, other = build_gpt(0), build_gpt(1)
    mine, theirs = WeightStore.snapshot([model]), WeightStore.snapshot([other])
    addresses = {name: t.data_ptr() for name, t in policy_weights([model]).items()}
    with swapped_weights([model], theirs):
        live = policy_weights([model])
        assert all(torch.equal(live[name], value) for name, value in
                   WeightStore.snapshot([other]).tensors.items())
        assert all(torch.equal(theirs.tensors[name], value)  # the store holds ours meanwhile
                   for name, value in mine.tensors.items())
        assert {name: t.data_ptr() for name, t in live.items()} == addresses
    assert all(torch.equal(value, mine.tensors[name])
               for name, value in policy_weights([model]).items())
    assert all(torch.equal(value, WeightStore.snapshot([other]).tensors[name])
               for name, value in theirs.tensors.items())  # the store is itself again
    load_weights([model], theirs)
    assert all(torch.equal(value, theirs.tensors[name])
               for name, value in policy_weights([model]).items())


def test_weights_of_another_shape_or_name_are_refused(cpu_dist):
    model = build_gpt()
    store = WeightStore.snapshot([model])
    name = "embedding.word_embeddings.weight"
    bad = dict(store.tensors, **{name: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=rf"weight {name} is wrong: shape \(3, 3\), the model's "
                                         rf"is \({VOCAB}, {HIDDEN}\)"):
        load_weights([model], bad)
    missing = {k: v for k, v in store.tensors.items() if k != name}
    with pytest.raises(ValueError, match=rf"weights are wrong: missing \['{name}'\]"):
        load_weights([model], missing)


# -- the policy ----------------------------------------------------------------------------------

def cpu_schedule(*, forward_step_func, data_iterator, model, num_microbatches, forward_only,
                 **kwargs):
    """megatron-core's forward_backward_no_pipelining without per-token loss: per
    micro-batch, forward, its loss function at once, backward of loss / tokens / count."""
    reports = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, model[0])
        loss, num_tokens, report = loss_func(output)
        if not forward_only:
            (loss / num_tokens.clamp(min=1) / num_microbatches).backward()
        reports.append(report)
    return reports


@pytest.fixture(autouse=True)
def no_rng_tracker(monkeypatch):
    from megatron.packed_graphs import runtime

    monkeypatch.setattr(runtime, "_rng_states", dict)


def make_policy(seed=0, capacity=4, dropout=0.0, lr=0.1, schedule=cpu_schedule):
    model = build_gpt(seed, dropout)
    config = GraphRuntimeConfig(impl="local", capacity=capacity, warmup_iterations=1,
                                forward_graphs=True)
    runtime = GraphRuntime(config, [model])
    runtime.forward_capture = replaying_capture
    seam = GraphRuntimeSchedule(runtime, schedule, stream_length=ROW)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return PackedPolicy([model], optimizer, runtime, seam, row_positions=ROW, vocab_size=VOCAB,
                        step_options={"with_seq_idx": False, "static_max_seqlen": True,
                                      "device": torch.device("cpu")})


def rollouts(count=3, seed=0, **tensors):
    shapes = [(4, 7, 2), (9, 3), (5, 5, 5, 3), (12,), (2, 2, 2, 2, 2, 2)]
    return [sequences(*shapes[i % len(shapes)], seed=seed + i,
                      **{name: make(sum(shapes[i % len(shapes)]))
                         for name, make in tensors.items()})
            for i in range(count)]


def direct_logits(model, mb: PackedSequences):
    """The model called on the laid-out micro-batch by hand, in eval mode: the laid-out
    batch, its staged form and the logits ``[1, S, V]``."""
    batch = lay_out(mb, 0, ROW)
    staged = to_device_micro_batch(batch, with_seq_idx=False, static_max_seqlen=True,
                                   device=torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        logits = model(staged.tokens, staged.position_ids, None, labels=None,
                       packed_seq_params=staged.params)
    model.train()
    return batch, staged, logits


def direct_logprobs(model, mb: PackedSequences, temperature=1.0):
    """`direct_logits`, log_softmax in torch."""
    batch, staged, logits = direct_logits(model, mb)
    per_position = torch.log_softmax(logits.float() / temperature, -1).gather(
        -1, staged.labels[..., None])[..., 0]
    return batch["layout"].to_tokens(per_position)


def test_logprobs_replay_forward_graphs_equal_to_eager_and_to_log_softmax(cpu_dist):
    policy = make_policy(dropout=0.1)  # eval mode: dropout off in every pass
    mbs = rollouts(5)
    graphed = policy.logprobs(mbs)
    stats = policy.last_stats
    assert stats["forward graphs captured"] == 1 and "eager eval" not in stats
    assert stats["forward graphs"] + stats.get("eager overflow", 0) == 5
    assert stats["eager overflow"] == 2  # 4 and 6 sequences, + padding: over capacity 4
    eager = policy.logprobs(mbs, eager=True)
    assert policy.last_stats == {"forward graphs": 0, "eager forced": 5}
    for mb, got, want in zip(mbs, graphed, eager):
        assert got.shape == (mb.tokens.numel(),) and torch.equal(got, want)
        torch.testing.assert_close(got, direct_logprobs(policy.model[0], mb), rtol=0, atol=1e-5)
        starts = torch.tensor([0, *torch.tensor(mb.lengths).cumsum(0)[:-1].tolist()])
        assert got[starts].eq(0).all() and got.lt(0).sum() == mb.tokens.numel() - len(starts)


def test_every_temperature_replays_the_same_graphs(cpu_dist):
    policy = make_policy()
    mbs = rollouts(2)
    policy.logprobs(mbs)
    hot = policy.logprobs(mbs, temperature=2.0)
    assert "forward graphs captured" not in policy.last_stats
    torch.testing.assert_close(hot[0], direct_logprobs(policy.model[0], mbs[0], 2.0),
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="temperature is wrong: 0"):
        policy.logprobs(mbs, temperature=0)


def grpo_loss():
    return partial(clipped_policy_loss, clip_low=0.2, clip_high=0.2, kl_coef=0.1)


def test_a_train_step_runs_the_loss_on_the_micro_batches_tensors_and_steps(cpu_dist):
    policy = make_policy()
    mbs = rollouts(3, advantages=lambda n: torch.linspace(-1, 1, n))
    old = policy.logprobs(mbs)
    ref = policy.logprobs(mbs, temperature=1.5)
    for mb, o, r in zip(mbs, old, ref):
        mb.tensors |= {"old_logprobs": o, "ref_logprobs": r}
    reference = build_gpt(0)  # the same initial weights, trained by hand
    loss_fn = grpo_loss()
    result = policy.train_step(mbs, loss_fn)
    # By hand: the laid-out rows through the model, the same loss, one SGD step.
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    total, tokens = 0.0, 0.0
    for mb in mbs:
        batch = lay_out(mb, 0, ROW)
        staged = to_device_micro_batch(batch, with_seq_idx=False, static_max_seqlen=True,
                                       device=torch.device("cpu"))
        logits = reference(staged.tokens, staged.position_ids, None, labels=None,
                           packed_seq_params=staged.params)
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, staged.labels[..., None])
        inputs = LossInputs(logprobs.reshape(-1), batch["loss_mask"].reshape(-1),
                            {k: v.reshape(-1) for k, v in batch["loss_tensors"].items()})
        loss = loss_fn(inputs)
        count = (inputs.weights > 0).sum()
        (loss / count / len(mbs)).backward()
        total, tokens = total + loss.item(), tokens + count.item()
    optimizer.step()
    assert result.loss.item() == pytest.approx(total / tokens, rel=1e-5)
    assert result.num_tokens.item() == tokens and result.update_successful
    assert result.stats["eager warmup"] == 3  # the runtime's counters of the iteration
    for (name, got), want in zip(policy.model[0].named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
    second = policy.train_step(mbs, loss_fn)  # past the warm-up: 4 sequences overflow 4
    assert second.stats["eager overflow"] == 1 and second.stats["graph fallbacks"] == 1
    assert policy.runtime.iterations == 2


def test_an_empty_micro_batch_runs_and_changes_nothing(cpu_dist):
    """A rank dealt fewer micro-batches runs empty ones (deal_micro_batches): log-probs of
    nothing, a loss of 0 over 0 tokens, and the step the other micro-batches make."""
    from megatron.packed_training.rl import deal_micro_batches

    mbs = rollouts(2, advantages=lambda n: torch.linspace(-1, 1, n))
    (padded,) = deal_micro_batches(mbs + [PackedSequences.empty(["advantages"])], 1)
    policy, alone = make_policy(), make_policy()
    logprobs = policy.logprobs(padded)
    assert logprobs[-1].numel() == 0
    for got, want in zip(logprobs, alone.logprobs(mbs)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    def summed_advantage(inputs):
        return -(inputs.logprobs * inputs["advantages"] * inputs.weights).sum()

    with_empty = policy.train_step(padded, summed_advantage)
    without = alone.train_step(mbs, summed_advantage)
    assert torch.isfinite(with_empty.loss) and with_empty.num_tokens == without.num_tokens


# -- loss normalization and metrics ------------------------------------------------------------

def per_count_schedule(*, forward_step_func, data_iterator, model, num_microbatches,
                       forward_only, **kwargs):
    """megatron-core's schedule with calculate_per_token_loss: each micro-batch's summed loss
    backward as it is, the gradients divided by the step's total count at the end."""
    reports, total = [], 0
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, model[0])
        loss, count, report = loss_func(output)
        if not forward_only:
            loss.backward()
        total += int(count)
        reports.append(report)
    if not forward_only:
        for parameter in model[0].parameters():
            if parameter.grad is not None:
                parameter.grad /= max(total, 1)
    return reports


def weighted_advantage_loss(inputs):
    return -(inputs.logprobs * inputs["advantages"] * inputs.weights).sum()


def sequence_advantage_loss(inputs):
    from megatron.packed_training.rl.steps import per_sequence_means

    return per_sequence_means(-inputs.logprobs * inputs["advantages"], inputs).sum()


SEQUENCES = [(5, 3), (9,), (2, 6, 4), (3, 3, 3, 3)]  # 10 sequences, 31 positions


def advantage_rollouts(groups):
    """The same 10 sequences packed into the given groups of ``SEQUENCES``' lengths."""
    lengths = [n for shape in SEQUENCES for n in shape]
    generator = torch.Generator().manual_seed(7)
    tokens = [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]
    advantages = [torch.full((n,), (-1.0) ** i * (1 + i / 10)) for i, n in enumerate(lengths)]
    out = []
    for group in groups:
        out.append(PackedSequences(torch.cat([tokens[i] for i in group]),
                                   lengths=[lengths[i] for i in group],
                                   tensors={"advantages": torch.cat([advantages[i]
                                                                     for i in group])}))
    return out, tokens, advantages


@pytest.mark.parametrize("normalization, loss_fn", [("token", weighted_advantage_loss),
                                                    ("sequence", sequence_advantage_loss)])
def test_uneven_micro_batches_step_like_one_micro_batch_and_like_plain_torch(
        cpu_dist, normalization, loss_fn):
    one, tokens, advantages = advantage_rollouts([list(range(10))])
    uneven, _, _ = advantage_rollouts([[0], [1, 2, 3, 4], [5, 6, 7, 8, 9]])
    results = {}
    for name, mbs in (("one", one), ("uneven", uneven)):
        policy = make_policy(schedule=per_count_schedule, capacity=16)
        results[name] = (policy.train_step(mbs, loss_fn, normalization=normalization),
                         policy_weights(policy.model))
    # Plain torch: each sequence alone in a row through the same initial model, the loss
    # written out per sequence.
    reference = build_gpt(0)
    per_sequence, per_token_sum, weight_sum = [], 0.0, 0.0
    for sequence, advantage in zip(tokens, advantages):
        staged = to_device_micro_batch(lay_out(PackedSequences(sequence, lengths=[len(sequence)]),
                                               0, ROW), with_seq_idx=False,
                                       static_max_seqlen=True, device=torch.device("cpu"))
        logits = reference(staged.tokens, staged.position_ids, None, labels=None,
                           packed_seq_params=staged.params)
        logprobs = torch.log_softmax(logits.float(), -1).gather(
            -1, staged.labels[..., None])[0, :len(sequence) - 1, 0]
        terms = -logprobs * advantage[1:]
        per_sequence.append(terms.mean())
        per_token_sum, weight_sum = per_token_sum + terms.sum(), weight_sum + terms.numel()
    loss = (torch.stack(per_sequence).mean() if normalization == "sequence"
            else per_token_sum / weight_sum)
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for name in ("one", "uneven"):
        result, weights = results[name]
        assert result.loss.item() == pytest.approx(loss.item(), rel=1e-5), name
        assert result.num_tokens.item() == (10 if normalization == "sequence" else weight_sum)
        for (key, got), want in zip(weights.items(), reference.parameters()):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-6, msg=f"{name} {key}")


def test_metrics_come_back_reduced_over_micro_batches_by_the_count(cpu_dist):
    mbs, _, _ = advantage_rollouts([[0, 1], [2, 3, 4], [5, 6, 7, 8, 9]])

    def with_metrics(inputs):
        positive = ((inputs["advantages"] > 0) * inputs.weights).sum()
        return weighted_advantage_loss(inputs), {"positive": positive,
                                                 "weight": inputs.weights.sum()}

    result = make_policy(capacity=16).train_step(mbs, with_metrics)
    assert sorted(result.metrics) == ["positive", "weight"]
    assert result.metrics["weight"].item() == pytest.approx(1.0)
    lengths = [n for shape in SEQUENCES for n in shape]
    positive = sum(n - 1 for i, n in enumerate(lengths) if i % 2 == 0)
    assert result.metrics["positive"].item() == pytest.approx(positive / sum(
        n - 1 for n in lengths))


@pytest.mark.parametrize("result, message", [
    (lambda loss: (loss, 0.5), r"loss_fn's metrics are wrong: a float"),
    (lambda loss: (loss, {"kl": 0.5}), r"loss_fn's metric 'kl' is wrong: a float\. Give a "
                                       r"0-dim tensor on cpu"),
    (lambda loss: (loss, {"kl": loss.new_zeros(3)}), r"metric 'kl' is wrong: shape \(3,\)"),
    (lambda loss: (loss, loss, loss), r"loss_fn's result is wrong: a tuple"),
])
def test_a_loss_function_returning_something_else_is_named(cpu_dist, result, message):
    mbs, _, _ = advantage_rollouts([[0, 1]])
    with pytest.raises(ValueError, match=message):
        make_policy().train_step(mbs, lambda inputs: result(weighted_advantage_loss(inputs)))


def test_a_nan_advantage_stops_the_step_before_anything_is_trained(cpu_dist):
    policy = make_policy()
    before = WeightStore.snapshot(policy.model)
    bad = lambda n: torch.where(torch.arange(n) == 2, float("nan"), 0.5)  # noqa: E731
    mbs = rollouts(2, advantages=bad, old_logprobs=torch.zeros)
    with pytest.raises(ValueError, match="micro-batch 0: advantages is wrong: it holds NaN"):
        policy.train_step(mbs, partial(clipped_policy_loss))
    assert all(torch.equal(value, before.tensors[name])
               for name, value in policy_weights(policy.model).items())
    assert policy.runtime.iterations == 0


# -- megatron-core's rerun state machine ---------------------------------------------------------

@pytest.fixture
def validating_machine(monkeypatch):
    """megatron-core's rerun state machine in Megatron-LM's default mode (validate_results),
    its CUDA reads stood in for (the device's RNG state and number) and its flags reduced on
    the host, as `PackedPolicy.build` installs (training_loop.reduce_rerun_flags_on_host)."""
    from megatron.core import rerun_state_machine as rerun
    from megatron.packed_upstream import training_loop

    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: torch.zeros(1, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(rerun.RerunStateMachine, "_reduce_any", training_loop.any_rank_requested)
    rerun.destroy_rerun_state_machine()  # one a test before made implicitly
    rerun.initialize_rerun_state_machine(mode=rerun.RerunMode.VALIDATE_RESULTS)
    yield rerun.get_rerun_state_machine()
    rerun.destroy_rerun_state_machine()


def grad_checking_schedule(calls: list):
    """`cpu_schedule`, then what megatron-core's DDP does in finalize_model_grads with
    ``check_for_nan_in_grad`` (param_and_grad_buffer.check_grads): the gradient norm handed to
    the rerun state machine's validate_result. ``calls``: each call's forward_only."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    def schedule(**kwargs):
        calls.append(kwargs["forward_only"])
        reports = cpu_schedule(**kwargs)
        if not kwargs["forward_only"]:
            norm = torch.stack([p.grad.norm() for p in kwargs["model"][0].parameters()
                                if p.grad is not None]).norm()
            get_rerun_state_machine().validate_result(
                result=norm, rejection_func=torch.isnan, message="found NaN in local grad norm",
                tolerance=0.001, fatal=True)
        return reports
    return schedule


def nan_in_runs(runs=(), per_run=2):
    """A loss that is NaN in the forward-backward runs ``runs`` (counted from 0 over the
    policy's calls, ``per_run`` micro-batches each): every gradient of such a run is NaN."""
    calls = itertools.count()

    def loss(inputs):
        scale = float("nan") if next(calls) // per_run in runs else 1.0
        return (inputs.logprobs * inputs.weights).sum() * scale
    return loss


def test_train_steps_run_inside_the_rerun_state_machine_as_megatron_lms_do(
        cpu_dist, validating_machine):
    """DDP's gradient check validates results in the rerun state machine, which refuses
    outside a run of its loop (Megatron-LM's train_step: should_run_forward_backward)."""
    calls = []
    policy = make_policy(schedule=grad_checking_schedule(calls))
    mbs = rollouts(2)
    policy.logprobs(mbs)  # forward only: no gradients, nothing validated
    loss_fn = nan_in_runs()
    for _ in range(2):  # the first step is not validated (no optimizer step before it)
        assert policy.train_step(mbs, loss_fn).update_successful
    assert calls == [True, False, False]
    assert validating_machine.current_iteration == 1 and validating_machine.first_iteration_complete
    assert validating_machine.state.name == "NOT_RUNNING_YET"


@pytest.mark.parametrize("nan_runs, exit_code", [((1, 2), 16), ((1,), 17)],
                         ids=["reproduced", "transient"])
def test_a_nan_gradient_reruns_the_step_in_place_then_stops_it_before_the_update(
        cpu_dist, validating_machine, nan_runs, exit_code):
    """Step 2's gradients are NaN; its rerun on the same micro-batches reproduces that
    (Megatron-LM would check on another GPU: exit code 16) or not (a transient fault: 17)."""
    calls = []
    policy = make_policy(schedule=grad_checking_schedule(calls))
    mbs, loss_fn = rollouts(2), nan_in_runs(nan_runs)
    policy.train_step(mbs, loss_fn)
    trained = WeightStore.snapshot(policy.model)
    with pytest.raises(RuntimeError, match=r"train_step stopped before the optimizer step: "
                                           rf"megatron-core's rerun state machine .* exit code "
                                           rf"{exit_code} "):
        policy.train_step(mbs, loss_fn)
    assert calls == [False, False, False]  # step 1, step 2 and its rerun in place
    assert all(torch.equal(value, trained.tensors[name])
               for name, value in policy_weights(policy.model).items())
    assert policy.schedule._open is None  # the stopped iteration is closed


def test_a_loss_of_the_wrong_shape_is_named(cpu_dist):
    policy = make_policy()
    with pytest.raises(ValueError, match=r"loss_fn's result is wrong: shape \(32,\), dtype "
                                         r"torch.float32. Return the micro-batch's loss summed"):
        policy.train_step(rollouts(1), lambda inputs: inputs.logprobs * inputs.weights)


def test_a_swap_changes_the_replayed_log_probs_exactly_as_eager(cpu_dist):
    policy, reference_model = make_policy(0), build_gpt(1)
    mbs = rollouts(3)
    own = policy.logprobs(mbs)
    reference = WeightStore.snapshot([reference_model])
    with policy.swapped_weights(reference):
        swapped = policy.logprobs(mbs)
        eager = policy.logprobs(mbs, eager=True)
    assert not torch.equal(swapped[0], own[0])
    for got, want, mb in zip(swapped, eager, mbs):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, direct_logprobs(reference_model, mb), rtol=0,
                                   atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(policy.logprobs(mbs), own))


def test_a_refit_loads_weights_in_place(cpu_dist):
    policy, other = make_policy(0), build_gpt(2)
    mbs = rollouts(2)
    policy.logprobs(mbs)  # graphs captured over the old weights
    policy.load_weights(WeightStore.snapshot([other]).tensors)
    for got, mb in zip(policy.logprobs(mbs), mbs):
        torch.testing.assert_close(got, direct_logprobs(other, mb), rtol=0, atol=1e-5)


def test_a_full_iteration_graph_keeps_one_loss_function(cpu_dist):
    policy = make_policy()
    policy.runtime.config = GraphRuntimeConfig(impl="local", capacity=4, full_iteration=True,
                                               iteration_micro_batches=2)
    first = grpo_loss()
    assert policy._loss_step(first) is policy._loss_step(first)
    with pytest.raises(ValueError, match=r"loss_fn is wrong: another function \(or "
                                         r"normalization\) than the earlier steps'\. A "
                                         r"full-iteration graph runs the loss it was captured"):
        policy._loss_step(negative_log_likelihood)
    with pytest.raises(ValueError, match=r"another function \(or normalization\)"):
        policy._loss_step(first, "sequence")


@pytest.mark.slow
def test_the_api_imports_from_any_folder_and_without_the_scripts(tmp_path):
    code = ("import sys, megatron.packed_training.rl as rl, megatron.packed_training.models; "
            "assert 'pretrain_gpt' not in sys.modules; print(rl.PackedPolicy.__name__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("PackedPolicy")


def test_the_model_config_gets_what_megatron_lms_train_sets_before_its_loop():
    from megatron.core.distributed import finalize_model_grads

    from megatron.packed_training.rl.policy import prepare_training_loop

    def chunk():
        return SimpleNamespace(config=SimpleNamespace(
            grad_scale_func=None, no_sync_func=None, grad_sync_func=None, param_sync_func=None,
            finalize_model_grads_func=None), no_sync="no_sync", start_grad_sync="grad_sync",
            start_param_sync="param_sync")

    args = SimpleNamespace(overlap_grad_reduce=False, align_grad_reduce=True,
                           overlap_param_gather=False, align_param_gather=False)
    optimizer = SimpleNamespace(scale_loss="scale")
    plain = chunk()
    prepare_training_loop(args, [plain], optimizer)
    assert plain.config.grad_scale_func == "scale" and plain.config.no_sync_func is None
    assert plain.config.finalize_model_grads_func is finalize_model_grads
    overlapped = chunk()
    overlapped.config.finalize_model_grads_func = "a builder's"
    prepare_training_loop(SimpleNamespace(**(vars(args) | {"overlap_grad_reduce": True})),
                          [overlapped], optimizer)
    assert (overlapped.config.no_sync_func, overlapped.config.grad_sync_func) == (
        "no_sync", "grad_sync")
    assert overlapped.config.finalize_model_grads_func == "a builder's"

