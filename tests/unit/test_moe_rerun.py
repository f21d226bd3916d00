"""--moe-capacity-overflow rerun on CPU, through megatron-core's real GPT and hybrid MoE models.

An iteration of four packed micro-batches under drop-and-pad, one of which overflows an
expert's capacity (all its tokens alike: every one picks the same two experts), is detected
per micro-batch on the device, rerun with that micro-batch dropless, and then equals an
iteration of a dropless model over the same micro-batches: loss, gradients, MoE aux losses
and the dropped-slot counters, nothing counted twice.

The first pass runs drop-and-pad eager here (graphs need the GPU: tests/gpu/test_moe_rerun_training.py);
a graph replays the same drop-and-pad computation. The loop below stands in for megatron-
core's schedules, which allocate on the GPU. megatron-core's dropless alltoall copies token
counts to the host on a CUDA side stream (token_dispatcher.py ``_maybe_dtoh_and_synchronize``);
on CPU they are host tensors already, so the `cpu_moe` fixture makes that copy a no-op.
"""

import pytest
import torch

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from megatron.packed_model.moe import dropless_moe, packed_routers
from megatron.packed_graphs.moe_rerun import RERUN_REASON, CachingIterator, MoEOverflowRerun
from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_graphs.specs import gpt_layer_spec, hybrid_stack_spec
from tests.unit.test_moe import moe_config  # the same small model config; experts set here

EXPERTS, TOPK, TOKENS, DOCS, VOCAB = 8, 2, 16, 12, 64
# Capacity ceil(16 x 2 / 8 x 2.5) = 10 per expert: the 12 document tokens of the uniform
# micro-batch overflow the two experts they all pick; varied tokens stay below it.
CAPACITY = dict(moe_expert_capacity_factor=2.5, moe_pad_expert_input_to_capacity=True)
OVERFLOWING = 2  # position of the uniform micro-batch





def build(kind, capacity):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, max_sequence_length=TOKENS, position_embedding_type="none")
    if kind == "gpt":
        return GPTModel(config=moe_config(num_moe_experts=EXPERTS, **capacity),
                        transformer_layer_spec=gpt_layer_spec("torch", num_experts=EXPERTS),
                        **common)
    config = moe_config(num_layers=3, num_moe_experts=EXPERTS, **capacity)
    return HybridModel(config=config, hybrid_layer_pattern="E*E",
                       hybrid_stack_spec=hybrid_stack_spec("torch", num_experts=EXPERTS),
                       **common)


def micro_batches():
    """Four packed micro-batches of two documents and a padding tail; the third one repeats
    one token, so its tokens all route alike."""
    generator = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, DOCS, TOKENS], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(5), torch.arange(DOCS - 5), torch.arange(4)])
    batches = []
    for index in range(4):
        tokens = torch.randint(1, VOCAB, (1, TOKENS), generator=generator)
        if index == OVERFLOWING:
            tokens[:] = 7
        params = build_packed_batch_params(cu, position_ids, TOKENS, with_seq_idx=False)
        params.padding_mask = torch.arange(TOKENS) >= DOCS
        loss_mask = (~params.padding_mask).float().view(1, -1)
        batches.append((tokens, params, loss_mask))
    return batches


