"""Partial MoE graphs (moe_partial.py) on CPU, with megatron-core's real MoE layers.

Graphs need a GPU (tests/gpu/test_moe_partial_graphs.py captures and replays them); here:

* megatron-core's partial forward (router part, eager experts, postprocess: what the local
  graphs capture piecewise) computes the plain forward, with the padding mask reaching the
  router from the packed params;
* the TE partial path's capture function and the eager resume after it compute the plain
  forward too (the graph here is its captured function, run directly);
* every partial graph function follows the micro-batch's plan, and a bypassed micro-batch
  takes one runner turn in every manager of the layer;
* the upstream behaviour the module relies on still holds (run on CPU with stand-ins).
"""

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

def graph_managers_on_cpu(monkeypatch, event_class):
    """megatron-core's local graph managers buildable on CPU, in their recording phase: the
    CUDA pool, streams, events (``event_class``) and graph-safe RNG stood in. Returns the
    global record; call its ``_disable_saved_tensors_observer()`` when done."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(torch.cuda, "Event", event_class)
    monkeypatch.setattr(get_cuda_rng_tracker(), "use_cudagraphable_rng", True, raising=False)
    monkeypatch.setattr(cuda_graphs.CudaGraphManager, "global_mempool", None)
    record = cuda_graphs._CudagraphGlobalRecord
    monkeypatch.setattr(record, "cudagraph_record", [])
    monkeypatch.setattr(record, "cudagraph_created", False)
    return record


class _CountingEvent(_HostEvent):
    def __init__(self, calls):
        self.calls = calls

    def record(self):
        self.calls.append("record")

    def synchronize(self):
        self.calls.append("synchronize")


def test_upstream_partial_moe_layer_is_what_the_mixin_builds_on(cpu_moe, monkeypatch):
    """megatron-core's MoE layer, with local graph managers built on CPU (nothing captured)."""
    record = graph_managers_on_cpu(monkeypatch, _HostEvent)
    try:
        # The local implementation pairs the two modules (megatron-core's config does it too).
        config = _config(cuda_graph_impl="local", cuda_graph_modules=[ROUTER])
        assert PREPROCESS in config.cuda_graph_modules
        layer = _layer("gpt", config)
    finally:
        record._disable_saved_tensors_observer()
    # The router module asks for the router and postprocess managers, wrapping those methods.
    assert layer.use_partial_cudagraphs
    assert layer.cudagraph_manager_router.func.__name__ == "_forward_mlp_router"
    assert layer.cudagraph_manager_postprocess.func.__name__ == "_forward_mlp_postprocess"
    assert "_forward_mlp_router" in vars(layer) and "_forward_mlp_postprocess" in vars(layer)

    # The manager wrapper runs the plain function when asked eager (_follow_plan).
    base = SimpleNamespace(forward_part=lambda x, scale=1: (x * scale, "plain"))
    manager = cuda_graphs.CudaGraphManager(config, base, "forward_part", need_backward=False)
    monkeypatch.setattr(cuda_graphs.CudaGraphManager, "__call__",
                        lambda *args, **kwargs: pytest.fail("eager call reached the graphs"))
    assert base.forward_part is not manager.func
    out = base.forward_part(torch.ones(2), scale=3, eager=True)
    assert out[1] == "plain" and torch.equal(out[0], torch.full((2,), 3.0))

    hidden = torch.randn(TOKENS, 1, HIDDEN)
    mask = torch.zeros(1, TOKENS, dtype=torch.bool)
    # The partial forward hands the padding mask to the router graph as a keyword input and
    # waits on the router's D2H event before the eager experts (the sync docs/moe.md describes).
    calls = []
    router_func = layer.cudagraph_manager_router.func

    def router(hidden_states, **kwargs):
        calls.append(("router", sorted(kwargs), kwargs.get("padding_mask")))
        return router_func(hidden_states, **kwargs)

    monkeypatch.setattr(layer, "_forward_mlp_router", router)
    monkeypatch.setattr(layer, "_forward_mlp_postprocess",
                        layer.cudagraph_manager_postprocess.func)
    layer._router_dtoh_event = _CountingEvent(calls)
    MoETransformerLayer._forward_mlp(layer, hidden, padding_mask=mask)
    assert calls[0][:2] == ("router", ["padding_mask"]) and calls[0][2] is mask
    assert calls[1:] == ["record", "synchronize"]


class _PartialMoEStandIn(torch.nn.Module):
    """An MoE layer's stand-in: returns given outputs, or resumes from its tensor store."""

    def __init__(self, outputs=None, dispatcher=None):
        super().__init__()
        self.outputs, self.token_dispatcher, self.stored = outputs, dispatcher, []
        self.cudagraph_tensor_store = SimpleNamespace(set=lambda **kw: self.stored.append(kw),
                                                      clear=lambda: self.stored.append(None))

    def forward(self, hidden_states, padding_mask=None):
        return self.outputs if self.outputs is not None else (hidden_states * 2, None)


