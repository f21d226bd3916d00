"""MoE on packed micro-batches, on CPU with megatron-core's real modules.

* The padding mask: built by the collate step and carried in the packed params.
* `PackedTopKRouter` routes like upstream's TopKRouter without padding, routes no padding
  token, and routes a padded row's documents exactly as without the padding (same capacity);
  aux loss and z-loss ignore the padding.
* GPT-MoE and hybrid models with 'E' layers build from the TE-free spec and run forward and
  backward under drop-and-pad. megatron-core's alltoall dispatcher creates a CUDA stream in
  its constructor for the dropless token-count copy (token_dispatcher.py:469) that
  drop-and-pad never uses; the `cpu_moe` fixture stands a placeholder in for it. Dropless and
  capacity-without-padding dispatch run that copy (token_dispatcher.py:922), so they need a
  GPU (tests/gpu/test_moe_graphs.py).
"""

import pytest
import torch

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.packed_graphs.layers import GraphSafeMoELayer
from megatron.packed_model.moe import PackedTopKRouter
from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_graphs.specs import gpt_layer_spec, hybrid_stack_spec
from megatron.packed_training.datasets.packing import Document, collate_packed_rows
from megatron.packed_training.datasets.row_plan import pack_documents
from megatron.packed_training.packed_step import dummy_micro_batch, to_device_micro_batch
from tests.unit.conftest import tiny_moe_config

HIDDEN, EXPERTS, TOPK = 32, 4, 2
DROP_AND_PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)


def moe_config(**overrides):
    return tiny_moe_config(TransformerConfig, **(dict(
        num_layers=2, hidden_size=HIDDEN, num_moe_experts=EXPERTS, moe_router_topk=TOPK)
        | overrides))