def run_iteration(model, batches):
    """Zero the gradients and run forward and backward over every micro-batch (the loss of
    each scaled by the iteration's token count, as the schedule does). Returns the loss
    reports."""
    model.zero_grad(set_to_none=True)
    total = sum(float(mask.sum()) for _, _, mask in batches)
    reports = []
    for tokens, params, loss_mask in batches:
        output = model(tokens, params.position_ids.view(1, -1), None, labels=tokens,
                       packed_seq_params=params)
        loss = (output.float() * loss_mask).sum()  # the training step's masked_lm_loss
        (loss / total).backward()
        reports.append(loss.detach())
    return reports


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def tracker_values():
    return {name: entry.values.clone() for name, entry in get_moe_metrics_tracker().metrics.items()}


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_rerun_iteration_equals_an_eager_dropless_iteration(cpu_moe, kind):
    model, dropless = build(kind, CAPACITY), build(kind, {})
    dropless.load_state_dict(model.state_dict())
    batches = micro_batches()
    rerun = MoEOverflowRerun([model], max_micro_batches=8)

    first_pass = run_iteration(model, batches)
    first_grads = grads(model)
    asked = []

    def again(eager):
        asked.append(eager)
        return run_iteration(model, batches)

    reports, counts = rerun.after_forward_backward(first_pass, again)
    assert asked == [frozenset({OVERFLOWING})]
    assert counts == {RERUN_REASON: 1} and rerun.totals == {RERUN_REASON: 1}
    final_grads, final_tracker = grads(model), tracker_values()

    get_moe_metrics_tracker().clear()
    expected = run_iteration(dropless, batches)
    expected_grads = grads(dropless)
    # The rerun micro-batch ran the dropless model's code: bitwise. The others ran drop-and-
    # pad without a drop: the same values, summed in another order.
    assert torch.equal(reports[OVERFLOWING], expected[OVERFLOWING])
    assert not torch.equal(first_pass[OVERFLOWING], expected[OVERFLOWING])  # drops mattered
    torch.testing.assert_close(torch.stack(reports), torch.stack(expected), rtol=1e-6, atol=0)
    assert final_grads.keys() == expected_grads.keys()
    for name in expected_grads:
        torch.testing.assert_close(final_grads[name], expected_grads[name], rtol=1e-5,
                                   atol=1e-7, msg=name)
    assert any(not torch.allclose(first_grads[n], expected_grads[n]) for n in expected_grads)
    # MoE aux losses: recorded once per micro-batch, not once more for the first pass.
    expected_tracker = tracker_values()
    assert final_tracker.keys() == expected_tracker.keys() == {"load_balancing_loss", "z_loss"}
    for name in expected_tracker:
        torch.testing.assert_close(final_tracker[name], expected_tracker[name], rtol=1e-6,
                                   atol=0)
    # Dropped-slot counters: every document token's slots routed once, none dropped.
    for router in packed_routers(model):
        assert router.token_slots.tolist() == [4 * DOCS * TOPK, 0]


def test_overflow_is_flagged_per_micro_batch_with_its_peak_load(cpu_moe):
    model = build("gpt", CAPACITY)
    batches = micro_batches()
    rerun = MoEOverflowRerun([model], max_micro_batches=8)
    run_iteration(model, batches)
    rows = rerun.read_rows()
    assert len(rows) == 4
    assert [dropped > 0 for dropped, _ in rows] == [i == OVERFLOWING for i in range(4)]
    # All 12 document tokens of the uniform micro-batch pick the same experts.
    assert rows[OVERFLOWING] == [2 * (DOCS - 10), DOCS]
    assert all(peak <= 10 for i, (_, peak) in enumerate(rows) if i != OVERFLOWING)
    assert rerun.rows.sum() == 0 and rerun.read_rows() == []  # reading resets


def test_each_chunk_files_its_calls_by_micro_batch(cpu_moe):
    """Two model chunks (as pipeline or virtual stages), called in an interleaved order: each
    chunk's n-th training call is micro-batch n, whatever runs in between."""
    first = build("gpt", dict(CAPACITY, moe_expert_capacity_factor=4.0))  # never overflows
    second = build("gpt", CAPACITY)
    batches = micro_batches()
    rerun = MoEOverflowRerun([first, second], max_micro_batches=4)

    def forward(chunk, index):
        tokens, params, _ = batches[index]
        chunk(tokens, params.position_ids.view(1, -1), None, labels=tokens,
              packed_seq_params=params)

    for chunk, index in ((first, 0), (first, 1), (second, 0), (first, 2), (second, 1),
                         (first, 3), (second, 2), (second, 3)):
        forward(chunk, index)
    rows = rerun.read_rows()
    assert [dropped > 0 for dropped, _ in rows] == [i == OVERFLOWING for i in range(4)]


def test_without_overflow_nothing_is_rerun(cpu_moe):
    model = build("gpt", CAPACITY)
    batches = [b for i, b in enumerate(micro_batches()) if i != OVERFLOWING]
    rerun = MoEOverflowRerun([model], max_micro_batches=8)
    reports = run_iteration(model, batches)
    before = grads(model)

    def never(eager):
        raise AssertionError("rerun without an overflow")

    result, counts = rerun.after_forward_backward(reports, never)
    assert result is reports and counts == {RERUN_REASON: 0}
    assert all(torch.equal(before[n], g) for n, g in grads(model).items())
    # The peak loads of the four micro-batches, for the capacity advisor.
    record = rerun.router_load_record()
    assert (record["num_experts"], record["moe_router_topk"]) == (EXPERTS, TOPK)
    assert record["tokens_per_rank"] == TOKENS and record["micro_batches_per_iteration"] == 3
    assert sum(record["peak_loads"].values()) == 3


