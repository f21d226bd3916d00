"""TE layer graphs (te_graphs.py): static packed inputs and capture options, on CPU."""

import pytest
import torch

from megatron.packed_graphs.capacity import pad_cu_seqlens
from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_upstream.graph_engine import te_layer_capture_keywords
from megatron.packed_graphs.te_graphs import PackedGraphInputs, graph_kwargs


def _params(lengths, capacity=8, seq_idx=True):
    cu = pad_cu_seqlens(torch.tensor([0] + lengths).cumsum(0).to(torch.int32), capacity)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return build_packed_batch_params(cu, positions, sum(lengths), with_seq_idx=seq_idx)


def test_load_copies_into_the_shared_buffers_and_points_params_at_them():
    inputs = PackedGraphInputs.like(_params([10, 6]))
    assert set(inputs.buffers) == {"cu_seqlens", "position_ids", "seq_idx"}
    before = {k: v.data_ptr() for k, v in inputs.buffers.items()}
    new = _params([3, 3, 10])
    loaded = inputs.load(new)
    assert {k: v.data_ptr() for k, v in inputs.buffers.items()} == before
    assert loaded.cu_seqlens_q is inputs.buffers["cu_seqlens"] is loaded.cu_seqlens_kv
    assert loaded.seq_idx is inputs.buffers["seq_idx"]
    assert torch.equal(loaded.cu_seqlens_q, new.cu_seqlens_q)
    assert torch.equal(loaded.seq_idx, new.seq_idx)
    assert loaded.max_seqlen_q == loaded.max_seqlen_kv == 16
    assert loaded.cu_seqlens_q_padded is None


def test_graph_kwargs_round_trip_through_params():
    inputs = PackedGraphInputs.like(_params([10, 6], seq_idx=False))
    params = inputs.params(inputs.buffers)
    rope = torch.zeros(16, 1, 1, 8)
    kwargs = graph_kwargs(params, rope)
    assert set(kwargs) == {"cu_seqlens", "position_ids", "rotary_pos_emb"}
    assert kwargs["rotary_pos_emb"] is rope
    tensors = {k: v for k, v in kwargs.items() if k != "rotary_pos_emb"}
    again = inputs.params(tensors)
    assert again.cu_seqlens_q is params.cu_seqlens_q and again.position_ids is params.position_ids


@pytest.mark.parametrize("other,message", [
    (_params([10, 6], capacity=4), r"\{'cu_seqlens': \(5,\), .* do not match the captured "
                                   r"\{'cu_seqlens': \(9,\)"),
    (_params([10, 6], seq_idx=False), r"'position_ids': \(16,\)\} do not match .*'seq_idx'"),
    (_params([10, 7]), "max_seqlen 17 differs from the captured 16"),
])
def test_load_refuses_another_layout(other, message):
    inputs = PackedGraphInputs.like(_params([10, 6]))
    with pytest.raises(ValueError, match=message):
        inputs.load(other)


def test_graph_kwargs_need_self_attention_params():
    params = _params([4, 4])
    params.cu_seqlens_kv = params.cu_seqlens_q.clone()
    with pytest.raises(ValueError, match="self-attention params"):
        graph_kwargs(params, None)


def test_cp_params_keep_one_boundary_tensor():
    """With CP the padded boundaries are the cu_seqlens tensor itself: one graph input, and
    params rebuilt from the buffers keep them one tensor (TE: no padding between docs)."""
    params = _params([12, 4], seq_idx=False)
    params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = params.cu_seqlens_q
    inputs = PackedGraphInputs.like(params)
    assert set(inputs.buffers) == {"cu_seqlens", "position_ids"}
    loaded = inputs.load(params)
    assert loaded.cu_seqlens_q_padded is loaded.cu_seqlens_q is inputs.buffers["cu_seqlens"]
    assert set(graph_kwargs(loaded, None)) == {"cu_seqlens", "position_ids"}
    with pytest.raises(ValueError, match="do not match"):
        inputs.load(_params([12, 4], seq_idx=False))  # no padded boundaries: another layout


# ---------------------------------------------------------------- banks (dynamic CP)

def _cp_params(lengths, local_cp_size, group=None):
    params = _params(lengths, seq_idx=False)
    params.local_cp_size, params.cp_group = local_cp_size, group
    return params