def seeded(cls, config, seed=0):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    torch.manual_seed(seed)
    router = cls(config=config, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    return router


# ------------------------------------------------------------------------------ padding mask

def test_collate_marks_row_padding_tails():
    docs = [Document(torch.arange(1, n + 1).numpy(), None, f"doc{n}") for n in (5, 3, 7)]
    batch = collate_packed_rows(list(pack_documents(docs, seq_length=8)))
    cu = batch["cu_seqlens"].tolist()
    mask = batch["padding_mask"].reshape(-1)
    assert batch["padding_mask"].dtype == torch.bool and mask.numel() == cu[-1]
    # Exactly the positions past each row's documents are padding.
    assert int(mask.sum()) == sum(8 - int(row.cu_seqlens[row.num_documents])
                                  for row in pack_documents(docs, seq_length=8))
    assert not mask[:cu[1]].any()


def test_collate_marks_inner_cp_padding():
    docs = [Document(torch.arange(1, n + 1).numpy(), None, f"doc{n}") for n in (6, 3)]
    (row,) = pack_documents(docs, seq_length=16, segment_multiple=4)
    mask = collate_packed_rows([row])["padding_mask"][0]
    actual = (row.cu_seqlens_actual[1:] - row.cu_seqlens_actual[:-1])[:row.num_documents]
    assert int((~mask).sum()) == int(actual.sum()) == 7  # 5 + 2 shifted positions


def test_params_carry_this_ranks_padding_mask():
    docs = [Document(torch.arange(1, n + 1).numpy(), None, f"doc{n}") for n in (6, 3)]
    batch = collate_packed_rows(list(pack_documents(docs, seq_length=16, segment_multiple=4)))
    cpu = torch.device("cpu")
    whole = to_device_micro_batch(batch, with_seq_idx=False, static_max_seqlen=True,
                                  device=cpu, with_padding_mask=True)
    assert torch.equal(whole.params.padding_mask, batch["padding_mask"].reshape(-1))
    rank1 = to_device_micro_batch(batch, with_seq_idx=False, static_max_seqlen=True,
                                  device=cpu, cp_size=2, cp_rank=1, with_padding_mask=True)
    # CP keeps the same positions of the mask as of the tokens.
    assert rank1.params.padding_mask.numel() == 8
    assert torch.equal(rank1.params.padding_mask, rank1.tokens.reshape(-1) == 0)
    dense = to_device_micro_batch(batch, with_seq_idx=False, static_max_seqlen=True, device=cpu)
    assert dense.params.padding_mask is None
    dummy = to_device_micro_batch(dummy_micro_batch(8), with_seq_idx=False,
                                  static_max_seqlen=True, device=cpu, with_padding_mask=True)
    assert dummy.params.padding_mask.all()


# ------------------------------------------------------------------------------ the router

@pytest.mark.parametrize("capacity", [{}, DROP_AND_PAD, dict(moe_expert_capacity_factor=0.5)])
def test_without_padding_the_router_routes_like_upstream(cpu_moe, capacity):
    config = moe_config(**capacity)
    ours, upstream = seeded(PackedTopKRouter, config), seeded(TopKRouter, config)
    assert torch.equal(ours.weight, upstream.weight)
    logits = torch.randn(16, 1, EXPERTS)
    probs, routing_map = ours.routing(logits)
    expected_probs, expected_map = upstream.routing(logits)
    assert torch.equal(probs, expected_probs) and torch.equal(routing_map, expected_map)


def _documents_and_padding(docs=8, pad=8, seed=1):
    torch.manual_seed(seed)
    hidden = torch.randn(docs + pad, 1, HIDDEN)
    hidden[docs:] *= 10  # loud padding: upstream would give it high router scores
    mask = torch.arange(docs + pad) >= docs
    return hidden, mask.view(1, -1)


@pytest.mark.parametrize("capacity", [{}, DROP_AND_PAD])
def test_padding_gets_no_weight_and_no_capacity(cpu_moe, capacity):
    router = seeded(PackedTopKRouter, moe_config(**capacity))
    hidden, mask = _documents_and_padding()
    probs, routing_map = router(hidden, padding_mask=mask.transpose(0, 1))
    assert not probs[8:].any()
    if capacity:  # padding holds only the zero-probability fill of drop-and-pad
        assert (routing_map.sum(dim=0) == 8).all()  # capacity ceil(16 x 2 / 4 x 1.0)
        assert ((routing_map[:8] & (probs[:8] > 0)).sum(dim=1) == TOPK).all()
    else:  # dropless dispatch lays out tokens x top-k rows: padding keeps its slots
        assert (routing_map.sum(dim=1) == TOPK).all()
        assert ((probs[:8] > 0).sum(dim=1) == TOPK).all()


@pytest.mark.parametrize("pad_to_capacity", [False, True])
def test_padded_row_routes_its_documents_like_the_documents_alone(cpu_moe, pad_to_capacity):
    # 8 document tokens alone at factor 0.5 and with 8 padding tokens at factor 0.25 have the
    # same capacity (2 per expert for 16 routed slots): tokens are dropped in both.
    hidden, mask = _documents_and_padding()
    padded = seeded(PackedTopKRouter, moe_config(
        moe_expert_capacity_factor=0.25, moe_pad_expert_input_to_capacity=pad_to_capacity))
    alone = seeded(PackedTopKRouter, moe_config(
        moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=pad_to_capacity))
    probs, routing_map = padded(hidden, padding_mask=mask.transpose(0, 1))
    doc_probs, doc_map = alone(hidden[:8])
    assert torch.equal(probs[:8], doc_probs)
    assert not probs[8:].any()
    if pad_to_capacity:  # unused slots hold zero-probability rows, as upstream fills them
        assert torch.equal(routing_map[:8] & (probs[:8] > 0), doc_map & (doc_probs > 0))
        assert (routing_map.sum(dim=0) == 2).all()
    else:
        assert torch.equal(routing_map[:8], doc_map) and not routing_map[8:].any()
    assert doc_map.sum() < 8 * TOPK  # the capacity bites: documents overflow it
    # Upstream's router lets the loud padding take capacity from the documents.
    upstream = seeded(TopKRouter, moe_config(moe_expert_capacity_factor=0.25,
                                             moe_pad_expert_input_to_capacity=pad_to_capacity))
    upstream_probs, _ = upstream.routing(padded.gating(hidden), mask.transpose(0, 1))
    assert not torch.equal(upstream_probs[:8], doc_probs)


def test_aux_and_z_loss_ignore_padding(cpu_moe):
    tracker = get_moe_metrics_tracker()
    hidden, mask = _documents_and_padding()
    values = []
    for rows, padding in ((hidden, mask.transpose(0, 1)), (hidden[:8], None)):
        router = seeded(PackedTopKRouter, moe_config())
        router(rows, padding_mask=padding)
        values.append({name: entry.values[0].clone() for name, entry in tracker.metrics.items()})
        tracker.clear()
    assert set(values[0]) == {"load_balancing_loss", "z_loss"}
    for name in values[0]:
        torch.testing.assert_close(values[0][name], values[1][name])


def test_top1_pre_softmax_routing_leaves_padding_out(cpu_moe):
    # Switch-style top-1 routing (--moe-router-pre-softmax): one expert a document token,
    # weighted by its softmax over all experts; padding unrouted, no capacity taken.
    router = seeded(PackedTopKRouter, moe_config(moe_router_topk=1, moe_router_pre_softmax=True,
                                                 **DROP_AND_PAD))
    hidden, mask = _documents_and_padding()
    probs, routing_map = router(hidden, padding_mask=mask.transpose(0, 1))
    assert not probs[8:].any()
    weighted = routing_map & (probs > 0)
    assert (weighted.sum(dim=1)[:8] <= 1).all() and weighted[:8].sum() > 0
    assert (probs[:8].max(dim=1).values < 1).all()  # not renormalised over the one choice


def test_group_limited_routing_keeps_each_token_in_its_groups(cpu_moe):
    # 4 experts in 2 groups, each token routed within 1 group; padding as always.
    router = seeded(PackedTopKRouter, moe_config(moe_router_num_groups=2,
                                                 moe_router_group_topk=1))
    hidden, mask = _documents_and_padding()
    probs, routing_map = router(hidden, padding_mask=mask.transpose(0, 1))
    groups = routing_map[:8].view(8, 2, 2).any(dim=-1).sum(dim=-1)
    assert (groups == 1).all() and (routing_map[:8].sum(dim=1) == TOPK).all()
    assert not probs[8:].any()


@pytest.fixture
def expert_bias_on_cpu(monkeypatch):
    # megatron-core allocates the bias and its counts on the current CUDA device.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.mark.parametrize("capacity", [{}, DROP_AND_PAD])
def test_expert_bias_counts_the_documents_choices_only(cpu_moe, expert_bias_on_cpu, capacity):
    """Aux-loss-free balancing: tokens per expert count each document token's top-k choice
    (before any capacity drop), never the padding, and not outside training (no grad)."""
    config = moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        **capacity)
    hidden, mask = _documents_and_padding()
    padded, alone = seeded(PackedTopKRouter, config), seeded(PackedTopKRouter, config)
    padded(hidden, padding_mask=mask.transpose(0, 1))
    alone(hidden[:8])
    assert padded.local_tokens_per_expert.sum() == 8 * TOPK
    assert torch.equal(padded.local_tokens_per_expert, alone.local_tokens_per_expert)
    with torch.no_grad():
        padded(hidden, padding_mask=mask.transpose(0, 1))
    assert padded.local_tokens_per_expert.sum() == 8 * TOPK


