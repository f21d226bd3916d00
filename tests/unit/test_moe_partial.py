"""Partial MoE graphs (moe_partial.py) on CPU, with megatron-core's real MoE layers.

Graphs need a GPU (tests/gpu/test_moe_partial_graphs.py captures and replays them); here:

* megatron-core's partial forward (router part, eager experts, postprocess: what the local
  graphs capture piecewise) computes the plain forward, with the padding mask reaching the
  router from the packed params;
* the TE partial path's capture function and the eager resume after it compute the plain
  forward too (the graph here is its captured function, run directly);
* every partial graph function follows the micro-batch's plan, and a bypassed micro-batch
  takes one runner turn in every manager of the layer;
* the upstream code the module relies on is still there (sentinels).
"""

import inspect
from types import SimpleNamespace

import pytest
import torch

from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.enums import CudaGraphModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from megatron.packed_upstream import graph_engine
from megatron.packed_graphs.layers import GraphSafeMoELayer, LocalGraphDispatch
from megatron.packed_upstream.graph_engine import graph_managers
from megatron.packed_graphs.moe_partial import (
    PARTIAL_GRAPH_FUNCTIONS,
    partial_moe_graphs,
    te_partial_moe_graphs,
)
from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_graphs.plan import Reason, run_eager
from megatron.packed_graphs.specs import gpt_layer_spec, moe_layer_spec
from megatron.packed_model.providers import backend_provider
from megatron.packed_graphs.te_graphs import PackedGraphInputs, graph_tensors
from tests.unit.conftest import tiny_moe_config

HIDDEN, EXPERTS, TOKENS, DOCS = 32, 4, 16, 12
DROP_AND_PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
ROUTER, PREPROCESS, ATTN = (CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess,
                            CudaGraphModule.attn)


def _config(**overrides):
    return tiny_moe_config(TransformerConfig, **(dict(
        num_layers=1, hidden_size=HIDDEN, num_moe_experts=EXPERTS, moe_router_topk=2,
        **DROP_AND_PAD) | overrides))


def _layer(kind: str, config, seed=0):
    torch.manual_seed(seed)
    spec = (gpt_layer_spec("torch", num_experts=EXPERTS) if kind == "gpt" else
            moe_layer_spec(backend_provider("torch"), "RMSNorm", EXPERTS))
    return build_module(spec, config=config, layer_number=1)


def _params():
    cu = torch.tensor([0, 5, DOCS, TOKENS], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(5), torch.arange(DOCS - 5),
                              torch.arange(TOKENS - DOCS)])
    params = build_packed_batch_params(cu, position_ids, TOKENS, with_seq_idx=False)
    params.padding_mask = torch.arange(TOKENS) >= DOCS
    return params


def _run(layer, hidden, params, call=None):
    """Output, input gradient and parameter gradients of one forward and backward."""
    x = hidden.clone().requires_grad_()
    out = (call or layer)(x, attention_mask=None, packed_seq_params=params)
    out = out[0] if isinstance(out, tuple) else out
    out.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def _assert_same(got, expected):
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    assert got[2].keys() == expected[2].keys()
    for name in expected[2]:
        torch.testing.assert_close(got[2][name], expected[2][name], msg=name)


def _router_outputs(layer):
    """Probabilities the layer's router returns, per call (a forward hook)."""
    seen = []
    layer.mlp.router.register_forward_hook(lambda module, args, out: seen.append(out[0]))
    return seen


class _HostEvent:
    """Stands in for the CUDA event upstream's partial forward records and waits on."""

    def record(self):
        pass

    def synchronize(self):
        pass


# ------------------------------------------------------------------------ configuration

def test_which_configs_ask_for_partial_graphs():
    def config(impl, *modules):
        return SimpleNamespace(cuda_graph_impl=impl, cuda_graph_modules=list(modules))

    assert partial_moe_graphs(config("local", ATTN, ROUTER, PREPROCESS))
    assert partial_moe_graphs(config("local", PREPROCESS))
    assert not partial_moe_graphs(config("local", ATTN))
    assert not partial_moe_graphs(config("local"))
    assert not partial_moe_graphs(config("transformer_engine", ROUTER))
    assert te_partial_moe_graphs(config("transformer_engine", ROUTER))
    assert not te_partial_moe_graphs(config("transformer_engine", PREPROCESS))
    assert not te_partial_moe_graphs(config("local", ROUTER))


def test_te_graphs_capture_the_moe_layers_for_moe_router(cpu_moe):
    layer = _layer("hybrid", _config())
    for modules, graphed in (([], True), ([ROUTER], True), ([ROUTER, PREPROCESS], True),
                             ([ATTN], False), ([CudaGraphModule.mamba], False)):
        layer.config.cuda_graph_modules = modules
        assert graph_engine.layer_graphed_for_modules(layer) is graphed, modules