def test_evaluation_runs_dropless_and_is_not_counted(cpu_moe):
    model, dropless = build("gpt", CAPACITY), build("gpt", {})
    dropless.load_state_dict(model.state_dict())
    tokens, params, _ = micro_batches()[OVERFLOWING]

    def forward(module):
        return module(tokens, params.position_ids.view(1, -1), None, labels=tokens,
                      packed_seq_params=params)

    with torch.no_grad():
        model.eval(), dropless.eval()
        dropping, expected = forward(model), forward(dropless)
        rerun = MoEOverflowRerun([model], max_micro_batches=1)
        assert torch.equal(forward(model), expected) and not torch.equal(dropping, expected)
        model.train()
        forward(model)  # a training-mode call without gradients
    assert rerun.read_rows() == []
    assert model.decoder.layers[0].mlp.token_dispatcher.drop_and_pad  # the scope ended


def test_more_calls_than_the_bound_are_refused(cpu_moe):
    model = build("gpt", CAPACITY)
    MoEOverflowRerun([model], max_micro_batches=1)  # its hooks stay on the model
    with pytest.raises(RuntimeError, match="ran 2 training forward calls.*max_micro_batches is 1"):
        run_iteration(model, micro_batches()[:2])
    with pytest.raises(ValueError, match="max_micro_batches is wrong: 0"):
        MoEOverflowRerun([model], max_micro_batches=0)


def test_a_rerun_that_still_drops_is_an_error(cpu_moe):
    """A rerun that replays drop-and-pad for a rerun micro-batch (as a graph replay would,
    were the micro-batch not run eager) is caught by the check after the rerun."""
    model = build("gpt", CAPACITY)
    batches = micro_batches()
    rerun = MoEOverflowRerun([model], max_micro_batches=8)
    reports = run_iteration(model, batches)

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    config = layers[0].token_dispatcher.config

    def as_captured(layer, args):  # what a captured graph would still run
        layer.router.dropless, layer.token_dispatcher.drop_and_pad = False, True
        layer.token_dispatcher.config = config

    def replays_drop_and_pad(eager):
        hooks = [layer.register_forward_pre_hook(as_captured) for layer in layers]
        try:
            return run_iteration(model, batches)
        finally:
            for hook in hooks:
                hook.remove()

    with pytest.raises(RuntimeError, match=r"micro-batches \[2\] dropped MoE tokens in their "
                                           r"dropless rerun"):
        rerun.after_forward_backward(reports, replays_drop_and_pad)
    assert not any(router.dropless for router in packed_routers(model))


def test_dropless_scope_restores_the_dispatcher(cpu_moe):
    model = build("gpt", CAPACITY)
    layer = model.decoder.layers[0].mlp
    config = layer.token_dispatcher.config
    with dropless_moe([model]):
        assert layer.router.dropless and not layer.token_dispatcher.drop_and_pad
        assert layer.token_dispatcher.config.moe_expert_capacity_factor is None
        assert config.moe_expert_capacity_factor == 2.5  # the shared config is untouched
        tokens, params, _ = micro_batches()[0]
        model(tokens, params.position_ids.view(1, -1), None, labels=tokens,
              packed_seq_params=params)
    assert not layer.router.dropless and layer.token_dispatcher.drop_and_pad
    assert layer.token_dispatcher.config is config
    assert layer.token_dispatcher.input_splits is None


def test_caching_iterator_replays_the_iteration():
    source = CachingIterator(iter(range(5)))
    assert [next(source), next(source)] == [0, 1]
    assert list(source.replay()) == [0, 1] == list(source.replay())
    source.clear()
    assert next(source) == 2 and list(source.replay()) == [2]