def test_upstream_expert_bias_count_does_not_broadcast_a_flat_mask(cpu_moe, expert_bias_on_cpu):
    # Why PackedTopKRouter._apply_expert_bias reshapes the mask: megatron-core 0.19.2's
    # count fails on the flattened mask its own routing() hands it.
    upstream = seeded(TopKRouter, moe_config(moe_router_score_function="sigmoid",
                                             moe_router_enable_expert_bias=True))
    hidden, mask = _documents_and_padding()
    with pytest.raises(Exception, match="broadcast|size of tensor"):
        upstream(hidden, padding_mask=mask.transpose(0, 1))


def test_passes_that_are_not_trainings_leave_the_expert_bias_and_its_counts(cpu_moe,
                                                                            expert_bias_on_cpu):
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    from megatron.packed_model.moe import moe_accumulators_kept

    config = moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    layer = build_module(gpt_layer_spec("torch", num_experts=EXPERTS), config=config,
                         layer_number=1)
    router = layer.mlp.router
    hidden = torch.randn(16, 1, HIDDEN)
    router(hidden)
    before, bias = router.local_tokens_per_expert.clone(), router.expert_bias.clone()
    with moe_accumulators_kept([layer]):  # e.g. graph warm-up, or a rerun's first pass
        router(hidden)
        _update_router_expert_bias([layer], config)  # what finalize_model_grads does
        assert not torch.equal(router.expert_bias, bias)
    assert torch.equal(router.local_tokens_per_expert, before)
    assert torch.equal(router.expert_bias, bias)
    _update_router_expert_bias([layer], config)  # the step's own update: against the load
    loads = before - before.mean()
    assert torch.equal(torch.sign(router.expert_bias), -torch.sign(loads))


# ------------------------------------------------------------------------------ models

