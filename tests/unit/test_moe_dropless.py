"""Dropless MoE with static shapes (--moe-dropless-graphs), on CPU with megatron-core's modules.

* The layout: every routing of T tokens fits the static rows; groups are aligned, at least one
  unit, their ends non-decreasing; a token's slots are in expert order, an expert's in token
  order; padding takes no row; shapes never depend on the routing.
* The permutation and the unpermutation equal megatron-core's dropless ``permute`` /
  ``unpermute`` bit for bit (rows, probabilities, combined output).
* The pure-torch grouped GEMM equals a per-group matmul, gradients too.
* A whole MoE layer (router, shared expert, experts) equals megatron-core's dropless alltoall
  layer with SequentialMLP experts bit for bit: output, input gradient, router and expert
  weight gradients, aux and z losses; for SwiGLU, squared ReLU, GELU, top-1 on the input,
  group-limited and sigmoid routing with expert bias, padded packed rows.
* The experts start from the weights SequentialMLP would draw (same seed, same order).
* GPT and hybrid models build the layers from the fork's config field and train on CPU.
* The parse-time rules of --moe-dropless-graphs and --moe-router-skew; the skewed router.

megatron-core's dropless dispatcher moves token counts to the host on a CUDA side stream; the
``cpu_moe`` fixture makes that move the identity, so its dropless path runs on CPU.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from megatron.core.activations import squared_relu
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import permute, unpermute
from megatron.core.transformer.spec_utils import build_module

from megatron.packed_model.grouped_gemm import group_alignment, grouped_linear
from megatron.packed_model.moe_dropless import (
    DroplessMoELayer,
    StaticDroplessDispatcher,
    check_dropless_config,
    combine_rows,
    dispatch_rows,
    dropless_layout,
    static_rows,
)
from megatron.packed_model.moe_experts import TorchGroupedMLP
from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_graphs.specs import gpt_layer_spec, hybrid_stack_spec
from megatron.packed_training.config import PackedTransformerConfig
from tests.unit.conftest import tiny_moe_config

HIDDEN, EXPERTS, TOPK = 32, 4, 2


def config(**overrides):
    return tiny_moe_config(PackedTransformerConfig, **(dict(
        num_layers=1, hidden_size=HIDDEN, num_moe_experts=EXPERTS, moe_router_topk=TOPK)
        | overrides))


def random_map(tokens, experts, topk, padding=0, seed=0, hot=None):
    """A top-k routing map; the last ``padding`` rows route nowhere; ``hot``: every token picks
    expert ``hot`` (an unbalanced map)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=generator)
    if hot is not None:
        scores[:, hot] += 2
    chosen = torch.topk(scores, topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    routing_map[tokens - padding:] = False
    return routing_map


# ---------------------------------------------------------------------------------- the layout

@pytest.mark.parametrize("alignment", [1, 4, 8])
@pytest.mark.parametrize("case", ["balanced", "one hot expert", "padding", "idle experts"])
def test_every_routing_fits_the_static_rows(alignment, case):
    tokens, experts, topk = 37, 6, 2
    routing_map = {"balanced": random_map(tokens, experts, topk),
                   "one hot expert": random_map(tokens, experts, topk, hot=3),
                   "padding": random_map(tokens, experts, topk, padding=20),
                   "idle experts": random_map(tokens, experts, topk) & (torch.arange(6) < 2)}[case]
    layout = dropless_layout(routing_map, topk, alignment)
    rows = static_rows(tokens, topk, experts, alignment)
    ends = layout.group_sizes.cumsum(0)
    assert layout.num_rows == rows and rows % alignment == 0
    assert (layout.group_sizes % alignment == 0).all() and (layout.group_sizes >= alignment).all()
    assert (layout.group_sizes >= routing_map.sum(0)).all()
    assert (ends[1:] >= ends[:-1]).all() and ends[-1] < rows  # the spare row stays free
    # Every routed slot has its own row inside its expert's group, in token order.
    starts = ends - layout.group_sizes
    for e in range(experts):
        token_of_rows = [int(layout.row_slots[r]) // topk
                         for r in range(int(starts[e]), int(ends[e]))
                         if layout.row_slots[r] < tokens * topk]
        assert token_of_rows == routing_map[:, e].nonzero().view(-1).tolist()
    # A token's slots are its experts, ascending; padding tokens have none.
    for t in range(tokens):
        assert layout.slot_experts[t][layout.slot_valid[t]].tolist() == \
            routing_map[t].nonzero().view(-1).tolist()
    assert int(layout.slot_valid.sum()) == int(routing_map.sum())
    assert (layout.row_slots < tokens * topk).sum() == routing_map.sum()


def test_the_worst_case_takes_every_row_but_the_spare():
    # Every expert's count one past a multiple of the alignment: the most padding there is.
    tokens, experts, topk, alignment = 9, 3, 1, 4
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map[torch.arange(tokens), torch.arange(tokens) % experts] = True  # 3 tokens each
    layout = dropless_layout(routing_map, topk, alignment)
    assert layout.group_sizes.tolist() == [4, 4, 4]
    assert static_rows(tokens, topk, experts, alignment) == 24  # 9 + 3 x 4 + 1, aligned


def test_shapes_do_not_depend_on_the_routing():
    layouts = [dropless_layout(m, TOPK, 8) for m in (
        random_map(64, 8, TOPK), random_map(64, 8, TOPK, hot=0),
        random_map(64, 8, TOPK, padding=60))]
    for field in ("slot_rows", "slot_valid", "slot_experts", "row_slots", "group_sizes"):
        assert len({getattr(layout, field).shape for layout in layouts}) == 1, field


def test_the_layout_reads_nothing_on_the_host(monkeypatch):
    """Dispatch, layout and combine use device ops only: any host conversion of a tensor
    (what would sync with a GPU) raises here."""
    routing_map = random_map(40, EXPERTS, TOPK, padding=5)
    hidden = torch.randn(40, HIDDEN, requires_grad=True)
    probs = torch.rand(40, EXPERTS, requires_grad=True)

    def host_read(*args, **kwargs):
        raise AssertionError("host read of a tensor")

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                 "nonzero", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    layout = dropless_layout(routing_map, TOPK, 4)
    rows, row_probs = dispatch_rows(hidden, probs, layout)
    out = combine_rows(rows * row_probs.unsqueeze(-1), layout)
    out.sum().backward()
    monkeypatch.undo()
    assert hidden.grad.shape == hidden.shape and probs.grad.shape == probs.shape


# --------------------------------------------------------- against megatron-core's permutation

def _megatron_permutation(hidden, probs, routing_map):
    count = int(routing_map.sum())
    permuted, permuted_probs, sorted_indices, _, _ = permute(
        hidden, routing_map, probs=probs, num_out_tokens=count)
    return permuted, permuted_probs, sorted_indices


@pytest.mark.parametrize("padding", [0, 11])
def test_dispatch_equals_megatron_permute(padding):
    routing_map = random_map(50, EXPERTS, TOPK, padding=padding, seed=3)
    hidden, probs = torch.randn(50, HIDDEN), torch.rand(50, EXPERTS)
    layout = dropless_layout(routing_map, TOPK, 4)
    rows, row_probs = dispatch_rows(hidden, probs, layout)
    expected, expected_probs, _ = _megatron_permutation(hidden, probs, routing_map)
    real = layout.row_slots < 50 * TOPK
    # The routed rows, in order, are megatron-core's permuted rows; every other row is zero.
    assert torch.equal(rows[real], expected) and torch.equal(row_probs[real], expected_probs)
    assert not rows[~real].any() and not row_probs[~real].any()


def test_combine_equals_megatron_unpermute():
    routing_map = random_map(50, EXPERTS, TOPK, padding=7, seed=4)
    hidden, probs = torch.randn(50, HIDDEN), torch.rand(50, EXPERTS)
    layout = dropless_layout(routing_map, TOPK, 4)
    _, _, sorted_indices = _megatron_permutation(hidden, probs, routing_map)
    expert_rows = torch.randn(int(routing_map.sum()), HIDDEN)  # what the experts returned
    ours = torch.full((layout.num_rows, HIDDEN), float("nan"))  # unwritten rows: any value
    ours[layout.row_slots < 50 * TOPK] = expert_rows
    expected = unpermute(expert_rows, sorted_indices, restore_shape=hidden.shape,
                         routing_map=routing_map)
    assert torch.equal(combine_rows(ours, layout), expected)


def test_dispatch_gradient_adds_each_tokens_rows_in_expert_order():
    routing_map = random_map(30, EXPERTS, TOPK, padding=4, seed=5)
    hidden = torch.randn(30, HIDDEN, requires_grad=True)
    reference = hidden.detach().clone().requires_grad_()
    probs = torch.rand(30, EXPERTS)
    layout = dropless_layout(routing_map, TOPK, 4)
    rows, _ = dispatch_rows(hidden, probs, layout)
    grad_rows = torch.randn_like(rows)
    rows.backward(grad_rows)
    permuted, _, _ = _megatron_permutation(reference, probs, routing_map)
    permuted.backward(grad_rows[layout.row_slots < 30 * TOPK])
    assert torch.equal(hidden.grad, reference.grad)
    assert not hidden.grad[26:].any()  # padding: routed nowhere


def test_combine_gradient_is_each_rows_token_gradient():
    """The combine's backward (a gather, no atomics): a routed row gets its token's gradient,
    as megatron-core's unpermutation backward gives it; every other row (alignment padding,
    the spare row unrouted slots point at) gets zero, whatever the row held."""
    routing_map = random_map(40, EXPERTS, TOPK, padding=6, seed=6)
    hidden, probs = torch.randn(40, HIDDEN), torch.rand(40, EXPERTS)
    layout = dropless_layout(routing_map, TOPK, 4)
    _, _, sorted_indices = _megatron_permutation(hidden, probs, routing_map)
    real = layout.row_slots < 40 * TOPK
    expert_rows = torch.randn(int(routing_map.sum()), HIDDEN, requires_grad=True)
    ours = torch.full((layout.num_rows, HIDDEN), float("nan"))
    ours[real] = expert_rows.detach()
    ours.requires_grad_()
    grad = torch.randn(40, HIDDEN)
    combine_rows(ours, layout).backward(grad)
    unpermute(expert_rows, sorted_indices, restore_shape=hidden.shape,
              routing_map=routing_map).backward(grad)
    assert torch.equal(ours.grad[real], expert_rows.grad)
    assert torch.equal(ours.grad[~real], torch.zeros_like(ours.grad[~real]))


# ------------------------------------------------------------------------------ grouped GEMM

def test_reference_grouped_gemm_is_a_per_group_matmul():
    x = torch.randn(20, 8, requires_grad=True)
    weight = torch.randn(3, 6, 8, requires_grad=True)
    offsets = torch.tensor([4, 4, 16], dtype=torch.int32)  # an empty group; rows 16-19 unused
    out = grouped_linear(x, weight, offsets)
    assert torch.equal(out[:4], x[:4] @ weight[0].t())
    assert torch.equal(out[4:16], x[4:16] @ weight[2].t())
    assert not out[16:].any()
    out.sum().backward()
    assert not weight.grad[1].any() and not x.grad[16:].any()
    torch.testing.assert_close(weight.grad[2], torch.ones(12, 6).t() @ x[4:16].detach())


@pytest.mark.parametrize("bad", ["int64 offsets", "offset count", "weight layout"])
def test_grouped_gemm_names_wrong_operands(bad):
    x, weight = torch.randn(8, 4), torch.randn(2, 3, 4)
    offsets = torch.tensor([4, 8], dtype=torch.int32)
    if bad == "int64 offsets":
        offsets = offsets.long()
    elif bad == "offset count":
        offsets = offsets[:1]
    else:
        weight = weight.transpose(1, 2)
    with pytest.raises(ValueError, match="grouped GEMM (offsets|operands) are wrong"):
        grouped_linear(x, weight, offsets)


def test_group_alignment_is_16_bytes():
    assert group_alignment(torch.bfloat16) == 8 and group_alignment(torch.float32) == 4


# --------------------------------------------------------------------- the layer vs megatron

ACTIVATIONS = {
    "swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
    "squared relu": dict(gated_linear_unit=False, activation_func=squared_relu),
    "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),
}
ROUTERS = {
    "softmax": {},
    "sigmoid with expert bias": dict(moe_router_score_function="sigmoid",
                                     moe_router_enable_expert_bias=True),
    "group limited": dict(moe_router_num_groups=2, moe_router_group_topk=1),
    "top-1 on the input": dict(moe_router_topk=1, moe_apply_probs_on_input=True,
                               moe_router_pre_softmax=True),
    "shared expert": dict(moe_shared_expert_intermediate_size=16),
}


@pytest.fixture
def expert_bias_on_cpu(monkeypatch):
    # megatron-core allocates the expert bias and its counts on the current CUDA device.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def _layers(**overrides):
    """megatron-core's dropless GPT MoE layer and the static one, from the same seed."""
    torch.manual_seed(0)
    upstream = build_module(gpt_layer_spec("torch", num_experts=EXPERTS),
                            config=config(**overrides), layer_number=1)
    torch.manual_seed(0)
    ours = build_module(gpt_layer_spec("torch", num_experts=EXPERTS),
                        config=config(moe_dropless_graphs=True, **overrides), layer_number=1)
    return upstream, ours


def _stacked(experts, linear):
    return torch.stack([getattr(e, linear).weight for e in experts.local_experts])


def _stacked_grad(experts, linear):
    return torch.stack([getattr(e, linear).weight.grad for e in experts.local_experts])


def _run(layer, hidden, grad, mask=None):
    """Forward and backward of ``layer``'s MoE part: (output, input grad, router weight grad,
    the aux/z losses it recorded)."""
    x = hidden.clone().requires_grad_()
    out, _ = layer.mlp(x, padding_mask=mask)
    out.backward(grad)
    losses = {name: entry.values.clone()
              for name, entry in get_moe_metrics_tracker().metrics.items()}
    get_moe_metrics_tracker().clear()
    return out, x.grad, layer.mlp.router.weight.grad, losses


@pytest.fixture
def unaligned_groups(monkeypatch):
    """Groups of exactly their tokens (alignment 1): each expert's matmul then has the shape of
    SequentialMLP's, and a CPU matmul's last bits can depend on its row count."""
    from megatron.packed_model import moe_dropless

    monkeypatch.setattr(moe_dropless, "group_alignment", lambda dtype: 1)


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_layer_equals_megatron_dropless_bit_for_bit(cpu_moe, expert_bias_on_cpu,
                                                    unaligned_groups, activation, router):
    """Without padding and with unaligned groups every expert multiplies the rows SequentialMLP
    multiplies: the same bits. (With a padding tail megatron-core routes the padding at
    probability zero, so its experts multiply more rows: below, to rounding.)"""
    upstream, ours = _layers(**ACTIVATIONS[activation], **ROUTERS[router])
    assert isinstance(ours.mlp, DroplessMoELayer)
    assert isinstance(ours.mlp.experts, TorchGroupedMLP)
    assert isinstance(ours.mlp.token_dispatcher, StaticDroplessDispatcher)
    assert not upstream.mlp.token_dispatcher.drop_and_pad  # megatron-core's dropless path
    # The experts draw what SequentialMLP draws: same seed, same weights.
    assert torch.equal(ours.mlp.experts.fc1_weight, _stacked(upstream.mlp.experts, "linear_fc1"))
    assert torch.equal(ours.mlp.experts.fc2_weight, _stacked(upstream.mlp.experts, "linear_fc2"))
    torch.manual_seed(1)
    hidden, grad = torch.randn(48, 1, HIDDEN), torch.randn(48, 1, HIDDEN)
    out, dx, drouter, losses = _run(upstream, hidden, grad)
    our_out, our_dx, our_drouter, our_losses = _run(ours, hidden, grad)
    assert torch.equal(our_out, out) and torch.equal(our_dx, dx)
    assert torch.equal(our_drouter, drouter)
    assert torch.equal(ours.mlp.experts.fc1_weight.grad,
                       _stacked_grad(upstream.mlp.experts, "linear_fc1"))
    assert torch.equal(ours.mlp.experts.fc2_weight.grad,
                       _stacked_grad(upstream.mlp.experts, "linear_fc2"))
    assert our_losses.keys() == losses.keys() and losses
    for name in losses:
        assert torch.equal(our_losses[name], losses[name]), name
    if ours.mlp.shared_experts is not None:
        assert ours.mlp.shared_experts.linear_fc1.weight.grad is not None


@pytest.mark.parametrize("router", ["softmax", "sigmoid with expert bias"])
def test_a_padded_row_computes_its_documents_as_megatron_does(cpu_moe, expert_bias_on_cpu,
                                                               router):
    """A packed row with a padding tail: padding is routed nowhere (zero output, zero
    gradient); the documents get megatron-core's dropless results, and exactly what the
    documents alone get from the same layer (the same rows per expert)."""
    upstream, ours = _layers(**ROUTERS[router])
    torch.manual_seed(1)
    hidden, grad = torch.randn(48, 1, HIDDEN), torch.randn(48, 1, HIDDEN)
    grad[40:] = 0  # no loss on padding
    mask = (torch.arange(48) >= 40).view(1, -1)
    out, dx, drouter, losses = _run(upstream, hidden, grad, mask)
    our_out, our_dx, our_drouter, our_losses = _run(ours, hidden, grad, mask)
    assert not our_out[40:].any() and not our_dx[40:].any()
    torch.testing.assert_close(our_out, out, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(our_dx, dx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(our_drouter, drouter, rtol=1e-5, atol=1e-7)
    for name in losses:
        torch.testing.assert_close(our_losses[name], losses[name])
    ours.mlp.router.weight.grad = None
    alone, alone_dx, _, _ = _run(ours, hidden[:40], grad[:40])
    assert torch.equal(our_out[:40], alone) and torch.equal(our_dx[:40], alone_dx)


def test_padding_takes_no_rows_and_no_compute(cpu_moe):
    _, ours = _layers()
    hidden = torch.randn(48, 1, HIDDEN)
    mask = (torch.arange(48) >= 10).view(1, -1)
    ours.mlp(hidden, padding_mask=mask)
    probs, routing_map = ours.mlp.route(hidden, mask.transpose(0, 1))
    assert not routing_map[10:].any() and routing_map[:10].sum() == 10 * TOPK
    layout = dropless_layout(routing_map, TOPK, group_alignment(hidden.dtype))
    # 20 routed rows padded to 4 groups of 4 at least: the grouped GEMM computes <= 32 rows.
    assert int(layout.group_sizes.sum()) <= 10 * TOPK + EXPERTS * 4


def test_the_tail_rows_of_the_grouped_gemm_never_reach_a_result(cpu_moe, monkeypatch):
    """torch's grouped GEMM leaves the rows past the last group unwritten (on the GPU they
    hold whatever the memory held): here they are NaN, and output and gradients stay exact."""
    from megatron.packed_model import moe_experts

    def with_nan_tail(x, weight, offsets):
        out = grouped_linear(x, weight, offsets)
        rows = torch.arange(out.shape[0]).unsqueeze(-1)
        return torch.where(rows < offsets[-1], out, float("nan"))

    _, ours = _layers()
    hidden, grad = torch.randn(24, 1, HIDDEN), torch.randn(24, 1, HIDDEN)
    mask = (torch.arange(24) >= 20).view(1, -1)
    expected = _run(ours, hidden, grad, mask)
    expected_grads = [w.grad.clone() for w in (ours.mlp.experts.fc1_weight,
                                               ours.mlp.experts.fc2_weight)]
    ours.zero_grad()
    monkeypatch.setattr(moe_experts, "grouped_linear", with_nan_tail)
    got = _run(ours, hidden, grad, mask)
    for value, reference in zip(got[:3], expected[:3]):
        assert torch.equal(value, reference)
    assert torch.equal(ours.mlp.experts.fc1_weight.grad, expected_grads[0])
    assert torch.equal(ours.mlp.experts.fc2_weight.grad, expected_grads[1])


def test_grouped_gemm_experts_draw_in_te_grouped_order():
    """With TE's grouped GEMM the experts stand in for TEGroupedMLP, which draws every expert's
    fc1 before any fc2."""
    torch.manual_seed(0)
    experts = TorchGroupedMLP(3, config(), init_order="per_linear")
    torch.manual_seed(0)
    drawn = []
    for shape, init in [((32, HIDDEN), config().init_method)] * 3 + \
                       [((HIDDEN, 16), config().output_layer_init_method)] * 3:
        master = torch.empty(shape)
        init(master)
        drawn.append(master)
    assert torch.equal(experts.fc1_weight, torch.stack(drawn[:3]))
    assert torch.equal(experts.fc2_weight, torch.stack(drawn[3:]))


def test_expert_weights_carry_megatrons_parallel_attributes():
    experts = TorchGroupedMLP(2, config())
    assert experts.fc1_weight.allreduce and experts.fc2_weight.allreduce  # EP 1, ETP = TP
    assert (experts.fc1_weight.partition_dim, experts.fc1_weight.partition_stride) == (1, 2)
    assert experts.fc2_weight.partition_dim == 2 and experts.fc2_weight.tensor_model_parallel
    folded = TorchGroupedMLP(2, config(tensor_model_parallel_size=2, sequence_parallel=True,
                                       expert_tensor_parallel_size=1))
    assert not folded.fc1_weight.allreduce  # reduced over the expert data-parallel group


# ---------------------------------------------------------------------------------- models

def _packed(total=16, documents=12):
    cu = torch.tensor([0, 5, documents, total], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(5), torch.arange(documents - 5),
                              torch.arange(total - documents)])
    params = build_packed_batch_params(cu, position_ids, total, with_seq_idx=False)
    params.padding_mask = torch.arange(total) >= documents
    return params


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_models_build_dropless_layers_from_the_config_and_train(cpu_moe, kind):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    losses = []
    for dropless_graphs in (False, True):
        cfg = config(num_layers=2 if kind == "gpt" else 3, moe_dropless_graphs=dropless_graphs)
        torch.manual_seed(0)
        if kind == "gpt":
            model = GPTModel(config=cfg, transformer_layer_spec=gpt_layer_spec(
                "torch", num_experts=EXPERTS), vocab_size=64, max_sequence_length=16,
                position_embedding_type="none")
        else:
            model = HybridModel(config=cfg, hybrid_stack_spec=hybrid_stack_spec(
                "torch", num_experts=EXPERTS), vocab_size=64, max_sequence_length=16,
                hybrid_layer_pattern="*E-", position_embedding_type="none")
        moe_layers = [m for m in model.modules() if hasattr(m, "token_dispatcher")]
        assert moe_layers and all(isinstance(m, DroplessMoELayer) == dropless_graphs
                                  for m in moe_layers)
        params = _packed()
        tokens = torch.randint(1, 64, (1, 16), generator=torch.Generator().manual_seed(2))
        loss = model(tokens, params.position_ids.view(1, -1), None, labels=tokens,
                     packed_seq_params=params)
        loss.sum().backward()
        losses.append(loss.detach())
        grads = [m.mlp.experts.fc1_weight.grad if dropless_graphs
                 else m.mlp.experts.local_experts[0].linear_fc1.weight.grad
                 for m in model.modules() if hasattr(m, "mlp") and hasattr(m.mlp, "experts")]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
        get_moe_metrics_tracker().clear()
    # megatron-core's dropless path (its experts also multiply the padding tail's rows).
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)


# ------------------------------------------------------------------- refused configurations

@pytest.mark.parametrize("field,value,fix", [
    ("moe_expert_capacity_factor", 1.0, "route without a capacity: drop it"),
    ("moe_token_dispatcher_type", "allgather", "use --moe-token-dispatcher-type alltoall"),
    ("expert_tensor_parallel_size", 2, "add --expert-tensor-parallel-size 1"),
    ("moe_shared_expert_overlap", True, "no token exchange to overlap with: drop it"),
    ("moe_latent_size", 16, "Not supported with dropless MoE graphs: drop it"),
])
def test_the_layer_refuses_what_it_does_not_run(field, value, fix):
    """The parse-time rules that a TransformerConfig can answer (one table), with their flag."""
    cfg = copy.copy(config())
    setattr(cfg, field, value)
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag} is wrong: {value}. .*{fix}"):
        check_dropless_config(cfg)