def test_measured_loads_size_a_capacity_that_does_not_overflow(cpu_moe, tmp_path):
    """A warm-up measurement through tools/capacity_advisor.py: the factor it suggests for
    no overflow holds the uniform micro-batch (12 tokens on one expert) without a rerun."""
    import json

    from tools.capacity_advisor import read_router_loads, recommend_capacity_factor

    model = build("gpt", CAPACITY)
    batches = micro_batches()
    rerun = MoEOverflowRerun([model], max_micro_batches=8)
    rerun.after_forward_backward(run_iteration(model, batches), lambda eager: run_iteration(
        model, batches))
    path = tmp_path / "loads.json"
    path.write_text(json.dumps(rerun.router_load_record()))
    factor, capacity, rate = recommend_capacity_factor(read_router_loads(str(path)), 0.0)
    assert (factor, capacity, rate) == (2.76, DOCS, 0.0)  # ceil(16 x 2 / 8 x 2.76) = 12

    sized = build("gpt", dict(CAPACITY, moe_expert_capacity_factor=factor))
    check = MoEOverflowRerun([sized], max_micro_batches=8)
    run_iteration(sized, batches)
    assert all(dropped == 0 for dropped, _ in check.read_rows())


def test_from_settings_and_the_load_file(cpu_moe, tmp_path):
    import json
    from dataclasses import replace

    from megatron.packed_graphs.settings import CPBanks, GraphSettings, MoEGraphSettings

    model = build("gpt", CAPACITY)
    settings = GraphSettings(impl="local", capacity=8, global_batch_size=16, micro_batch_size=2,
                             data_parallel_size=2, moe=MoEGraphSettings())
    assert MoEOverflowRerun.from_settings(settings, [model]) is None
    assert MoEOverflowRerun.from_settings(replace(settings, moe=None), [model]) is None
    # Dynamic CP: ranks run unequal shares, so the bound is the whole global batch.
    banks = CPBanks(sizes=(1, 2), max_packed_seqs=(8, 8), tokens_per_rank=64)
    rerun_moe = MoEGraphSettings(capacity_overflow="rerun")
    unequal = MoEOverflowRerun.from_settings(replace(settings, moe=rerun_moe, cp_banks=banks),
                                             [build("gpt", CAPACITY)])
    assert unequal.rows.shape == (8 + 2, 2)
    rerun = MoEOverflowRerun.from_settings(replace(settings, moe=rerun_moe), [model])
    assert rerun.rows.shape == (4 + 2, 2)  # 16 / 2 / 2 micro-batches per rank, and the shape
    batches = micro_batches()
    rerun.after_forward_backward(run_iteration(model, batches),
                                 lambda eager: run_iteration(model, batches))
    rerun.write_router_loads(str(tmp_path / "loads.json"))
    record = json.loads((tmp_path / "loads.json").read_text())
    assert record == {"num_experts": EXPERTS, "moe_router_topk": TOPK, "tokens_per_rank": TOKENS,
                      "micro_batches_per_iteration": 4,
                      "peak_loads": {"6": 1, "5": 1, "12": 1, "7": 1}}


def test_capture_warm_up_leaves_no_trace_in_the_moe_accumulators(cpu_moe):
    """The capture iteration's graph warm-up (forward passes on placeholder inputs, run by
    megatron-core inside the end-of-schedule capture) adds nothing to the step's aux losses
    or dropped-slot counts: the runtime runs that capture inside its guard."""
    from megatron.packed_upstream import graph_engine
    from megatron.packed_graphs.plan import GraphRuntimeConfig
    from megatron.packed_graphs.runtime import GraphRuntime

    model = build("gpt", CAPACITY)
    runtime = GraphRuntime(GraphRuntimeConfig(impl="local", capacity=8, warmup_iterations=0),
                           model=[model])
    batch = micro_batches()[0]
    with runtime.iteration([[{"num_segments": 3, "num_documents": 2}]], forward_step=None):
        assert len(graph_engine._capture_guards) == 1
        run_iteration(model, [batch])  # the iteration's own micro-batch
        training = tracker_values()
        slots = [r.token_slots.clone() for r in packed_routers(model)]
        with graph_engine._capture_guards[0]():  # what the capture wrapper enters
            placeholder = (torch.zeros_like(batch[0]), batch[1], batch[2])
            run_iteration(model, [placeholder, placeholder])
            assert any(not torch.equal(v, training[k]) for k, v in tracker_values().items())
        assert all(torch.equal(v, training[k]) for k, v in tracker_values().items())
        assert all(torch.equal(r.token_slots, s) for r, s in zip(packed_routers(model), slots))
    assert graph_engine._capture_guards == []