def _packed_params(num_documents_tokens=12, total=16):
    cu = torch.tensor([0, 5, num_documents_tokens, total], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(5), torch.arange(num_documents_tokens - 5),
                              torch.arange(total - num_documents_tokens)])
    params = build_packed_batch_params(cu, position_ids, total, with_seq_idx=False)
    params.padding_mask = torch.arange(total) >= num_documents_tokens
    return params


def test_gpt_moe_layer_builds_megatron_modules(cpu_moe):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    config = moe_config(moe_shared_expert_intermediate_size=16, **DROP_AND_PAD)
    layer = build_module(gpt_layer_spec("torch", num_experts=EXPERTS), config=config,
                         layer_number=1)
    assert isinstance(layer, GraphSafeMoELayer) and layer.is_moe_layer
    assert isinstance(layer.mlp, MoELayer) and isinstance(layer.mlp.router, PackedTopKRouter)
    assert isinstance(layer.mlp.experts, SequentialMLP)
    assert len(layer.mlp.experts.local_experts) == EXPERTS
    assert isinstance(layer.mlp.shared_experts, SharedExpertMLP)
    assert isinstance(layer.mlp.token_dispatcher, MoEAlltoAllTokenDispatcher)
    assert layer.mlp.token_dispatcher.drop_and_pad


def test_gpt_moe_model_forward_backward_on_cpu(cpu_moe):
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = moe_config(moe_shared_expert_intermediate_size=16, **DROP_AND_PAD)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec("torch",
                                                                          num_experts=EXPERTS),
                     # megatron-core's RoPE table is built on the CUDA device
                     vocab_size=64, max_sequence_length=16, position_embedding_type="none")
    params = _packed_params()
    tokens = torch.randint(1, 64, (1, 16))
    losses = model(tokens, params.position_ids.view(1, -1), None, labels=tokens,
                   packed_seq_params=params)
    losses.sum().backward()
    router = model.decoder.layers[0].mlp.router
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    expert = model.decoder.layers[0].mlp.experts.local_experts[0]
    assert expert.linear_fc1.weight.grad is not None
    # The aux loss was recorded for both layers, from the documents only.
    assert (get_moe_metrics_tracker().metrics["load_balancing_loss"].values > 0).all()


def test_gpt_with_a_dense_first_layer(cpu_moe):
    """--moe-layer-freq [0, 1]: the first layer keeps a dense MLP, the second is MoE; the
    model trains on a packed row and the aux loss is recorded for the MoE layer only."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron.packed_graphs.layers import GraphSafeTransformerLayer
    from megatron.packed_graphs.specs import gpt_decoder_spec, moe_layer_pattern

    assert moe_layer_pattern(2, 5) == [1, 0, 1, 0, 1] and moe_layer_pattern([0, 1], 2) == [0, 1]
    config = moe_config(moe_layer_freq=[0, 1], **DROP_AND_PAD)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=gpt_decoder_spec(
                         config, "torch", num_experts=EXPERTS),
                     vocab_size=64, max_sequence_length=16, position_embedding_type="none")
    dense, moe = model.decoder.layers
    assert type(dense) is GraphSafeTransformerLayer and type(dense.mlp) is MLP
    assert isinstance(moe, GraphSafeMoELayer) and isinstance(moe.mlp, MoELayer)
    params = _packed_params()
    tokens = torch.randint(1, 64, (1, 16))
    model(tokens, params.position_ids.view(1, -1), None, labels=tokens,
          packed_seq_params=params).sum().backward()
    assert dense.mlp.linear_fc1.weight.grad.abs().sum() > 0
    assert moe.mlp.router.weight.grad.abs().sum() > 0
    recorded = get_moe_metrics_tracker().metrics["load_balancing_loss"].values
    assert recorded[0] == 0 and recorded[1] > 0
    # Every layer MoE: the plain layer spec, as before.
    assert gpt_decoder_spec(moe_config(), "torch", num_experts=EXPERTS).module is GraphSafeMoELayer


def test_moe_layer_freq_slices_by_pipeline_stage(cpu_moe, monkeypatch):
    """PP = 2 x VPP = 2 over 8 layers: each (rank, virtual stage) builds its own layers of the
    --moe-layer-freq pattern, by megatron-core's layer offsets, and together they build the
    whole pattern once."""
    from megatron.core import parallel_state

    from megatron.packed_graphs.specs import gpt_decoder_spec, moe_layer_pattern

    pattern = [0, 1, 1, 0, 1, 0, 1, 1]
    config = moe_config(num_layers=8, moe_layer_freq=pattern, pipeline_model_parallel_size=2,
                        virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                        **DROP_AND_PAD)
    assert moe_layer_pattern(config.moe_layer_freq, 8) == pattern
    built = {}
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: rank)
        for stage in range(2):
            spec = gpt_decoder_spec(config, "torch", num_experts=EXPERTS, vp_stage=stage)
            kinds = [int(layer.module is GraphSafeMoELayer) for layer in spec.layer_specs]
            built[(rank, stage)] = kinds
    # Interleaved: stage 0 of ranks 0 and 1 hold layers 0-1 and 2-3; stage 1 layers 4-5, 6-7.
    assert built == {(0, 0): pattern[0:2], (1, 0): pattern[2:4],
                     (0, 1): pattern[4:6], (1, 1): pattern[6:8]}


def test_padding_does_not_change_the_documents_outputs(cpu_moe):
    """A layer's outputs on the documents do not depend on what the padding holds."""
    config = moe_config(**DROP_AND_PAD)
    torch.manual_seed(0)
    layer = build_module(gpt_layer_spec("torch", num_experts=EXPERTS), config=config,
                         layer_number=1)
    params = _packed_params()
    hidden = torch.randn(16, 1, HIDDEN)
    out, _ = layer(hidden, attention_mask=None, packed_seq_params=params)
    loud = hidden.clone()
    loud[12:] = 50 * torch.randn(4, 1, HIDDEN)
    out_loud, _ = layer(loud, attention_mask=None, packed_seq_params=params)
    torch.testing.assert_close(out[:12], out_loud[:12])


