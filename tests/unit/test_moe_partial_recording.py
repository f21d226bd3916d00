"""Local partial MoE graphs recorded on CPU: what megatron-core's capture will be handed.

megatron-core 0.19.2 records graph inputs in the first graphed iteration and captures at its
end (tests/gpu/test_moe_partial_graphs.py does both on a GPU). Recording runs the layers
eagerly, so it runs here with the few CUDA objects it creates stood in for. Upstream keeps one
buffer record per tensor and its views (``cg_buffer_metadata``) and, at capture, hands every
graph input of one record the same buffer, allocated in the shape of the first such input:

* inputs that share a record agree in shape: the router graph's ``[1, T]`` padding mask is no
  view of the ``[T]`` mask in the packed params the attention graphs take (it was, and the
  router graph got a ``[T]`` buffer at capture: moe_layer.py's transpose failed);
* `_capture_accounting` walks the recorded graphs in capture order as upstream's capture
  counts buffer reuses and finds nothing to complain about;
* the router graph gets its own copy of the mask while graphs are recorded, a view after.
"""

import inspect

import pytest
import torch

from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.spec_utils import build_module

from megatron.packed_upstream import graph_engine
from megatron.packed_graphs import moe_partial
from megatron.packed_graphs.specs import attention_layer_spec, gpt_layer_spec, moe_layer_spec
from megatron.packed_model.providers import backend_provider
from tests.unit.test_moe_partial import (
    ATTN,
    EXPERTS,
    HIDDEN,
    PREPROCESS,
    ROUTER,
    TOKENS,
    _config,
    _layer,
    _params,
    graph_managers_on_cpu,
)

DROPLESS = dict(moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False)


class _Event:
    """Stands in for torch.cuda.Event (runners and the router's D2H event create them)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def recording(cpu_moe, monkeypatch):
    """Local graph managers on CPU, in their recording phase (no capture happens here)."""
    record = graph_managers_on_cpu(monkeypatch, _Event)
    try:
        yield record
    finally:
        record._disable_saved_tensors_observer()


def _stack(kind: str, **overrides):
    """Four layers with local partial graphs (and attention graphs): GPT MoE layers, or
    hybrid '*' (whole-layer attention graph) and 'E' layers in turn."""
    config = _config(num_layers=4, cuda_graph_impl="local",
                     cuda_graph_modules=[ATTN, ROUTER, PREPROCESS], **overrides)
    provider = backend_provider("torch")
    specs = ([gpt_layer_spec("torch", num_experts=EXPERTS)] * 4 if kind == "gpt" else
             [attention_layer_spec(provider, "RMSNorm"),
              moe_layer_spec(provider, "RMSNorm", EXPERTS)] * 2)
    torch.manual_seed(0)
    layers = [build_module(spec, config=config, layer_number=number + 1)
              for number, spec in enumerate(specs)]
    for layer in layers:
        if hasattr(layer, "_router_dtoh_event"):
            layer._router_dtoh_event = _Event()
    return layers


def _record_step(layers, micro_batches=2):
    """A graphed training step's forwards and backwards (PP = 1: one runner per graph)."""
    for _ in range(micro_batches):
        params = _params()
        # As the training step builds it: a flat view of the [1, S] mask of the batch.
        params.padding_mask = params.padding_mask.view(1, -1).clone().reshape(-1)
        hidden = torch.randn(TOKENS, 1, HIDDEN, requires_grad=True)
        for layer in layers:
            hidden = layer(hidden, attention_mask=None, packed_seq_params=params)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        hidden.square().sum().backward()


def _name(runner):
    return f"{getattr(runner.func, '__name__', 'layer')}#{runner.base_module.layer_number}"


def _shared_input_shapes(record) -> dict:
    """``{buffer record: {(graph, shape), ...}}`` over the recorded forward-graph inputs."""
    shapes = {}
    for runner, kind, *recorded in record:
        if kind == "fwd":
            for meta in runner.get_arg_metas(recorded[0], recorded[1]):
                buffer = getattr(meta, "cg_buffer_metadata", None)
                if buffer is not None:
                    shapes.setdefault(id(buffer), set()).add((_name(runner), tuple(meta.shape)))
    return shapes