@pytest.mark.parametrize("overrides, message", [
    ({"add_bias_linear": True}, "--disable-bias-linear is wrong: False.*no biases"),
    ({"use_te_activation_func": True}, "--use-te-activation-func is wrong: True"),
])
def test_the_experts_refuse_what_they_do_not_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        TorchGroupedMLP(2, config(**overrides))


# --------------------------------------------------------- the log's count; skewed routers

def test_dropless_graph_routers_count_routed_slots_and_drop_none(cpu_moe):
    from megatron.packed_model.moe import read_dropped_token_fraction

    _, ours = _layers()
    hidden = torch.randn(24, 1, HIDDEN)
    ours.mlp(hidden, padding_mask=(torch.arange(24) >= 20).view(1, -1))
    assert ours.mlp.router.token_slots.tolist() == [20 * TOPK, 0]  # documents only
    assert read_dropped_token_fraction([ours]) == 0.0
    assert ours.mlp.router.token_slots.tolist() == [0, 0]


@pytest.mark.parametrize("experts,topk", [(64, 8), (16, 2)])
def test_a_skewed_router_sends_about_the_fraction_to_the_first_eighth(cpu_moe, experts, topk):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron.packed_model.moe import PackedTopKRouter, hot_experts

    torch.manual_seed(0)
    cfg = config(hidden_size=256, num_moe_experts=experts, moe_router_topk=topk,
                 moe_router_skew=0.5)
    router = PackedTopKRouter(config=cfg, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    hot = hot_experts(experts)
    assert router.logit_skew[:hot].gt(0).all() and not router.logit_skew[hot:].any()
    hidden = torch.randn(4096, 1, 256)  # unit RMS, as the pre-MLP norm hands it over
    _, routing_map = router(hidden)
    share = routing_map[:, :hot].sum() / routing_map.sum()
    assert abs(float(share) - 0.5) < 0.05, float(share)
    plain = PackedTopKRouter(config=config(hidden_size=256, num_moe_experts=experts,
                                           moe_router_topk=topk),
                             pg_collection=get_default_pg_collection())
    assert plain.logit_skew is None


def test_a_skew_out_of_reach_is_refused():
    from megatron.packed_model.moe import skew_logit_bias

    with pytest.raises(ValueError, match=r"--moe-router-skew is wrong: 0.9. .* \(0, 0.5\)"):
        skew_logit_bias(8, 2, 0.9, 1.0)  # one hot expert: at most 1 of a token's 2 slots


# ------------------------------------------------------------- expert parallelism, one process

@pytest.mark.parametrize("alignment", [1, 4])
def test_the_expert_parallel_exchange_gives_each_expert_its_ep1_rows(alignment):
    """Two ranks' send layouts, the all-to-all done by hand (block s of rank r goes to rank s
    as its block r) and each rank's regrouping: every expert gets the rows an expert-parallel-
    size-1 layout of both ranks' tokens gives it, in the same order, and the way back
    combines every token as that layout does."""
    from megatron.packed_model.moe_dropless import receive_groups, send_capacity, send_layout

    ep, experts, topk, tokens = 2, 8, 3, 20
    maps = [random_map(tokens, experts, topk, padding=3, seed=7),
            random_map(tokens, experts, topk, hot=5, seed=8)]
    hidden = [torch.randn(tokens, HIDDEN) for _ in maps]
    probs = [torch.rand(tokens, experts) for _ in maps]
    capacity = send_capacity(tokens, topk, experts // ep)
    layouts = [send_layout(m, topk, ep) for m in maps]
    sent = [dispatch_rows(h, p, layout) for h, p, layout in zip(hidden, probs, layouts)]
    assert all(rows.shape[0] == ep * capacity + 1 for rows, _ in sent)
    reference = dropless_layout(torch.cat(maps), topk, alignment)
    ref_rows, ref_probs = dispatch_rows(torch.cat(hidden), torch.cat(probs), reference)
    ref_ends = reference.group_sizes.cumsum(0)
    returned = [torch.zeros(ep * capacity, HIDDEN) for _ in maps]
    for rank in range(ep):
        experts_here = slice(rank * experts // ep, (rank + 1) * experts // ep)
        counts = torch.stack([layout.group_sizes.view(ep, -1)[rank] for layout in layouts])
        received = torch.cat([rows[rank * capacity:(rank + 1) * capacity] for rows, _ in sent])
        received_probs = torch.cat([p[rank * capacity:(rank + 1) * capacity] for _, p in sent])
        groups = receive_groups(counts, capacity, alignment)
        zero = torch.zeros(1, HIDDEN)
        rows = torch.cat([received, zero]).index_select(0, groups.source_rows)
        row_probs = torch.cat([received_probs, torch.zeros(1)]).index_select(
            0, groups.source_rows)
        # Each local expert's group: the EP=1 group of that expert, row for row.
        ends = groups.group_sizes.cumsum(0)
        for local, e in enumerate(range(experts)[experts_here]):
            real = int(torch.cat(maps)[:, e].sum())
            ours = slice(int(ends[local] - groups.group_sizes[local]),
                         int(ends[local] - groups.group_sizes[local]) + real)
            theirs = slice(int(ref_ends[e] - reference.group_sizes[e]),
                           int(ref_ends[e] - reference.group_sizes[e]) + real)
            assert torch.equal(rows[ours], ref_rows[theirs])
            assert torch.equal(row_probs[ours], ref_probs[theirs])
            assert groups.group_sizes[local] == reference.group_sizes[e]
        # Experts "compute" (scale rows by their probability); the way back.
        out = rows * row_probs.unsqueeze(-1)
        back = torch.where(groups.received.unsqueeze(-1),
                           out.index_select(0, groups.expert_rows), 0)
        for source in range(ep):
            returned[source][rank * capacity:(rank + 1) * capacity] = \
                back[source * capacity:(source + 1) * capacity]
    combined = [combine_rows(torch.cat([r, torch.zeros(1, HIDDEN)]), layout)
                for r, layout in zip(returned, layouts)]
    expected = combine_rows(ref_rows * ref_probs.unsqueeze(-1), reference)
    assert torch.equal(torch.cat(combined), expected)


def test_the_exchange_reads_nothing_on_the_host(monkeypatch):
    from megatron.packed_model.moe_dropless import receive_groups, send_layout

    routing_map = random_map(16, 8, 2, padding=2)
    counts = torch.tensor([[3, 0, 5, 1], [2, 2, 0, 7]])

    def host_read(*args, **kwargs):
        raise AssertionError("host read of a tensor")

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    layout = send_layout(routing_map, 2, 2)
    groups = receive_groups(counts, 16, 4)
    monkeypatch.undo()
    assert layout.num_rows == 2 * 16 * 2 + 1
    assert groups.group_sizes.tolist() == [8, 4, 8, 8] and int(groups.received.sum()) == 20


@pytest.mark.slow
def test_an_expert_parallel_layer_computes_what_one_rank_computes(cpu_moe, unaligned_groups,
                                                                   tmp_path):
    """EP = 2 on two CPU processes (gloo): each rank's output, input gradient and its experts'
    weight gradients equal, bit for bit, those of an EP = 1 layer over both ranks' tokens
    with the same weights; the ranks' router gradients add up to its router gradient."""
    import torch.multiprocessing as mp

    from tests.unit import moe_dropless_ep_worker

    experts, topk, tokens = 8, 3, 24
    _, reference = _layers(num_moe_experts=experts, moe_router_topk=topk,
                           moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    torch.manual_seed(3)
    hidden, grad = torch.randn(2 * tokens, 1, HIDDEN), torch.randn(2 * tokens, 1, HIDDEN)
    mask = (torch.arange(2 * tokens) % tokens >= tokens - 4).view(1, -1)  # each rank pads 4
    grad[mask.view(-1)] = 0
    torch.save({"experts": experts, "topk": topk, "tokens": tokens, "hidden": hidden,
                "grad": grad, "mask": mask, "router": reference.mlp.router.weight.detach(),
                "fc1": reference.mlp.experts.fc1_weight.detach(),
                "fc2": reference.mlp.experts.fc2_weight.detach()}, tmp_path / "inputs.pt")
    mp.spawn(moe_dropless_ep_worker.run, nprocs=2, args=(
        str(tmp_path / "store"), str(tmp_path / "inputs.pt"), str(tmp_path)))
    out, dx, drouter, _ = _run(reference, hidden, grad, mask)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert torch.equal(torch.cat([r["out"] for r in ranks]), out)
    assert torch.equal(torch.cat([r["dx"] for r in ranks]), dx)
    assert torch.equal(torch.cat([r["fc1"] for r in ranks]), reference.mlp.experts.fc1_weight.grad)
    assert torch.equal(torch.cat([r["fc2"] for r in ranks]), reference.mlp.experts.fc2_weight.grad)
    torch.testing.assert_close(ranks[0]["router"] + ranks[1]["router"], drouter)
    assert not ranks[0]["allreduce"]  # expert weights reduce over expert data parallelism
    # The checkpoint: each rank's half of the experts at its place in the layer's tensor.
    assert [r["checkpoint"] for r in ranks] == [
        ((experts, 32, HIDDEN), (0, 0, 0)), ((experts, 32, HIDDEN), (experts // 2, 0, 0))]


# -------------------------------------------------------------------------------- checkpoints

def test_the_experts_checkpoint_as_all_experts_of_the_layer(cpu_moe):
    """One tensor per linear with every expert of the layer under SequentialMLP's key (this
    rank's at their global index; EP = 2: tests the worker's ranks below), the layer axis
    first; the layout against SequentialMLP's: test_moe_experts_checkpoint.py."""
    _, ours = _layers()
    experts = ours.mlp.experts
    sharded = experts.sharded_state_dict(prefix="layers.mlp.experts.",
                                         sharded_offsets=((0, 1, 4),))  # layer 1 of 4
    fc1 = sharded["layers.mlp.experts.fc1_weight"]
    assert fc1.key == "layers.mlp.experts.experts.linear_fc1.weight"
    assert fc1.data is experts.fc1_weight
    assert fc1.global_shape == (4, EXPERTS, 32, HIDDEN) and fc1.global_offset == (1, 0, 0, 0)
    assert fc1.replica_id == (0, 0, 0)
    assert sharded["layers.mlp.experts.fc2_weight"].global_shape == (4, EXPERTS, HIDDEN, 16)