def test_bank_inputs_carry_their_cp_choice_and_refuse_another():
    group = object()  # stands for a process group: compared by identity only
    inputs = PackedGraphInputs.like(_cp_params([10, 6], 2, group))
    rebuilt = inputs.params(inputs.buffers)
    assert (rebuilt.local_cp_size, rebuilt.cp_group) == (2, group)
    assert inputs.load(_cp_params([3, 13], 2, group)).cp_group is group
    with pytest.raises(ValueError, match="CP size 1 .* differs from the captured 2"):
        inputs.load(_cp_params([10, 6], 1))
    with pytest.raises(ValueError, match="CP size 2 .* differs from the captured 2"):
        inputs.load(_cp_params([10, 6], 2, object()))  # same size, another group


def test_layer_graphs_load_into_the_bank_of_the_micro_batch_cp_size():
    from megatron.packed_graphs.te_graphs import TELayerGraphs

    graphs = TELayerGraphs([torch.nn.Identity()], config=None, tokens_per_rank=16)
    assert not graphs.captured
    graphs.banks = {1: PackedGraphInputs.like(_cp_params([10, 6], 1)),
                    2: PackedGraphInputs.like(_cp_params([10, 6], 2))}
    loaded = graphs.load(2, _cp_params([8, 8], 2))
    assert loaded.cu_seqlens_q is graphs.banks[2].buffers["cu_seqlens"]
    assert graphs.captured
    with pytest.raises(ValueError, match=r"no graphs were captured for CP size 4 \(banks: \[1, 2\]\)"):
        graphs.load(4, _cp_params([8, 8], 4))


def test_replay_picks_the_bank_of_the_plan_cp_size():
    from megatron.packed_graphs.plan import Granularity, GraphKey, Mode, StepGraphPlan, running
    from megatron.packed_graphs.te_graphs import TEGraphDispatch

    class Layer(TEGraphDispatch):  # the dispatch under test; the banks' callables record calls
        cuda_graph_manual_hooks = []

    layer = Layer()
    layer._graph_inputs = [PackedGraphInputs.like(_cp_params([10, 6], size)) for size in (1, 2)]
    layer._graph_bank_sizes = [1, 2]
    layer.cuda_graphs = [lambda hidden, **kw: ("bank 0", kw), lambda hidden, **kw: ("bank 1", kw)]
    params = layer._graph_inputs[1].load(_cp_params([4, 12], 2))
    plan = lambda size: StepGraphPlan.graphed(Mode.REPLAY, GraphKey(Granularity.CP_BANK, 8, size))
    with running(plan(2)):
        name, kwargs = layer._te_cuda_graph_replay(torch.zeros(16, 1, 8), packed_seq_params=params)
        assert name == "bank 1"
        assert kwargs["cu_seqlens"] is layer._graph_inputs[1].buffers["cu_seqlens"]
        with pytest.raises(RuntimeError, match="must be loaded into its bank's static buffers"):
            layer._te_cuda_graph_replay(torch.zeros(16, 1, 8),
                                        packed_seq_params=_cp_params([4, 12], 2))
    with running(plan(1)):  # loaded into another bank than the plan names
        with pytest.raises(RuntimeError, match="must be loaded into its bank's static buffers"):
            layer._te_cuda_graph_replay(torch.zeros(16, 1, 8), packed_seq_params=params)
    with running(plan(4)):
        with pytest.raises(RuntimeError, match=r"no TE graph bank was captured for CP size 4"):
            layer._te_cuda_graph_replay(torch.zeros(16, 1, 8), packed_seq_params=params)
    with pytest.raises(RuntimeError, match="replay under the graph runtime's plan"):
        layer._te_cuda_graph_replay(torch.zeros(16, 1, 8), packed_seq_params=params)
    # One bank (no dynamic CP): a call without a plan replays it.
    layer._graph_inputs, layer._graph_bank_sizes = layer._graph_inputs[:1], [1]
    layer.cuda_graphs = layer.cuda_graphs[:1]
    params = layer._graph_inputs[0].load(_cp_params([4, 12], 1))
    assert layer._te_cuda_graph_replay(torch.zeros(16, 1, 8), packed_seq_params=params)[0] == "bank 0"


# ------------------------------------------------------------- returned weight gradients

def test_weight_gradients_are_asked_uncopied_where_te_can():
    # TE 2.20's signature has the option (default: copy); TE 2.11's has not (never copied).
    def te_2_20(modules, sample_args, *, clone_param_grads_on_return=True, **kwargs):
        pass

    def te_2_11(modules, sample_args, **kwargs):
        pass

    schedule = {"_order": [1, -1], "_num_layers_per_chunk": [3]}
    assert te_layer_capture_keywords(te_2_20, 3) == schedule | {
        "clone_param_grads_on_return": False}
    assert te_layer_capture_keywords(te_2_11, 3) == schedule