def _capture_accounting(record) -> list:
    """Problems upstream's capture would meet, walking the record in capture order: a graph
    input handed a shared buffer of another shape, a shared buffer reused more often than
    counted, forward buffers still owed when a backward graph is captured.

    Mirrors 0.19.2's bookkeeping (``create_fwd_graph``): a record used by several graph
    inputs gets one buffer, shaped like the first of them, and a count of those uses; each
    use takes one; a graph output that a later graph reads gets a buffer counted by those
    reads. Kept in a side table: the recorded metadata is not touched.
    """
    owed, problems = {}, []  # id(record) -> [shape, uses left]
    for runner, kind, *recorded in record:
        if kind == "bwd":
            if owed:
                problems.append(f"{_name(runner)} backward: {len(owed)} forward buffers owed")
            continue
        args, kwargs, outputs = recorded
        inputs = [(getattr(meta, "cg_buffer_metadata", None), meta)
                  for meta in runner.get_arg_metas(args, kwargs)]
        for buffer, meta in inputs:
            if buffer is not None and buffer.input_use_count > 1 and id(buffer) not in owed:
                owed[id(buffer)] = [tuple(meta.shape), buffer.input_use_count]
        for buffer, meta in inputs:
            shared = None if buffer is None else owed.get(id(buffer))
            if shared is None:
                continue
            if not buffer.is_cudagraph_input or shared[1] == 0:
                problems.append(f"{_name(runner)}: {tuple(meta.shape)} input reused too often")
            elif shared[0] != tuple(meta.shape):
                problems.append(f"{_name(runner)}: {tuple(meta.shape)} input gets a "
                                f"{shared[0]} buffer")
            shared[1] -= 1
        for key in [key for key, (_, left) in owed.items() if left <= 0]:
            del owed[key]
        for meta in runner.get_arg_metas(outputs):
            buffer = getattr(meta, "cg_buffer_metadata", None)
            if buffer is None or not buffer.is_cudagraph_output:
                problems.append(f"{_name(runner)}: an output without an output record")
            elif buffer.is_cudagraph_input and id(buffer) not in owed:
                owed[id(buffer)] = [tuple(meta.shape), buffer.cudagraph_reuse_ref_count]
    return problems


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@pytest.mark.parametrize("dropless", [False, True])
def test_recorded_partial_graphs_capture_without_buffer_clashes(recording, kind, dropless):
    layers = _stack(kind, **(DROPLESS if dropless else {}))
    _record_step(layers)
    record = recording.cudagraph_record
    graphs = {_name(runner) for runner, _, *rest in record}
    routers = {name for name in graphs if name.startswith("_forward_mlp_router")}
    assert len(routers) == (2 if kind == "hybrid" else 4)
    assert len(record) == 2 * len(graphs)  # each graph once forward, once backward
    for uses in _shared_input_shapes(record).values():
        assert len({shape for _, shape in uses}) == 1, sorted(uses)
    # The router graphs' masks: own records, not the packed params' mask.
    masks = [runner.fwd_graph_input_kwarg_metas["padding_mask"]
             for runner, kind_, *_ in record if kind_ == "fwd"
             and _name(runner).startswith("_forward_mlp_router")]
    assert all(meta.shape == (1, TOKENS) for meta in masks)
    assert _capture_accounting(record) == []


def test_the_checks_find_the_clash_of_a_viewed_mask(recording, monkeypatch):
    """With the router graph handed a view of the packed params' mask, as before the fix, the
    [T] attention-graph input and the [1, T] router-graph input share one buffer record."""
    monkeypatch.setattr(moe_partial, "router_graph_padding_mask", lambda *args: None)
    _record_step(_stack("gpt"))
    record = recording.cudagraph_record
    clashes = [uses for uses in _shared_input_shapes(record).values()
               if len({shape for _, shape in uses}) > 1]
    assert clashes and all({shape for _, shape in uses} == {(TOKENS,), (1, TOKENS)}
                           for uses in clashes)
    problems = _capture_accounting(record)
    assert problems and all("(1, 16) input gets a (16,) buffer" in p for p in problems)


def test_the_router_graph_gets_a_copy_of_the_mask_only_while_recording(cpu_moe, monkeypatch):
    layer = _layer("hybrid", _config())
    layer.use_partial_cudagraphs = True  # what transition_cudagraph_scope('partial') sets
    layer._router_dtoh_event = _Event()
    masks = []
    router = layer._forward_mlp_router

    def spy(hidden_states, padding_mask=None):
        masks.append(padding_mask)
        return router(hidden_states, padding_mask=padding_mask)

    layer._forward_mlp_router = spy
    params = _params()
    for created in (False, True):
        monkeypatch.setattr(graph_engine, "local_graphs_created", lambda: created)
        layer(torch.randn(TOKENS, 1, HIDDEN), attention_mask=None, packed_seq_params=params)
    recording_mask, replay_mask = masks
    torch.testing.assert_close(recording_mask, params.padding_mask.view(1, -1))
    assert recording_mask._base is None  # own storage: its own buffer record
    assert replay_mask._base is params.padding_mask  # a view: no copy per replayed call
    assert replay_mask.shape == (1, TOKENS)