def test_hybrid_moe_model_forward_backward_on_cpu(cpu_moe):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    config = moe_config(num_layers=3, **DROP_AND_PAD)
    torch.manual_seed(0)
    model = HybridModel(config=config,
                        hybrid_stack_spec=hybrid_stack_spec("torch", num_experts=EXPERTS),
                        vocab_size=64, max_sequence_length=16, hybrid_layer_pattern="*E-",
                        position_embedding_type="none")
    moe_layer = model.decoder.layers[1]
    assert isinstance(moe_layer, GraphSafeMoELayer) and isinstance(moe_layer.mlp, MoELayer)
    assert isinstance(moe_layer.mlp.router, PackedTopKRouter)
    params = _packed_params()
    tokens = torch.randint(1, 64, (1, 16))
    losses = model(tokens, params.position_ids.view(1, -1), None, labels=tokens,
                   packed_seq_params=params)
    losses.sum().backward()
    assert moe_layer.mlp.router.weight.grad.abs().sum() > 0
    recorded = get_moe_metrics_tracker().metrics["load_balancing_loss"].values
    assert recorded[1] > 0 and recorded[0] == recorded[2] == 0  # layer 2 is the 'E' layer


# ------------------------------------------------------------------------ dropped token slots

def test_dropped_token_slots_are_counted_on_the_device(cpu_moe):
    """With a capacity, each router adds up its routed (padding excluded) and dropped token
    slots on the device; the logged value is their ratio, and reading zeroes the counts."""
    from megatron.packed_model.moe import read_dropped_token_fraction

    router = seeded(PackedTopKRouter, moe_config(moe_expert_capacity_factor=0.25,
                                                 moe_pad_expert_input_to_capacity=True))
    hidden, mask = _documents_and_padding()
    probs, routing_map = router(hidden, padding_mask=mask.transpose(0, 1))
    kept = int((routing_map & (probs != 0)).sum())
    assert 0 < kept < 8 * TOPK  # the capacity bites
    assert router.token_slots.tolist() == [8 * TOPK, 8 * TOPK - kept]  # never the padding
    router(hidden, padding_mask=mask.transpose(0, 1))  # a second micro-batch adds up
    model = torch.nn.ModuleList([router])
    # What the runtime's log reads at a log point (metrics.RuntimeLog).
    assert read_dropped_token_fraction([model]) == pytest.approx(1 - kept / (8 * TOPK))
    assert router.token_slots.tolist() == [0, 0]
    assert read_dropped_token_fraction([model]) == 0.0  # nothing routed since


def test_without_a_capacity_nothing_is_counted(cpu_moe):
    from megatron.packed_model.moe import read_dropped_token_fraction

    router = seeded(PackedTopKRouter, moe_config())
    hidden, mask = _documents_and_padding()
    router(hidden, padding_mask=mask.transpose(0, 1))
    assert router.token_slots.tolist() == [0, 0]
    assert read_dropped_token_fraction([router]) == 0.0