def test_gpt_and_hybrid_moe_layers_are_megatron_moe_layers(cpu_moe):
    for kind in ("gpt", "hybrid"):
        layer = _layer(kind, _config())
        assert isinstance(layer, GraphSafeMoELayer) and isinstance(layer, MoETransformerLayer)
        assert not layer.use_partial_cudagraphs  # no graphs configured


# ------------------------------------------------------------------------ local: the pieces

@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@pytest.mark.parametrize("shared", [None, 16])
def test_partial_forward_computes_the_plain_forward_with_the_padding_mask(cpu_moe, kind, shared):
    """megatron-core's partial path (router and preprocess, eager experts, postprocess: the
    functions the local graphs capture) gives the plain layer's output and gradients, and
    its router sees the padding mask carried by the packed params."""
    config = _config(moe_shared_expert_intermediate_size=shared)
    plain, partial = _layer(kind, config), _layer(kind, config)
    partial.load_state_dict(plain.state_dict())
    partial.use_partial_cudagraphs = True  # what transition_cudagraph_scope('partial') sets
    partial._router_dtoh_event = _HostEvent()
    probs = _router_outputs(partial)
    params, hidden = _params(), torch.randn(TOKENS, 1, HIDDEN)
    expected = _run(plain, hidden, params)
    got = _run(partial, hidden, params)
    _assert_same(got, expected)
    assert len(probs) == 1 and not probs[0][DOCS:].any() and probs[0][:DOCS].any()


# ------------------------------------------------------------------------ TE: capture, resume

def _te_layer(kind, modules, **overrides):
    """A layer configured for TE partial graphs; its 'graph' runs the capture function."""
    config = _config(**overrides)
    config.cuda_graph_impl, config.cuda_graph_modules = "transformer_engine", list(modules)
    layer = _layer(kind, config)
    params = _params()
    inputs = PackedGraphInputs.like(params)
    layer._graph_inputs, layer._graph_bank_sizes = [inputs], [1]

    def graph(hidden_states, **tensors):
        with graph_engine.te_graph_capture():  # megatron-core's capture flag, as TE sets it
            return layer._te_cuda_graph_capture(hidden_states, **tensors)

    layer.cuda_graphs = [graph]
    return layer, inputs.load(params)


@pytest.mark.parametrize("kind, modules", [
    ("gpt", [ROUTER]), ("gpt", [ATTN, ROUTER]), ("gpt", [ATTN, ROUTER, PREPROCESS]),
    ("hybrid", [ROUTER]), ("hybrid", [ROUTER, PREPROCESS]),
])
@pytest.mark.parametrize("shared", [None, 16])
def test_te_partial_replay_computes_the_plain_forward(cpu_moe, kind, modules, shared):
    """Attention (eager unless ``attn``), the captured router part with the padding mask from
    the graph inputs, then the MoE layer resumed eager: the plain layer's output and
    gradients; the layer's router runs once, inside the 'graph'."""
    layer, loaded = _te_layer(kind, modules, moe_shared_expert_intermediate_size=shared)
    plain = _layer(kind, _config(moe_shared_expert_intermediate_size=shared))
    plain.load_state_dict(layer.state_dict())
    probs = _router_outputs(layer)
    hidden = torch.randn(TOKENS, 1, HIDDEN)
    expected = _run(plain, hidden, _params())
    got = _run(layer, hidden, loaded, call=lambda x, **kwargs: layer._te_cuda_graph_replay(
        x, **kwargs))
    _assert_same(got, expected)
    assert len(probs) == 1 and not probs[0][DOCS:].any()
    assert layer.mlp.cudagraph_tensor_store.is_empty()


def test_te_partial_capture_returns_upstreams_outputs(cpu_moe):
    layer, loaded = _te_layer("hybrid", [ROUTER])
    tensors = graph_tensors(loaded)
    with graph_engine.te_graph_capture():
        outputs = layer._te_cuda_graph_capture(torch.randn(TOKENS, 1, HIDDEN), **tensors)
    hidden, probs, routing_map, residual = outputs  # routed tokens, router, residual
    assert hidden.shape == residual.shape == (TOKENS, 1, HIDDEN)
    assert probs.shape == routing_map.shape == (TOKENS, EXPERTS)
    assert not probs[DOCS:].any()  # padding weighs nothing (drop-and-pad may fill slots)


def test_te_whole_layer_graphs_are_unchanged(cpu_moe):
    layer, loaded = _te_layer("hybrid", [])
    hidden = torch.randn(TOKENS, 1, HIDDEN)
    plain = _layer("hybrid", _config())
    plain.load_state_dict(layer.state_dict())
    out = layer._te_cuda_graph_replay(hidden, packed_seq_params=loaded)
    expected = plain(hidden, attention_mask=None, packed_seq_params=_params())
    torch.testing.assert_close(out[0], expected[0])


# ------------------------------------------------------------------------ dispatch by plan