def test_upstream_buffer_records_follow_views_and_count_input_uses():
    """0.19.2 keeps one buffer record per tensor and its views, and counts the graph inputs
    of a record (and the reuses of a graph output as another graph's input), as
    `_capture_accounting` models them."""
    mask = torch.ones(TOKENS)
    row = mask.view(1, -1)
    flat = row.reshape(-1)  # a view of the view: its base is the storage's own tensor
    chain = cuda_graphs._get_tensor_alias_chain(flat)
    assert len(chain) == 2 and chain[0] is flat and chain[1] is mask
    assert [id(t) for t in cuda_graphs._get_tensor_alias_chain(mask)] == [id(mask)]
    copy = mask.view(1, -1).clone()  # own storage: a record of its own

    runner = object.__new__(cuda_graphs._CudaGraphRunner)  # record-time bookkeeping only
    record = cuda_graphs._CudaGraphRunner.apply_cudagraph_record_metadata
    hidden = torch.zeros(TOKENS, HIDDEN)
    out = torch.zeros(TOKENS, HIDDEN)
    record(runner, (hidden, row), {}, (out,))  # e.g. an attention graph
    record(runner, (out,), {"mask": flat, "copy": copy}, ())  # the next graph takes both
    shared = mask.cg_buffer_metadata
    assert row.cg_buffer_metadata is shared and flat.cg_buffer_metadata is shared
    assert shared.is_cudagraph_input and shared.input_use_count == 2
    assert copy.cg_buffer_metadata is not shared and copy.cg_buffer_metadata.input_use_count == 1
    produced = out.cg_buffer_metadata
    assert produced.is_cudagraph_output and produced.is_cudagraph_input
    assert produced.input_use_count == 1 and produced.cudagraph_reuse_ref_count == 1


def test_upstream_capture_shares_one_buffer_per_record():
    """At capture, one buffer per record, shaped like its first graph input, reused as counted."""
    # source sentinel: create_fwd_graph allocates graph buffers inside a CUDA graph capture
    create = inspect.getsource(cuda_graphs._CudaGraphRunner.create_fwd_graph)
    assert "assert metadata.is_cudagraph_input and buf_metadata.capture_reuse_count > 0" in create
    assert "buf.cg_buffer_metadata.capture_reuse_count = metadata.input_use_count" in create
    assert ("buf.cg_buffer_metadata.capture_reuse_count = metadata.cudagraph_reuse_ref_count"
            in create)


@pytest.mark.parametrize("dropless", [False, True])
def test_router_graph_runners_keep_their_buffers(recording, dropless):
    """Eager code reads the router graphs' outputs (routing and permutation maps) until the
    layer's backward: their runners are marked to keep every buffer; the other graphs'
    runners give theirs back to the pool as upstream does."""
    _record_step(_stack("gpt", **(DROPLESS if dropless else {})))
    runners = {runner for runner, _, *rest in recording.cudagraph_record}
    routers = [r for r in runners if _name(r).startswith("_forward_mlp_router")]
    others = [r for r in runners if r not in routers]
    assert len(routers) == 4 and others
    assert all(getattr(r, "keep_buffers_private", False) for r in routers)
    assert not any(getattr(r, "keep_buffers_private", False) for r in others)


def test_upstream_keeps_only_differentiable_outputs_that_escape_to_eager_code(monkeypatch):
    """Why the router runners are marked: 0.19.2 keeps a forward output owned past its capture
    only when it is saved for backward, or requires grad and no other graph reads it; the
    router graph's integer maps are neither."""
    released = []
    monkeypatch.setattr(cuda_graphs, "make_weakref",
                        lambda tensor, inplace=True: released.append(tensor) or tensor)
    probs = torch.zeros(TOKENS, EXPERTS, requires_grad=True)  # read by eager code only
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool)  # no grad: released
    hidden = torch.zeros(TOKENS, HIDDEN, requires_grad=True)  # another graph's input
    runner = object.__new__(cuda_graphs._CudaGraphRunner)
    record = cuda_graphs._CudaGraphRunner.apply_cudagraph_record_metadata
    record(runner, (), {}, (probs, routing_map, hidden))
    record(runner, (hidden,), {}, ())
    runner.fwd_graph_input_surface, runner.fwd_graph_input_args = [], ()
    runner.fwd_graph_input_kwargs, runner.fwd_graph_output_surface = {}, ()
    runner.fwd_graph_outputs = (probs, routing_map, hidden)
    graph_engine.UPSTREAM_WEAKREF_FORWARD_BUFFERS(runner, True)  # end of the forward capture
    assert [id(t) for t in released] == [id(routing_map), id(hidden)]