def test_upstream_te_capture_returns_the_partial_outputs_then_the_residual(cpu_moe, monkeypatch):
    """While TE captures a router-scoped MoE layer, megatron-core's _forward_mlp returns the
    MoE layer's early-return outputs with the residual appended (what the resume pops)."""
    from megatron.core.transformer import transformer_layer

    layer = _layer("gpt", _config())
    early = [torch.randn(TOKENS, 1, HIDDEN), torch.rand(TOKENS, EXPERTS),
             torch.ones(TOKENS, EXPERTS, dtype=torch.bool)]
    layer.mlp = _PartialMoEStandIn(outputs=tuple(early))
    monkeypatch.setattr(layer.config, "cuda_graph_impl", "transformer_engine")
    monkeypatch.setattr(layer.config, "cuda_graph_modules", [ROUTER])
    monkeypatch.setattr(transformer_layer, "is_graph_capturing", lambda: True)
    hidden = torch.randn(TOKENS, 1, HIDDEN)
    out = TransformerLayer._forward_mlp(layer, hidden)
    assert isinstance(out, list) and len(out) == 4
    assert all(got is expected for got, expected in zip(out, early))
    assert out[-1] is hidden  # the residual: the layer input (the norm returns no residual)
    monkeypatch.setattr(transformer_layer, "is_graph_capturing", lambda: False)
    layer.mlp.outputs = (early[0], None)  # eager: an MLP output and bias, and no early return
    assert torch.is_tensor(TransformerLayer._forward_mlp(layer, hidden))


@pytest.mark.parametrize("shared", [False, True])
def test_upstream_te_partial_outputs_are_what_the_resume_reads(monkeypatch, shared):
    """megatron-core's early-return outputs (router and preprocess steps) read back by its own
    TE replay and by the fork's resume (`set_dispatcher_graph_state`) alike."""
    from megatron.core.transformer.module import GraphableMegatronModule
    from megatron.core.transformer.moe import moe_utils
    from megatron.packed_upstream import model_layers

    signal = moe_utils.MoECudaGraphPartialCaptureSignal
    hidden, probs = torch.randn(TOKENS, HIDDEN), torch.rand(TOKENS, EXPERTS)
    routing_map = torch.ones(TOKENS, EXPERTS, dtype=torch.bool)
    shared_out = torch.randn(TOKENS, HIDDEN) if shared else None
    tail = [shared_out] if shared else []
    route = signal(None, "route", probs=probs, routing_map=routing_map)
    assert [id(t) for t in route.get_early_return_outputs(hidden, shared_out)] == [
        id(t) for t in [hidden, probs, routing_map, *tail]]

    splits, perm = torch.arange(EXPERTS), torch.arange(TOKENS)
    captured = SimpleNamespace(cudagraph_attrs=["splits", "nested.perm", "nested.absent"],
                               valid_cudagraph_attrs=None, splits=splits,
                               nested=SimpleNamespace(perm=perm, absent=None))
    pre = signal(SimpleNamespace(token_dispatcher=captured), "preprocess",
                 hidden_states=hidden, probs=probs)
    outputs = pre.get_early_return_outputs(torch.zeros(1), shared_out)
    assert [id(t) for t in outputs] == [id(t) for t in [hidden, probs, splits, perm, *tail]]
    assert captured.valid_cudagraph_attrs == ["splits", "nested.perm"]  # tensors only

    # Upstream's TE replay, on a stand-in layer, writes the state back where it came from.
    def replay_stand_in():
        layer = object.__new__(TransformerLayer)
        torch.nn.Module.__init__(layer)  # no layer built: only what the replay reads
        layer.config = SimpleNamespace(
            delay_offload_until_cuda_graph=False, cuda_graph_modules=[ROUTER, PREPROCESS],
            moe_shared_expert_intermediate_size=8 if shared else None,
            moe_shared_expert_overlap=False, overlap_moe_expert_parallel_comm=False)
        layer.is_moe_layer, layer.recompute_pre_mlp_layernorm = True, False
        layer.mlp = _PartialMoEStandIn(dispatcher=SimpleNamespace(
            valid_cudagraph_attrs=captured.valid_cudagraph_attrs, nested=SimpleNamespace()))
        layer._forward_post_mlp = lambda with_bias, residual: (with_bias[0], residual)
        return layer

    residual = torch.randn(TOKENS, HIDDEN)
    monkeypatch.setattr(GraphableMegatronModule, "_te_cuda_graph_replay",
                        lambda self, *args, **kwargs: [*outputs, residual])
    layer = replay_stand_in()
    out, got_residual = TransformerLayer._te_cuda_graph_replay_impl(layer, (hidden,), {}, None)[0]
    dispatcher = layer.mlp.token_dispatcher
    assert dispatcher.splits is splits and dispatcher.nested.perm is perm
    assert got_residual is residual and torch.equal(out, hidden * 2)
    assert layer.mlp.stored[0]["hidden_states"] is hidden and layer.mlp.stored[0]["probs"] is probs
    assert layer.mlp.stored[0]["shared_expert_output"] is shared_out

    fork = replay_stand_in().mlp.token_dispatcher
    model_layers.set_dispatcher_graph_state(fork, outputs[2:2 + len(fork.valid_cudagraph_attrs)])
    assert fork.splits is splits and fork.nested.perm is perm