def test_partial_graph_functions_follow_the_plan(cpu_moe):
    layer = _layer("hybrid", _config())
    calls = []
    # Stands in for upstream's manager wrapper, which runs the plain function on eager=True.
    layer._forward_mlp_router = lambda *args, eager=False, **kwargs: calls.append(eager)
    runner = SimpleNamespace()
    layer.cudagraph_manager_router = SimpleNamespace(cudagraph_runners=[runner])
    layer._follow_plan("cudagraph_manager_router", "_forward_mlp_router")
    layer._forward_mlp_router(torch.zeros(1))
    with run_eager(Reason.OVERFLOW):
        layer._forward_mlp_router(torch.zeros(1))
    layer.eval()
    layer._forward_mlp_router(torch.zeros(1))
    assert calls == [False, True, True]
    assert runner.keep_buffers_private  # recorded runners keep their buffers (see module)


def _manager(reuse, runners):
    return SimpleNamespace(reuse_cudagraphs=reuse, cudagraph_runners=list(runners))


def test_a_bypassed_call_takes_one_turn_in_every_manager(cpu_moe, monkeypatch):
    monkeypatch.setattr(graph_engine, "local_graphs_created", lambda: True)
    layer = _layer("gpt", _config())
    for name in PARTIAL_GRAPH_FUNCTIONS:
        object.__setattr__(layer, name, _manager(False, ["a", "b", "c"]))
    assert len(graph_managers(layer)) == 3
    with run_eager(Reason.OVERFLOW):
        layer(torch.randn(TOKENS, 1, HIDDEN), attention_mask=None, packed_seq_params=_params())
    assert all(m.cudagraph_runners == ["b", "c", "a"] for m in graph_managers(layer))


def test_runners_of_the_micro_batch_capacity_are_tried_first_in_every_manager():
    def runner(capacity):
        params = SimpleNamespace(cu_seqlens_q=torch.zeros(capacity + 1, dtype=torch.int32))
        return SimpleNamespace(fwd_graph_input_kwarg_metas={
            "packed_seq_params": SimpleNamespace(value=params)})

    attention = _manager(True, [runner(64), runner(16)])
    first, second = (SimpleNamespace(fwd_graph_input_kwarg_metas={}) for _ in range(2))
    router = _manager(True, [first, second])
    layer = SimpleNamespace(graph_manager_names=("cudagraph_manager_attention",
                                                 "cudagraph_manager_router"),
                            cudagraph_manager_attention=attention,
                            cudagraph_manager_router=router)
    micro_batch = SimpleNamespace(cu_seqlens_q=torch.zeros(17, dtype=torch.int32))
    LocalGraphDispatch._try_this_capacity_first(layer, micro_batch)
    assert attention.cudagraph_runners[0].fwd_graph_input_kwarg_metas[
        "packed_seq_params"].value.cu_seqlens_q.numel() == 17
    assert router.cudagraph_runners == [first, second]  # no packed params: order kept


# ------------------------------------------------------------------------ upstream sentinels

def test_upstream_partial_moe_layer_is_what_the_mixin_builds_on():
    source = inspect.getsource
    # The manager wrapper runs the plain function when asked eager (_follow_plan).
    assert "def wrapped_func(*args, eager=False, cache_key=None, **kwargs):" in source(
        cuda_graphs.CudaGraphManager.__init__)
    scope = source(MoETransformerLayer.transition_cudagraph_scope)
    assert 'function_name="_forward_mlp_router"' in scope
    assert 'function_name="_forward_mlp_postprocess"' in scope
    forward = source(MoETransformerLayer._forward_mlp)
    # The padding mask is a router graph input; the sync docs/moe.md describes.
    assert "self._forward_mlp_router(hidden_states, padding_mask=padding_mask)" in forward
    assert "self._router_dtoh_event.synchronize()" in forward
    assert "CudaGraphModule.moe_router in self.config.cuda_graph_modules" in source(
        MoETransformerLayer.create_mcore_cudagraph_manager)
    # The local implementation pairs the two modules (megatron-core's TransformerConfig does it too).
    post_init = source(TransformerConfig.__post_init__)
    assert "self.cuda_graph_modules.append(CudaGraphModule.moe_preprocess)" in post_init


def test_upstream_te_partial_outputs_are_what_the_resume_reads():
    from megatron.core.transformer.moe import moe_utils

    source = inspect.getsource
    assert "return list(mlp_output_with_bias) + [residual]" in source(
        TransformerLayer._forward_mlp)
    early = source(moe_utils.MoECudaGraphPartialCaptureSignal.get_early_return_outputs)
    assert "outputs = [hidden_states, self.kwargs['probs'], self.kwargs['routing_map']]" in early
    assert "outputs.append(shared_expert_output)" in early
    assert "valid_cudagraph_attrs" in source(TransformerLayer._te_cuda_graph_replay_impl)
