"""The upstream shim (megatron/packed_upstream): each patch does what it says, and each relies
on upstream code that a sentinel checks, so a megatron-core upgrade that changes that code fails
here first."""

import collections
import contextlib
import inspect
import sys
from types import SimpleNamespace

import pytest
import torch

import megatron.core
from megatron.core.transformer import cuda_graphs

from megatron.packed_upstream import (
    gate,
    graph_engine,
    megatron_ddp,
    megatron_optimizer,
    model_layers,
    patches,
    training_loop,
)

source = inspect.getsource  # only for upstream code that runs under CUDA graph capture or on a GPU


def test_patches_target_the_pinned_version():
    assert megatron.core.__version__.split("+")[0] == gate.PATCHED_VERSION


def test_a_local_version_label_is_the_same_release(monkeypatch):
    monkeypatch.setattr(megatron.core, "__version__", "0.19.2+ac6f44d")
    gate.require_patched_version()


def test_another_version_is_refused(monkeypatch):
    monkeypatch.setattr(megatron.core, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match="targets megatron-core 0.19.2, found 0.20.0"):
        gate.require_patched_version()


def test_apply_reports_every_patch():
    report = patches.apply_core_patches()
    assert set(report) == {
        "keep_forward_inputs_until_backward_captured", "keep_chunk_graph_buffers_private",
        "keep_saved_tensor_observer_armed_until_capture", "sync_free_multi_tensor_fallbacks",
        "clip_gradients_without_host_sync", "warm_up_graphs_on_recorded_layouts",
        "te_cross_entropy_capturable", "check_arg_types_without_reimporting",
        "record_capture_statistics", "skip_dataset_helper_build"}
    assert all(state == "applied" or state.startswith(("not needed", "l2 norm", "scale"))
               for state in report.values())
    assert patches.apply_core_patches() == report  # installing twice = once


# -- dropped patches: the upstream fixes they wait for are still there ----------------------

def test_upstream_clears_the_warmup_flag():
    # Fixed in 0.17.0; when this fails the fork needs its old fix_warmup_flag_never_cleared.
    cuda_graphs._set_warmup_start()
    cuda_graphs._set_warmup_end()
    assert not cuda_graphs.is_graph_warmup()


def test_upstream_replay_copies_only_inputs_at_another_address():
    # Fixed in 0.17.0: parameters (same address) are no longer copied into themselves, so a
    # replay does not bump their autograd version (the old keep_parameter_versions_on_replay).
    weight, buffer, data = torch.nn.Parameter(torch.ones(3)), torch.zeros(2), torch.arange(2.0)
    replays = []
    runner = SimpleNamespace(fwd_graph=SimpleNamespace(replay=lambda: replays.append(1)),
                             status=cuda_graphs._GraphStatus.FWD_READY,
                             fwd_graph_input_surface=[weight, buffer], fp8_enabled=False,
                             fp4_enabled=False, use_stream=False,
                             fwd_graph_output_surface=(torch.zeros(1),))
    version = weight._version
    cuda_graphs._CudagraphReplayNode.apply(runner, False, weight, data)
    assert replays == [1] and torch.equal(buffer, data)  # another address: copied in
    assert weight._version == version  # its own graph input: left alone


def test_upstream_finalize_scales_by_the_token_count_on_the_device(cpu_dist, monkeypatch):
    # Fixed in 0.18.0: no `if num_tokens > 0` on a CUDA tensor (the old
    # finalize_model_grads_without_host_sync); training.py uses upstream's function.
    from megatron.core.distributed import finalize_model_grads as finalize

    module = sys.modules[finalize.__module__]
    for name in ("_allreduce_conditional_embedding_grads",
                 "_allreduce_non_tensor_model_parallel_grads",
                 "_allreduce_replicated_grads_over_gtp_remat_group",
                 "_allreduce_word_embedding_grads", "_allreduce_position_embedding_grads",
                 "reset_model_temporary_tensors"):
        monkeypatch.setattr(module, name, lambda *args, **kwargs: None)
    config = SimpleNamespace(timers=None, gtp_weight_remat_size=1, expert_gtp_weight_remat_size=1,
                             moe_router_enable_expert_bias=False, calculate_per_token_loss=True,
                             moe_router_load_balancing_type="aux_loss")
    monkeypatch.setattr(module, "get_model_config", lambda chunk: config)
    scalings = []
    chunk = SimpleNamespace(finish_grad_sync=lambda force_all_reduce: None,
                            scale_gradients=scalings.append)
    for tokens in (torch.tensor(4.0), torch.tensor(0.0)):
        finalize([chunk], num_tokens=tokens)
    assert [float(s) for s in scalings] == [0.25, 1.0]  # no division by zero tokens
    # On the meta device any host read of the count raises: upstream reads none.
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: None)
    finalize([chunk], num_tokens=torch.empty((), device="meta"))
    assert scalings[-1].device.type == "meta"


# -- buffer lifetimes in the local graph engine ----------------------------------------------

def test_upstream_releases_forward_buffers_unless_tagged_saved_for_backward(monkeypatch):
    released = []
    monkeypatch.setattr(cuda_graphs, "make_weakref",
                        lambda tensor, inplace=True: released.append(tensor) or tensor)
    saved, other = torch.zeros(4), torch.zeros(4)
    cuda_graphs._apply_cudagraph_buffer_metadata(saved).is_saved_for_backward = True
    graph_engine.UPSTREAM_WEAKREF_FORWARD_BUFFERS(_runner(saved, other), True)  # forward capture
    assert [id(t) for t in released] == [id(other)]
    graph_engine.UPSTREAM_WEAKREF_FORWARD_BUFFERS(_runner(saved), False)  # backward capture
    assert [id(t) for t in released] == [id(other), id(saved)]
    # source sentinel: the two captures call it, inside CUDA graph capture only
    assert "self._weakref_forward_buffers(preserve_forward_to_backward_lifetimes=True)" in source(
        cuda_graphs._CudaGraphRunner.create_fwd_graph)
    assert "self._weakref_forward_buffers(preserve_forward_to_backward_lifetimes=False)" in source(
        graph_engine.UPSTREAM_CREATE_BWD_GRAPH)
    assert "tree_map(make_weakref, self.static_grad_inputs)" in source(
        graph_engine.UPSTREAM_CREATE_BWD_GRAPH)


def _runner(*inputs, private=False):
    runner = SimpleNamespace(fwd_graph_input_surface=list(inputs), fwd_graph_input_args=(),
                             fwd_graph_input_kwargs={}, fwd_graph_outputs=(),
                             fwd_graph_output_surface=())
    if private:
        runner.keep_buffers_private = True
    return runner


def test_forward_inputs_are_kept_until_the_backward_capture(monkeypatch):
    patches.apply_core_patches()
    released = []
    monkeypatch.setattr(cuda_graphs, "make_weakref",
                        lambda tensor, inplace=True: released.append(tensor) or tensor)
    weakref_forward_buffers = cuda_graphs._CudaGraphRunner._weakref_forward_buffers
    hidden = torch.zeros(4)  # saved by a native op (F.rms_norm): upstream never tags it
    runner = _runner(hidden)
    weakref_forward_buffers(runner, True)  # end of the forward capture
    assert released == [] and hidden.cg_buffer_metadata.is_saved_for_backward
    weakref_forward_buffers(runner, False)  # end of the backward capture
    assert released == [hidden]


def test_upstream_alone_would_release_a_native_save(monkeypatch):
    released = []
    monkeypatch.setattr(cuda_graphs, "make_weakref",
                        lambda tensor, inplace=True: released.append(tensor) or tensor)
    hidden = torch.zeros(4)
    graph_engine.UPSTREAM_WEAKREF_FORWARD_BUFFERS(_runner(hidden), True)
    assert released == [hidden]  # the bug the patch exists for


def test_chunk_runners_never_release_their_buffers(monkeypatch):
    patches.apply_core_patches()
    released = []
    monkeypatch.setattr(cuda_graphs, "make_weakref",
                        lambda tensor, inplace=True: released.append(tensor) or tensor)
    runner = _runner(torch.zeros(4), private=True)
    cuda_graphs._CudaGraphRunner._weakref_forward_buffers(runner, False)
    assert released == []

    seen = {}

    def backward_capture(self):  # stands in for upstream's, doing only its weakref calls
        seen["make_weakref"] = cuda_graphs.make_weakref
        cuda_graphs.make_weakref(torch.zeros(1))

    monkeypatch.setattr(graph_engine, "UPSTREAM_CREATE_BWD_GRAPH", backward_capture)
    patched = cuda_graphs._CudaGraphRunner.create_bwd_graph
    patched(runner)
    assert released == [] and cuda_graphs.make_weakref is not seen["make_weakref"]
    patched(_runner())  # an ordinary runner keeps upstream's release
    assert len(released) == 1


def test_saved_tensor_observer_is_rearmed_until_the_capture():
    patches.apply_core_patches()
    record = cuda_graphs._CudagraphGlobalRecord
    # Upstream disarms the observer after every schedule, captured or not.
    record._enable_saved_tensors_observer()
    try:
        assert record.cudagraph_record == [] and not record.cudagraph_created
        graph_engine.UPSTREAM_CREATE_CUDAGRAPHS(record)  # nothing recorded: nothing captured
        assert record._saved_tensors_observer is None
    finally:
        record._disable_saved_tensors_observer()
    record._enable_saved_tensors_observer()
    try:
        assert record._saved_tensors_observer is not None
        cuda_graphs.create_cudagraphs()  # an eager warm-up schedule: nothing recorded
        assert record._saved_tensors_observer is not None  # upstream alone would disarm it
        assert torch.autograd.function.FunctionCtx.save_for_backward is \
            record._saved_tensors_observer[1]
    finally:
        record._disable_saved_tensors_observer()
    # Never armed (eager or TE-graph runs: no local-graph manager): the schedule leaves it off.
    cuda_graphs.create_cudagraphs()
    assert record._saved_tensors_observer is None


def test_aliasing_check_names_the_clashing_runners():
    def runner(layer, inputs, grad_out, grad_in):
        return SimpleNamespace(base_module=SimpleNamespace(layer_number=layer), num_dgrads=len(inputs),
                               fwd_graph_input_surface=list(inputs) + [torch.zeros(1)],
                               static_grad_outputs=grad_out, static_grad_inputs=grad_in)

    shared, other = torch.zeros(8), torch.zeros(8)
    first = runner(1, [shared], [other], [None])
    last = runner(4, [other], [shared], [None])
    clashes = graph_engine.forward_inputs_reused_as_grad_buffers([first, last])
    # The last layer's backward (first to replay) writes over the first layer's saved input;
    # the first layer's backward writing over the last layer's input, already consumed, is fine.
    assert clashes == ["SimpleNamespace#4 grad out == ['SimpleNamespace#1'] fwd in"]
    own = runner(2, [shared], [shared], [None])
    assert graph_engine.forward_inputs_reused_as_grad_buffers([own]) == [
        "SimpleNamespace#2 grad out == ['SimpleNamespace#2'] fwd in"]
    assert graph_engine.forward_inputs_reused_as_grad_buffers(
        [runner(1, [torch.zeros(8)], [torch.zeros(8)], [None])]) == []


# -- optimizer step without host syncs -------------------------------------------------------

def test_multi_tensor_fallbacks_are_replaced_by_foreach_versions():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mixed_precision

    assert clip_grads.l2_norm_impl in (utils.local_multi_tensor_l2_norm,
                                       megatron_optimizer.foreach_l2_norm)  # no TE/apex here
    patches.apply_core_patches()
    assert clip_grads.l2_norm_impl is megatron_optimizer.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is megatron_optimizer.foreach_scale
    assert mixed_precision.multi_tensor_scale_impl is megatron_optimizer.foreach_scale

    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    flag = torch.zeros(1, dtype=torch.int)
    norm, per_tensor = megatron_optimizer.foreach_l2_norm(2048, flag, [grads], False)
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    assert norm.shape == (1,) and per_tensor is None
    torch.testing.assert_close(norm[0], expected)
    assert megatron_optimizer.foreach_l2_norm(2048, flag, [[]], False)[0].tolist() == [0.0]

    dst = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    megatron_optimizer.foreach_scale(2048, flag, [grads, dst], 0.5)
    for g, d in zip(grads, dst):
        torch.testing.assert_close(d, (g * 0.5).to(torch.bfloat16))


class _HostTorch:
    """A module's ``torch`` with its ``device='cuda'`` allocations made on the host."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, **kwargs)


@pytest.fixture
def host_clip_grads(cpu_dist, monkeypatch):
    """megatron-core's clip_grads with its CUDA allocations on the host (a world of one)."""
    from megatron.core.optimizer import clip_grads

    monkeypatch.setattr(clip_grads, "torch", _HostTorch())
    return clip_grads


def test_upstream_fallback_kernels_still_sync():
    # When this fails, upstream's local l2 norm stopped reading the norms on the host:
    # re-check sync_free_multi_tensor_fallbacks. On the meta device, a host read raises.
    from megatron.core import utils

    grads = [torch.empty(3, device="meta"), torch.empty(2, 2, device="meta")]
    flag = torch.zeros(1, dtype=torch.int, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        utils.local_multi_tensor_l2_norm(2048 * 32, flag, [grads], False)
    norm, _ = megatron_optimizer.foreach_l2_norm(2048 * 32, flag, [grads], False)
    assert norm.device.type == "meta" and norm.shape == (1,)  # the replacement reads nothing


def test_upstream_grad_norm_syncs_without_te_tensor_scale_kernel(host_clip_grads, monkeypatch):
    # When this fails, upstream changed when it reads the norm on the host: re-check
    # clip_gradients_without_host_sync and the condition under which it is "not needed".
    grads = [torch.full((4,), 3.0), torch.full((2, 2), 4.0)]  # L2 norm 10
    monkeypatch.setattr(host_clip_grads, "multi_tensor_scale_tensor_impl", None)
    norm = megatron_optimizer.UPSTREAM_GET_GRAD_NORM(grads)
    assert type(norm) is float and norm == pytest.approx(10.0)  # read on the host
    monkeypatch.setattr(host_clip_grads, "multi_tensor_scale_tensor_impl", object())
    norm = megatron_optimizer.UPSTREAM_GET_GRAD_NORM(grads)
    assert torch.is_tensor(norm) and float(norm) == pytest.approx(10.0)  # kept on the device


def test_upstream_clip_decides_on_the_host_without_te_tensor_scale_kernel(host_clip_grads,
                                                                          monkeypatch):
    clip = megatron_optimizer.UPSTREAM_CLIP_BY_TOTAL_NORM
    scales = []
    monkeypatch.setattr(host_clip_grads, "multi_tensor_scale_tensor_impl", None)
    monkeypatch.setattr(host_clip_grads, "multi_tensor_scale_impl",
                        lambda chunk_size, flag, tensor_lists, scale: scales.append(scale))
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    for p in params:  # the decoupled gradients: upstream asserts plain ones are CUDA tensors
        p.decoupled_grad = torch.ones(3)
    clip(params, 100.0, 10.0, use_decoupled_grad=True)
    assert scales == []  # the host comparison skips the kernel when nothing is clipped
    clip(params, 5.0, 10.0, use_decoupled_grad=True)
    assert scales == [pytest.approx(0.5)]
    with pytest.raises(AssertionError, match="multi_tensor_scale_tensor"):
        clip(params, 5.0, torch.tensor(10.0), use_decoupled_grad=True)  # a device norm


def test_clip_patch_is_not_needed_where_upstream_clips_on_the_device(monkeypatch):
    from megatron.core.optimizer import clip_grads

    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", object())
    assert megatron_optimizer.clip_gradients_without_host_sync.body().startswith("not needed")


@pytest.mark.parametrize("max_norm", [0.5, 100.0])  # clipping, and no clipping
def test_device_grad_norm_and_clip_match_upstream(cpu_dist, max_norm):
    from megatron.core.optimizer import optimizer as mixed_precision

    patches.apply_core_patches()
    assert mixed_precision.get_grad_norm_fp32 is megatron_optimizer.grad_norm_on_device
    assert mixed_precision.clip_grad_by_total_norm_fp32 is megatron_optimizer.clip_by_device_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(5, 3), (7,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in params]
    norm = megatron_optimizer.grad_norm_on_device(grads)
    assert torch.is_tensor(norm) and norm.dim() == 0  # nothing read on the host
    # Upstream's norm paths allocate on CUDA; the same norm, in float64:
    expected_norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]).double()))
    assert float(norm) == pytest.approx(expected_norm, rel=1e-6)

    expected = [g.clone() for g in grads]
    coeff = max_norm / (expected_norm + 1.0e-6)
    if coeff < 1.0:  # upstream's rule, on the host
        expected = [g * coeff for g in expected]
    megatron_optimizer.clip_by_device_norm(params, max_norm, norm)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    if max_norm == 100.0:  # not clipping leaves the gradients bitwise unchanged
        assert all(torch.equal(g, w) for g, w in zip(grads, expected))


# -- host time and statistics -----------------------------------------------------------------

def test_argument_type_check_accepts_and_refuses_what_upstream_does():
    import dataclasses

    from megatron.packed_graphs.packed_seq import build_packed_batch_params

    patches.apply_core_patches()
    patched = cuda_graphs._check_supported_type
    assert patched is not graph_engine.UPSTREAM_CHECK_SUPPORTED_TYPE
    cu = torch.tensor([0, 3], dtype=torch.int32)

    @dataclasses.dataclass
    class Plain:
        x: int = 1

    accepted = [torch.zeros(2), None, True, 3, "thd", 1.5, Plain(),
                build_packed_batch_params(cu, torch.arange(3), 3),
                cuda_graphs.ArgMetadata(torch.zeros(1))]
    refused = [[1, 2], {"a": 1}, (1,), object()]
    for value in accepted:
        meta = cuda_graphs.ArgMetadata(value)
        graph_engine.UPSTREAM_CHECK_SUPPORTED_TYPE(meta)
        patched(meta)
    for value in refused:
        meta = cuda_graphs.ArgMetadata(value)
        with pytest.raises(AssertionError):
            graph_engine.UPSTREAM_CHECK_SUPPORTED_TYPE(meta)
        with pytest.raises(AssertionError, match="graphs do not support"):
            patched(meta)
    with pytest.raises(AssertionError):
        patched(torch.zeros(1))  # not an ArgMetadata: refused by both


def test_upstream_zero_fills_graph_inputs_reached_through_dataclasses():
    # What warm_up_graphs_on_recorded_layouts answers: upstream maps the tensors inside a
    # dataclass argument (PackedSeqParams) to graph input buffers, made by zeros_like.
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    mapped = cuda_graphs.tree_map(
        lambda t: cuda_graphs.ArgMetadata(t) if torch.is_tensor(t) else t, {"p": params})
    assert isinstance(mapped["p"].cu_seqlens_q, cuda_graphs.ArgMetadata)
    upstream = graph_engine.UPSTREAM_ARG_METADATA_ZEROS_LIKE
    meta = cuda_graphs.ArgMetadata(cu)
    assert torch.equal(upstream(meta), torch.zeros_like(cu))


def test_graph_warm_up_gets_the_recorded_packed_layout():
    patches.apply_core_patches()
    cu = torch.tensor([0, 5, 12, 16, 16], dtype=torch.int32)
    mask = torch.arange(16) >= 12
    hidden = torch.randn(16, 1, 8, requires_grad=True)
    buffers = {name: cuda_graphs.ArgMetadata(t).zeros_like()
               for name, t in (("cu", cu), ("mask", mask), ("hidden", hidden))}
    assert torch.equal(buffers["cu"], cu) and buffers["cu"].data_ptr() != cu.data_ptr()
    assert torch.equal(buffers["mask"], mask)
    # Floating inputs keep upstream's zero buffers (activations: their values do not matter).
    assert not buffers["hidden"].any() and buffers["hidden"].requires_grad


def test_capture_statistics_are_kept():
    patches.apply_core_patches()
    from megatron.core.pipeline_parallel import schedules

    assert schedules.create_cudagraphs is not cuda_graphs.create_cudagraphs
    # Nothing recorded: upstream returns None and nothing is logged.
    before = len(graph_engine.capture_log)
    schedules.create_cudagraphs()
    assert len(graph_engine.capture_log) == before
    # source sentinel: the statistics are made only while _create_cudagraphs captures graphs
    assert '"time"' in source(cuda_graphs._CudagraphGlobalRecord._create_cudagraphs.__func__)


def test_local_capture_runs_inside_the_scoped_guards(monkeypatch):
    """The end-of-schedule capture (upstream's warm-up passes and capture) runs inside every
    guard of the enclosing `guard_local_capture` scopes, and only there."""
    from megatron.core.pipeline_parallel import schedules

    seen = []

    def upstream_capture():  # stands in for megatron-core's capture of the recorded graphs
        seen.append(list(entered))
        warned.append(torch._C._warn_on_accumulate_grad_stream_mismatch())
        return {"time": 0.5}

    warned = []

    entered = []

    events = []  # guard exits and stream switches, in order

    @contextlib.contextmanager
    def guard(name):
        entered.append(name)
        try:
            yield
        finally:
            entered.remove(name)
            events.append(f"exit {name}")

    monkeypatch.setattr(schedules, "create_cudagraphs", upstream_capture)
    monkeypatch.setattr(graph_engine, "reserved_without_cache", lambda: 0)  # needs CUDA
    record = cuda_graphs._CudagraphGlobalRecord
    monkeypatch.setattr(record, "cudagraph_created", False)
    monkeypatch.setattr(record, "cudagraph_record", [object(), object()])
    monkeypatch.setattr(graph_engine, "capture_log", collections.deque(maxlen=8))
    streams = []  # no CUDA here: the process's stream is a name
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "side stream")
    monkeypatch.setattr(torch.cuda, "set_stream",
                        lambda s: (streams.append(s), events.append(f"stream {s}")))
    graph_engine.record_capture_statistics.body()  # wraps the stand-in
    with graph_engine.guard_local_capture(lambda: guard("moe")):
        with graph_engine.guard_local_capture(lambda: guard("other")):
            schedules.create_cudagraphs()
        schedules.create_cudagraphs()
    schedules.create_cudagraphs()
    assert seen == [["moe", "other"], ["moe"], []]
    # torch's stream-mismatch warning is off while capturing, on again afterwards
    assert warned == [False] * 3 and torch._C._warn_on_accumulate_grad_stream_mismatch()
    assert entered == [] and graph_engine._capture_guards == []
    assert list(graph_engine.capture_log)[-1] == {"time": 0.5, "graphs": 2,
                                                  "graph_reserved_bytes": 0}
    assert streams == ["side stream"] * 3  # back on the stream the capture began on
    # ... before the guards restore anything (they write on the stream that reads next).
    assert events[:3] == ["stream side stream", "exit other", "exit moe"]


def test_stream_crossings_are_unreported_within_only():
    with pytest.raises(RuntimeError):
        with graph_engine.stream_crossings_unreported():
            assert not torch._C._warn_on_accumulate_grad_stream_mismatch()
            raise RuntimeError("capture failed")
    assert torch._C._warn_on_accumulate_grad_stream_mismatch()  # as before, also on errors
    torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    try:
        with graph_engine.stream_crossings_unreported():
            pass
        assert not torch._C._warn_on_accumulate_grad_stream_mismatch()  # a user's choice kept
    finally:
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(True)


def test_upstream_capture_ends_on_the_default_stream():
    # Why record_capture_statistics puts the process back on its own stream.
    # source sentinel: the switch happens only after _create_cudagraphs captured graphs on a GPU
    body = source(cuda_graphs._CudagraphGlobalRecord._create_cudagraphs)
    assert "torch.cuda.set_stream(torch.cuda.default_stream())" in body


def test_capture_log_keeps_the_last_few_captures_only():
    # The graph runtime empties it after each capture; a run that captures without a runtime
    # (tools, tests) keeps a bounded log.
    saved = list(graph_engine.capture_log)
    try:
        for i in range(20):
            graph_engine.capture_log.append({"time": i})
        assert 0 < len(graph_engine.capture_log) <= 8
        assert graph_engine.capture_log[-1] == {"time": 19}
    finally:
        graph_engine.capture_log.clear()
        graph_engine.capture_log.extend(saved)


# -- reaches ----------------------------------------------------------------------------------

def test_runner_order_helpers():
    manager = SimpleNamespace(cudagraph_runners=["a", "b", "c"])
    graph_engine.rotate_runners(manager)
    assert manager.cudagraph_runners == ["b", "c", "a"]
    graph_engine.replay_runner_first(manager, "c", ["a", "b", "c"])
    assert manager.cudagraph_runners == ["c", "a", "b"]
    graph_engine.sort_runners(manager, key=lambda r: r != "b")
    assert manager.cudagraph_runners == ["b", "c", "a"]


def test_upstream_round_robin_and_first_match_are_what_the_runner_helpers_assume(monkeypatch):
    get_runner = cuda_graphs.CudaGraphManager.get_cudagraph_runner
    ready, done = cuda_graphs._GraphStatus.FWD_READY, cuda_graphs._GraphStatus.BWD_READY

    def runner(name, status=ready):
        return SimpleNamespace(name=name, status=status, grad_enabled=True,
                               get_mismatch_errors=lambda args, kwargs: [])

    monkeypatch.setattr(cuda_graphs._CudagraphGlobalRecord, "cudagraph_created", True)
    # A runner per micro-batch (pipeline parallel): the first, then the list rotated by one.
    runners = [runner("a"), runner("b"), runner("c")]
    manager = SimpleNamespace(cudagraph_runners=list(runners), need_backward=True)
    assert [get_runner(manager, None, (), {}, False).name for _ in range(4)] == list("abca")
    assert manager.cudagraph_runners == runners[1:] + runners[:1]
    # Reused graphs: the first runner ready for a forward, in capture order, list unchanged.
    runners = [runner("a", done), runner("b"), runner("c")]
    manager = SimpleNamespace(cudagraph_runners=list(runners), need_backward=True,
                              custom_cudagraphs_lookup_table={})
    assert [get_runner(manager, None, (), {}, True).name for _ in range(2)] == ["b", "b"]
    assert manager.cudagraph_runners == runners


def test_te_capture_flag_is_set_only_inside_the_window():
    assert not cuda_graphs.is_graph_capturing()
    with graph_engine.te_graph_capture():
        assert cuda_graphs.is_graph_capturing()
    assert not cuda_graphs.is_graph_capturing()


def test_block_class_switch_refuses_a_subclass_with_state():
    from megatron.core.transformer.transformer_block import TransformerBlock

    class WithInit(TransformerBlock):
        def __init__(self):  # state of its own: switching the class would skip it
            pass

    with pytest.raises(TypeError, match="without an __init__"):
        model_layers.switch_block_class(object(), WithInit)


def test_gpt_model_still_builds_transformer_block_by_name(cpu_dist, monkeypatch):
    # When this fails, GPTModel takes a block class or spec: drop switch_block_class.
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer.transformer_config import TransformerConfig

    built = []

    class Block(torch.nn.Module):  # looked up in gpt_model's namespace when the model builds
        def __init__(self, config, spec, **kwargs):
            super().__init__()
            built.append(spec)

    monkeypatch.setattr(gpt_model, "TransformerBlock", Block)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               use_cpu_initialization=True)
    model = gpt_model.GPTModel(config, "the layer spec", vocab_size=32, max_sequence_length=8,
                               position_embedding_type="none")
    assert isinstance(model.decoder, Block) and built == ["the layer spec"]


def test_cached_rope_table_is_copied_only_while_graphs_are_recorded(monkeypatch):
    rope = torch.arange(6.0).reshape(3, 1, 1, 2)
    kwargs = {"hidden_states": torch.zeros(1), "rotary_pos_emb": rope}
    recorded = graph_engine.unshare_cached_graph_inputs(kwargs)
    assert recorded["rotary_pos_emb"] is not rope and torch.equal(recorded["rotary_pos_emb"], rope)
    assert recorded["hidden_states"] is kwargs["hidden_states"] and kwargs["rotary_pos_emb"] is rope
    pair = graph_engine.unshare_cached_graph_inputs({"rotary_pos_emb": (rope, rope)})
    assert all(t is not rope for t in pair["rotary_pos_emb"])
    assert graph_engine.unshare_cached_graph_inputs({"rotary_pos_emb": None})["rotary_pos_emb"] is None
    monkeypatch.setattr(cuda_graphs._CudagraphGlobalRecord, "cudagraph_created", True)
    assert graph_engine.unshare_cached_graph_inputs(kwargs) is kwargs  # replay: no copy


def test_upstream_caches_the_rope_table_and_counts_shared_graph_inputs():
    # When this fails, re-check unshare_cached_graph_inputs.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    assert hasattr(RotaryEmbedding.forward, "cache_info")  # functools.lru_cache
    # source sentinel: the count is checked only after _create_cudagraphs captured graphs
    assert "assert fwd_buffer_reuse_ref_count == 0" in source(
        cuda_graphs._CudagraphGlobalRecord._create_cudagraphs.__func__)


def test_te_graphs_take_the_layers_megatron_core_graphs_for_the_modules():
    # When this fails, re-check layer_graphed_for_modules (te_graphs.graphable_layers).
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.enums import CudaGraphModule as Module
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def bare(cls):  # an instance that only isinstance checks read
        instance = object.__new__(cls)
        torch.nn.Module.__init__(instance)
        return instance

    def layer(attention, mlp):
        built = bare(TransformerLayer)
        built.self_attention, built.cross_attention, built.mlp = attention, IdentityOp(), mlp
        return built

    def graphable(layer, *modules):
        config = SimpleNamespace(cuda_graph_modules=list(modules))
        return cuda_graphs._layer_is_graphable(layer, config)

    attention = layer(torch.nn.Linear(1, 1), bare(MoELayer))
    moe = layer(IdentityOp(), bare(MoELayer))
    dense = layer(IdentityOp(), bare(MLP))
    assert graphable(moe) and graphable(dense)  # no modules: every layer
    assert not graphable(torch.nn.Linear(1, 1))  # not a graphable module
    assert graphable(attention, Module.attn) and not graphable(moe, Module.attn)
    for module in (Module.moe, Module.moe_router, Module.moe_preprocess):
        assert graphable(moe, module) and not graphable(dense, module)
    assert graphable(dense, Module.mlp) and not graphable(moe, Module.mlp)
    assert graphable(bare(MambaLayer), Module.mamba) and not graphable(moe, Module.mamba)


# -- TE's fused cross entropy ------------------------------------------------------------------

def test_upstream_asks_te_cross_entropy_for_capturable_only_under_its_full_iteration_graphs(
        monkeypatch):
    from megatron.core.models.common.language_module import language_module

    assert hasattr(language_module, "te_parallel_cross_entropy")  # looked up by name
    asked = []

    def te_cross_entropy(logits, labels, tp_group, is_cg_capturable):
        asked.append((tp_group, is_cg_capturable))
        return torch.zeros(labels.shape)

    monkeypatch.setattr(language_module, "te_parallel_cross_entropy", te_cross_entropy)
    monkeypatch.setattr(language_module, "is_te_min_version", lambda version: True)
    labels, logits = torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2, 5)
    for impl in ("local", "transformer_engine", "full_iteration"):
        model = SimpleNamespace(pg_collection=SimpleNamespace(tp="tp"), config=SimpleNamespace(
            cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te", cuda_graph_impl=impl))
        loss = language_module.LanguageModule.compute_language_model_loss(model, labels, logits)
        assert loss.shape == (2, 3)
    assert asked == [("tp", False), ("tp", False), ("tp", True)]


def _te_cross_entropy_backward(monkeypatch, backward) -> None:
    """Stand in for TE's Triton module: only its backward's signature is read."""
    module = SimpleNamespace(cross_entropy_backward=backward)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.triton.cross_entropy", module)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.triton",
                        SimpleNamespace(cross_entropy=module))


def test_te_cross_entropy_is_always_asked_for_its_capturable_backward(monkeypatch):
    from megatron.core.models.common.language_module import language_module

    calls = []
    monkeypatch.setattr(language_module, "te_parallel_cross_entropy",
                        lambda logits, labels, group, capturable: calls.append(capturable))
    # TE 2.7 to 2.11: the backward takes the flag and, without it, reads a host scalar.
    _te_cross_entropy_backward(monkeypatch, lambda inp, grad, is_cg_capturable=False: inp)
    assert model_layers.te_cross_entropy_capturable.body() == "applied"
    language_module.te_parallel_cross_entropy("logits", "labels", None, False)
    assert calls == [True]


def test_te_cross_entropy_patch_is_not_needed_without_te_or_with_an_always_capturable_te(
        monkeypatch):
    from megatron.core.models.common.language_module import language_module

    monkeypatch.setattr(language_module, "te_parallel_cross_entropy", None)
    assert model_layers.te_cross_entropy_capturable.body().startswith("not needed: Transformer Engine")
    upstream = lambda logits, labels, group, capturable=False: None  # noqa: E731
    monkeypatch.setattr(language_module, "te_parallel_cross_entropy", upstream)
    # TE 2.20: the flag is gone from the backward, which never reads the host.
    _te_cross_entropy_backward(
        monkeypatch, lambda saved, stats, target, n_non_ignore, grad, *rest: saved)
    assert model_layers.te_cross_entropy_capturable.body().endswith("always capturable")
    assert language_module.te_parallel_cross_entropy is upstream


# -- the seam into Megatron-LM's loop ------------------------------------------------------

def test_upstream_loop_reaches_the_seam_through_module_names():
    """train() and evaluate() look the schedule up by name at call time, pretrain() builds
    through setup_model_and_optimizer, and that builds the optimizer config by name: the three
    names route_training_loop replaces."""
    import megatron.training.training as loop

    # source sentinel: pretrain, train, evaluate and get_model need a Megatron-LM run on a GPU
    for function in (loop.train, loop.evaluate):
        assert "get_forward_backward_func(" in inspect.getsource(function)
    assert "setup_model_and_optimizer(" in inspect.getsource(loop.pretrain)
    assert "get_megatron_optimizer_config(args)" in inspect.getsource(
        loop.setup_model_and_optimizer)
    # Upstream's own graph wrappers key on these two args fields, which the fork hides.
    source = inspect.getsource(loop.train)
    assert 'args.cuda_graph_impl == "full_iteration"' in source
    assert "if args.optimizer_cuda_graph:" in source
    # get_model wraps DDP by name, on a stream of its own (ddp_on_the_process_stream)
    source = inspect.getsource(loop.get_model)
    assert "ddp_stream = torch.cuda.Stream()" in source
    assert "model = wrap_model_chunks_with_ddp(" in source


def test_the_seam_wraps_upstream_schedule_after_the_set_up(monkeypatch, restored_training_loop):
    loop = restored_training_loop
    from megatron.core.rerun_state_machine import RerunStateMachine

    config = SimpleNamespace(optimizer_cuda_graph=False)
    args_seen = []

    def optimizer_config(args):
        args_seen.append(args.optimizer_cuda_graph)
        return config, "overrides"

    optimizer = SimpleNamespace(grad_scaler=None)
    model = [SimpleNamespace(config=SimpleNamespace(num_layers=2, mtp_num_layers=None))]
    monkeypatch.setattr(loop, "setup_model_and_optimizer",
                        lambda *a, **k: (model, optimizer, "s"))
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", SimpleNamespace(num_experts=None))
    monkeypatch.setattr(loop, "get_forward_backward_func", lambda **k: "schedule")
    monkeypatch.setattr(loop, "get_megatron_optimizer_config", optimizer_config)
    from megatron.training.dist_signal_handler import DistributedSignalHandler

    built = []

    def on_setup(model, optimizer, scheduler):
        built.append((model, optimizer, scheduler))
        return lambda schedule: f"seam around {schedule}"

    training_loop.route_training_loop(on_setup, capturable_optimizer=True)
    assert loop.get_forward_backward_func(schedule_pg_collection=None) == "schedule"
    assert loop.setup_model_and_optimizer("model_type") == (model, optimizer, "s")
    assert built == [(model, optimizer, "s")]
    assert optimizer.get_loss_scale() is megatron_optimizer.LOSS_SCALE_ONE
    assert (loop.logical_and_across_model_parallel_group
            is training_loop.all_model_parallel_ranks_updated)
    assert (loop.reduce_max_stat_across_model_parallel_group
            is training_loop.max_stat_across_model_parallel_ranks)
    assert RerunStateMachine._reduce_any is training_loop.any_rank_requested
    assert DistributedSignalHandler.signals_received is training_loop.signals_received_on_host
    assert loop.get_forward_backward_func(schedule_pg_collection=None) == "seam around schedule"
    args = SimpleNamespace(optimizer_cuda_graph=False)
    assert loop.get_megatron_optimizer_config(args) == (config, "overrides")
    assert args_seen == [True] and args.optimizer_cuda_graph is False  # shown False again


def test_the_process_moves_to_a_side_stream_once(monkeypatch):
    """On the default stream: a new stream, made current. On a stream megatron-core's graph
    manager switched to: that one, kept. Either waits for the default stream (the model was
    built there); a second call changes nothing."""
    class FakeStream:
        def __init__(self, name="new"):
            self.name, self.waited_for = name, []

        def wait_stream(self, other):
            self.waited_for.append(other.name)

    default = FakeStream("default")
    for start, expected in ((default, "new"), (FakeStream("manager's"), "manager's")):
        current = [start]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "default_stream", lambda: default)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[0])
        monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
        monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.__setitem__(0, stream))
        monkeypatch.setattr(graph_engine, "_side_stream", None)
        graph_engine.use_side_stream()
        side = graph_engine._side_stream
        assert side.name == expected and current[0] is side and side.waited_for == ["default"]
        current[0] = default  # e.g. a stream scope's exit
        graph_engine.use_side_stream()
        assert graph_engine._side_stream is side and current[0] is default  # once per process


def test_ddp_is_built_on_the_process_stream(monkeypatch, restored_training_loop):
    """Upstream's DDP wrapping runs on the process's side stream, whatever stream get_model
    made current around it, and as upstream has it where the process is on none (no CUDA);
    route_training_loop wraps it once however often it is called. use_side_stream does
    nothing without CUDA."""
    loop = restored_training_loop

    entered = []

    @contextlib.contextmanager
    def stream(which):
        entered.append(which)
        yield

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(graph_engine, "_side_stream", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    graph_engine.use_side_stream()
    assert graph_engine._side_stream is None
    monkeypatch.setattr(loop, "wrap_model_chunks_with_ddp", lambda model, *a, **k: f"ddp {model}")
    wrap = megatron_ddp.ddp_on_the_process_stream(loop.wrap_model_chunks_with_ddp)
    assert wrap("m", "config") == "ddp m" and entered == []  # upstream's call as it is
    monkeypatch.setattr(graph_engine, "_side_stream", "side")
    assert wrap("m") == "ddp m" and entered == ["side"]

    training_loop.route_training_loop(lambda *built: None)
    once = loop.wrap_model_chunks_with_ddp
    training_loop.route_training_loop(lambda *built: None)
    assert loop.wrap_model_chunks_with_ddp is once  # installing twice = once
    assert once("m") == "ddp m" and entered[-1] == "side"


def test_a_graph_manager_built_after_ddp_leaves_the_process_on_its_stream(cpu_dist, monkeypatch):
    """megatron-core's first CudaGraphManager switches the process to a new stream (run here,
    with the CUDA objects stood in for); a chunk's manager, built at its first forward, is
    switched back."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from tests.unit.conftest import tiny_moe_config

    current = ["process"]
    streams = iter(["new", "newer"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.__setitem__(0, stream))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: next(streams))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(get_cuda_rng_tracker(), "use_cudagraphable_rng", True, raising=False)
    monkeypatch.setattr(cuda_graphs.CudaGraphManager, "global_mempool", None)
    config = tiny_moe_config(cuda_graph_impl="local")

    manager = graph_engine.graph_manager_on_the_process_stream(config)
    cuda_graphs._CudagraphGlobalRecord._disable_saved_tensors_observer()  # armed by it
    assert isinstance(manager, cuda_graphs.CudaGraphManager)
    assert current == ["process"]  # switched, and switched back
    monkeypatch.setattr(cuda_graphs.CudaGraphManager, "global_mempool", None)
    cuda_graphs.CudaGraphManager(config, need_backward=False)  # upstream alone, first manager
    assert current == ["newer"]
    cuda_graphs.CudaGraphManager(config, need_backward=False)  # later managers: no switch
    assert current == ["newer"]


def test_upstream_router_sizes_its_metrics_by_the_models_layer_count(cpu_moe):
    """A router records its losses in a slot per layer of the whole model (config.num_layers),
    whatever its pipeline stage holds: what size_moe_metrics_as_the_routers_do matches."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.packed_graphs.specs import moe_layer_spec
    from megatron.packed_model.providers import backend_provider
    from tests.unit.conftest import tiny_moe_config

    config = tiny_moe_config(num_layers=6, hidden_size=32, num_moe_experts=4, moe_router_topk=2,
                             moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                             moe_z_loss_coeff=1e-3)
    torch.manual_seed(0)
    spec = moe_layer_spec(backend_provider("torch"), "RMSNorm", 4)  # no attention: MoE only
    layer = build_module(spec, config=config, layer_number=4)
    out = layer(torch.randn(8, 1, 32, requires_grad=True), attention_mask=None)
    assert cpu_moe.metrics  # the forward recorded its losses
    for name, entry in cpu_moe.metrics.items():
        values = entry.values.tolist()
        assert len(values) == 6, name
        assert [i for i, v in enumerate(values) if v != 0] == [3], name  # layer 4's slot
    del out


def test_moe_metrics_take_the_routers_size_on_every_pipeline_stage(monkeypatch):
    """A hybrid stage without MoE layers would create Megatron-LM's MoE metrics at the number
    of MoE layers, its peer's routers at one slot per layer: the pipeline all-reduce of two
    sizes hangs. Pins the upstream code, then checks the patch sizes them alike."""
    import types

    import megatron.training.training as loop
    from megatron.core.transformer.moe import moe_logging

    # source sentinel: training_log needs a Megatron-LM run on a GPU
    log_source = inspect.getsource(loop.training_log)
    assert "layers = itemgetter(Symbols.MOE)(get_hybrid_layer_counts(" in log_source
    assert "force_initialize=True" in log_source

    tracker = moe_logging.MoEMetricsTracker()
    monkeypatch.setattr(moe_logging, "get_moe_metrics_tracker", lambda: tracker)
    args = types.SimpleNamespace(num_experts=4, moe_router_load_balancing_type="seq_aux_loss",
                                 moe_z_loss_coeff=1e-3)
    assert training_loop.moe_metric_names(args) == [
        "load_balancing_loss", "seq_load_balancing_loss", "z_loss"]  # upstream's substring test
    assert training_loop.moe_metric_names(types.SimpleNamespace(
        moe_router_load_balancing_type=["global_aux_loss"], moe_z_loss_coeff=None)) == [
        "global_load_balancing_loss"]

    # Upstream alone: the stage without routers gets the MoE-layer count (1 for "M*-EM*").
    tracker.ensure_initialized("z_loss", 1)
    assert tracker.metrics["z_loss"].values.numel() == 1
    tracker.metrics.clear()

    config = types.SimpleNamespace(num_layers=6, mtp_num_layers=None)
    training_loop.size_moe_metrics_as_the_routers_do(args, config)
    tracker.ensure_initialized("z_loss", 1)  # training_log's force_initialize keeps it
    assert {name: entry.values.numel() for name, entry in tracker.metrics.items()} == {
        "load_balancing_loss": 6, "seq_load_balancing_loss": 6, "z_loss": 6}
    # A router's record on a stage with MoE layers writes its slot and sets its groups.
    tracker.record("z_loss", torch.tensor(2.0), layer_number=4, num_layers=6,
                   reduce_group="tp_cp")
    assert tracker.metrics["z_loss"].values.tolist() == [0, 0, 0, 2.0, 0, 0]
    assert tracker.metrics["z_loss"].reduce_group == "tp_cp"

    tracker.metrics.clear()
    training_loop.size_moe_metrics_as_the_routers_do(
        types.SimpleNamespace(num_experts=None), config)  # a dense model: nothing to size
    assert not tracker.metrics


def test_upstream_loop_reads_its_step_statistics_through_module_names():
    """The per-iteration reads route_training_loop takes out: train_step reduces the update flag
    and the gradient norm, training_log the learning rate, by their names in the loop module;
    train() reads the loss scale with .item() (the next test runs the loss scale itself)."""
    import megatron.training.training as loop

    # source sentinel: train_step, training_log and train need a Megatron-LM run on a GPU
    step = inspect.getsource(loop.train_step)
    assert "logical_and_across_model_parallel_group(update_successful" in step
    assert "reduce_max_stat_across_model_parallel_group(grad_norm" in step
    assert "reduce_max_stat_across_model_parallel_group(" in inspect.getsource(loop.training_log)
    assert "optimizer.get_loss_scale().item()" in inspect.getsource(loop.train)


def test_upstream_loss_scale_without_a_scaler_is_the_constant_one_scale_loss_multiplies_by():
    from megatron.core.optimizer import optimizer as upstream

    one, scale = torch.tensor([1.0]), torch.tensor([1024.0])
    mixed = SimpleNamespace(grad_scaler=None, _scale_one=one)
    assert upstream.MixedPrecisionOptimizer.get_loss_scale(mixed) is one
    mixed.grad_scaler = SimpleNamespace(scale=scale)
    assert upstream.MixedPrecisionOptimizer.get_loss_scale(mixed) is scale
    assert upstream.FP32Optimizer.get_loss_scale(SimpleNamespace(_scale=one)) is one
    first = SimpleNamespace(get_loss_scale=lambda: scale)
    chained = SimpleNamespace(chained_optimizers=[first, SimpleNamespace(get_loss_scale=None)])
    assert upstream.ChainedOptimizer.get_loss_scale(chained) is scale  # the first part's
    loss = torch.tensor([2.0, 3.0])
    scaled = upstream.MegatronOptimizer.scale_loss(SimpleNamespace(get_loss_scale=lambda: scale),
                                                   loss)
    assert torch.equal(scaled, loss * 1024.0)


def test_step_statistics_of_a_model_parallel_group_of_one_are_not_read_back(cpu_dist):
    # The optimizer's device norm (0-dim, or 1-element from the optimizer graph) is not read
    # here, and comes back 0-dim: the log line formats it as a number.
    for norm in (torch.tensor(2.5), torch.tensor([2.5])):
        kept = training_loop.max_stat_across_model_parallel_ranks(norm)
        assert kept.shape == () and kept.data_ptr() == norm.data_ptr()
        assert f"{kept:.3f}" == "2.500"
    assert training_loop.max_stat_across_model_parallel_ranks(None) is None
    assert training_loop.max_stat_across_model_parallel_ranks(3e-4) == 3e-4
    assert training_loop.all_model_parallel_ranks_updated(True) is True
    assert training_loop.all_model_parallel_ranks_updated(False) is False


def test_upstream_log_and_rerun_machine_copy_host_values_to_the_device_each_iteration():
    """The two per-iteration syncs the loop patches remove: training_log's default loss sum is
    a host-to-device copy evaluated for every loss key, and the writers are the only other
    readers of the iteration's losses; the rerun machine reduces host flags as CUDA tensors."""
    import megatron.training.training as loop
    from megatron.core.rerun_state_machine import RerunStateMachine

    # source sentinel: training_log allocates on CUDA and needs a Megatron-LM run on a GPU
    log = source(getattr(loop.training_log, "__wrapped__", loop.training_log))
    assert ("total_loss_dict.get(key, torch.tensor([0.0], dtype=torch.float, device='cuda'))"
            in log)
    import re

    # the sum, the NaN check, three writer calls: nothing else reads the iteration's losses
    assert len(re.findall(r"(?<!total_)loss_dict\[key\]", log)) == 5
    assert "if writer and (iteration % args.tensorboard_log_interval == 0):" in log
    assert list(inspect.signature(loop.train_step).parameters)[:1] == ["forward_step_func"]
    parameters = inspect.signature(getattr(loop.training_log, "__wrapped__",
                                           loop.training_log)).parameters
    assert {"loss_dict", "total_loss_dict", "iteration", "skipped_iter"} <= set(parameters)
    assert RerunStateMachine._reduce_any in (training_loop.UPSTREAM_REDUCE_ANY,
                                             training_loop.any_rank_requested)


def test_upstream_rerun_machine_reduces_host_flags_as_cuda_tensors(cpu_dist, monkeypatch):
    from megatron.core import rerun_state_machine

    devices = []

    class RecordingTorch(_HostTorch):
        @staticmethod
        def tensor(*args, device=None, **kwargs):
            devices.append(device)
            return torch.tensor(*args, **kwargs)

    monkeypatch.setattr(rerun_state_machine, "torch", RecordingTorch())
    reduced = []
    real_all_reduce = torch.distributed.all_reduce
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda tensor, *a, **k: reduced.append(tensor) or real_all_reduce(tensor))
    assert training_loop.UPSTREAM_REDUCE_ANY(None, True) is True
    assert training_loop.UPSTREAM_REDUCE_ANY(None, [False, True]) == (False, True)
    assert devices == ["cuda", "cuda"] and len(reduced) == 2  # a device copy and a reduce each


def _training_log_stand_in(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                           report_memory_flag, skipped_iter, grad_norm, params_norm,
                           num_zeros_in_grad, max_attention_logit, pg_collection=None,
                           is_first_iteration=False, **more):
    _training_log_stand_in.calls.append((dict(loss_dict), iteration, skipped_iter))
    return "flag"


@pytest.mark.parametrize("writer", [False, True])
def test_training_log_sums_losses_on_the_device_and_hands_upstream_what_it_reads(
        monkeypatch, writer):
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "get_args",
                        lambda: SimpleNamespace(tensorboard_log_interval=2))
    monkeypatch.setattr(global_vars, "get_tensorboard_writer",
                        lambda: object() if writer else None)
    _training_log_stand_in.calls = []
    log = training_loop.training_log_summing_losses_on_device(_training_log_stand_in)
    sums, losses = {}, [torch.tensor(2.25), torch.tensor(1.0 / 3), torch.tensor(float("nan"))]
    for iteration, loss in enumerate(losses[:2], start=1):  # positional, as train() calls it
        assert log({"lm loss": loss}, sums, 1e-4, iteration, 1.0, True, 0, None, None, None, 0,
                   pg_collection=None, is_first_iteration=iteration == 1) == "flag"
    log({"lm loss": losses[2]}, sums, 1e-4, 3, 1.0, True, 1, None, None, None, 0)  # skipped
    # upstream's own sum, bitwise: its default operand is tensor([0.]) on the device
    expected = torch.tensor([0.0]) + losses[0]
    if not writer:
        expected = expected + losses[1]
    assert torch.equal(sums["lm loss"], expected) and sums["lm loss"].shape == (1,)
    handed = [(bool(d), it, skipped) for d, it, skipped in _training_log_stand_in.calls]
    assert handed == [(False, 1, 0), (writer, 2, 0), (True, 3, 1)]


def test_upstream_exit_signal_check_gathers_a_cuda_flag_every_iteration(cpu_dist, monkeypatch):
    import megatron.training.training as loop
    from megatron.training import dist_signal_handler

    # Every iteration's exit check asks the handler, which gathers its flag...
    asked = []
    handler = SimpleNamespace(signals_received=lambda: asked.append(True) or [False])
    monkeypatch.setattr(loop, "get_args", lambda: SimpleNamespace(
        exit_signal_handler=True, save=None, save_interval=None,
        non_persistent_save_interval=None, exit_duration_in_mins=None, exit_interval=None,
        phase_transition_iterations=None))
    monkeypatch.setattr(loop, "get_timers", lambda: None)
    monkeypatch.setattr(loop, "get_signal_handler", lambda: handler)
    for iteration in (1, 2):
        assert not loop.checkpoint_and_decide_exit(None, None, None, iteration, 0, None, None)
    assert asked == [True, True]
    handler.signals_received = lambda: [False, True]
    monkeypatch.setattr(loop, "print_datetime", lambda message: None)
    assert loop.checkpoint_and_decide_exit(None, None, None, 3, 0, None, None)

    gathered = []
    monkeypatch.setattr(dist_signal_handler, "all_gather_item",
                        lambda item, dtype: gathered.append((item, dtype)) or [item])
    upstream_handler = SimpleNamespace(_signal_received=True)
    assert dist_signal_handler.DistributedSignalHandler.signals_received(upstream_handler) == [True]
    assert gathered == [(True, torch.int32)]
    monkeypatch.undo()
    # ... as a tensor on the process group's device: the GPU under NCCL.
    assert dist_signal_handler.all_gather_item(True, dtype=torch.int32) == [1]  # gloo: host
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *args: "nccl")
    assert dist_signal_handler.get_device(3) == torch.device("cuda:3")


def test_exit_signal_flags_are_gathered_without_the_device(cpu_dist):
    handler = SimpleNamespace(_signal_received=True)
    assert training_loop.signals_received_on_host(handler) == [True]


def test_rerun_flags_are_reduced_without_the_device(cpu_dist):
    assert training_loop.any_rank_requested(None, True) is True
    assert training_loop.any_rank_requested(None, False) is False
    assert training_loop.any_rank_requested(None, [False, True]) == (False, True)


def _two_rank_rerun_flags(rank, store, results):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                         world_size=2)
    try:
        results.put((rank, training_loop.any_rank_requested(None, rank == 1),
                     training_loop.any_rank_requested(None, [False, rank == 0]),
                     training_loop.signals_received_on_host(
                         SimpleNamespace(_signal_received=rank == 1))))
    finally:
        torch.distributed.destroy_process_group()


def test_rerun_and_exit_signal_flags_of_two_ranks_meet_on_a_host_group(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_two_rank_rerun_flags,
                             args=(rank, str(tmp_path / "store"), results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    got = sorted(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    assert got == [(0, True, (False, True), [False, True]),
                   (1, True, (False, True), [False, True])]


def test_loss_scale_goes_to_the_host_only_without_a_scaler():
    from megatron.core.optimizer import optimizer as upstream
    from megatron.core.pipeline_parallel import schedules

    parts = [SimpleNamespace(grad_scaler=None), SimpleNamespace(grad_scaler=None)]
    chained = SimpleNamespace(chained_optimizers=parts)
    assert megatron_optimizer.keep_loss_scale_on_host(chained)
    for optimizer in (chained, *parts):
        assert optimizer.get_loss_scale().item() == 1.0
    # upstream's scale_loss and the schedule's normalisation, with the host scalar
    loss = torch.tensor([2.0, 3.0]) / 7
    scaled = upstream.MegatronOptimizer.scale_loss(chained, loss)
    assert scaled.dtype == loss.dtype and torch.equal(scaled, loss)
    config = SimpleNamespace(grad_scale_func=lambda x: parts[0].get_loss_scale() * x)
    assert torch.equal(schedules._compute_loss_scale(config, torch.device("cpu")),
                       torch.ones(1))

    scaler = SimpleNamespace(scale=torch.tensor([1024.0]))
    fp16 = SimpleNamespace(grad_scaler=scaler, get_loss_scale=lambda: scaler.scale)
    assert not megatron_optimizer.keep_loss_scale_on_host(fp16)
    assert fp16.get_loss_scale() is scaler.scale


def test_the_wheel_ships_dataset_helpers_prebuilt_without_a_makefile(cpu_dist, monkeypatch):
    import os

    from megatron.core import datasets
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import initialize

    folder = os.path.dirname(datasets.__file__)
    assert not os.path.exists(os.path.join(folder, "Makefile"))
    assert any(name.startswith("helpers_cpp") for name in os.listdir(folder))
    # Megatron-LM's start-up builds them on rank 0 through the datasets' compile_helpers.
    built = []
    monkeypatch.setattr(dataset_utils, "compile_helpers", lambda: built.append(True))
    monkeypatch.setattr(initialize, "get_args", lambda: SimpleNamespace())
    initialize._compile_dependencies()
    assert built == [True]


# --------------------------------------------------- reaches moved here from the fork's modules

def test_upstream_runner_fields_the_buffer_reach_sets(monkeypatch):
    from megatron.core.transformer import cuda_graphs

    monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kwargs: None)
    built = cuda_graphs._CudaGraphRunner(SimpleNamespace(), "pool", (), {}, lambda: None, False)
    assert built.mempool == "pool"  # the field own_pool replaces
    # source sentinel: create_fwd_graph hands the field to torch.cuda.graph, at capture only
    assert "pool=self.mempool" in source(cuda_graphs._CudaGraphRunner.create_fwd_graph)
    runner = SimpleNamespace()
    graph_engine.keep_runner_buffers(runner)
    assert runner.keep_buffers_private and not hasattr(runner, "mempool")


def test_upstream_manager_installs_a_partial_graph_function_as_an_instance_attribute(
        cpu_dist, monkeypatch):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.cuda_graphs import CudaGraphManager
    from tests.unit.conftest import tiny_moe_config

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(get_cuda_rng_tracker(), "use_cudagraphable_rng", True, raising=False)
    monkeypatch.setattr(CudaGraphManager, "global_mempool", None)

    class Layer:
        def _forward_attention(self):
            return "plain"

    layer = Layer()
    manager = CudaGraphManager(tiny_moe_config(cuda_graph_impl="local"), layer,
                               "_forward_attention", need_backward=False)
    assert "_forward_attention" in vars(layer)  # on the instance: the class keeps its own
    assert layer._forward_attention(eager=True) == "plain" and manager.func() == "plain"
    assert Layer._forward_attention(layer) == "plain"
    module = SimpleNamespace(_forward_attention=lambda: "graphed")
    graph_engine.route_graphed_function(module, "_forward_attention", lambda: "routed")
    assert module._forward_attention() == "routed"

    class Plain:
        def _forward_attention(self):
            return "plain"

    with pytest.raises(RuntimeError, match="did not install a graphed '_forward_attention'"):
        graph_engine.route_graphed_function(Plain(), "_forward_attention", lambda: None)


def test_dispatcher_graph_state_follows_upstreams_dotted_attribute_names():
    from megatron.core.transformer.moe import moe_utils

    captured = SimpleNamespace(cudagraph_attrs=["probs", "comm.splits", "comm.absent"],
                               valid_cudagraph_attrs=None, probs=torch.zeros(1),
                               comm=SimpleNamespace(splits=torch.ones(1), absent=None))
    signal = moe_utils.MoECudaGraphPartialCaptureSignal(
        SimpleNamespace(token_dispatcher=captured), "preprocess", hidden_states=None, probs=None)
    signal.get_early_return_outputs(None, None)
    assert captured.valid_cudagraph_attrs == ["probs", "comm.splits"]  # dotted, tensors only
    inner = SimpleNamespace(splits=None)
    dispatcher = SimpleNamespace(valid_cudagraph_attrs=captured.valid_cudagraph_attrs,
                                 probs=None, comm=inner)
    model_layers.set_dispatcher_graph_state(dispatcher, [1, 2])
    assert (dispatcher.probs, inner.splits) == (1, 2)
    with pytest.raises(RuntimeError, match="returned 1 dispatcher tensors"):
        model_layers.set_dispatcher_graph_state(dispatcher, [1])


def test_dropless_dispatch_restores_the_dispatcher(cpu_moe):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.spec_utils import build_module
    from megatron.packed_graphs.specs import moe_layer_spec
    from megatron.packed_model.providers import backend_provider
    from tests.unit.conftest import tiny_moe_config

    # Every field the scope saves is one upstream's alltoall dispatcher holds after a forward.
    config = tiny_moe_config(hidden_size=32, num_moe_experts=4, moe_router_topk=2,
                             moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0,
                             moe_pad_expert_input_to_capacity=True)
    torch.manual_seed(0)
    layer = build_module(moe_layer_spec(backend_provider("torch"), "RMSNorm", 4), config=config,
                         layer_number=1)
    layer(torch.randn(8, 1, 32), attention_mask=None)
    upstream_dispatcher = layer.mlp.token_dispatcher
    assert isinstance(upstream_dispatcher, MoEAlltoAllTokenDispatcher)
    for name in model_layers.DISPATCHER_STATE:
        assert name in vars(upstream_dispatcher), name
    config = SimpleNamespace(moe_expert_capacity_factor=1.5,
                                   moe_pad_expert_input_to_capacity=True)
    dispatcher = SimpleNamespace(config=config, drop_and_pad=True, cuda_sync_point="x",
                                       input_splits=None, output_splits=None,
                                       output_splits_tp=None)
    with model_layers.dispatch_dropless(dispatcher):
        assert dispatcher.config.moe_expert_capacity_factor is None
        assert not dispatcher.config.moe_pad_expert_input_to_capacity
        assert not dispatcher.drop_and_pad
        dispatcher.input_splits = [3, 1]  # what a dropless call leaves behind
    assert dispatcher.config is config and dispatcher.drop_and_pad
    assert dispatcher.input_splits is None and config.moe_expert_capacity_factor == 1.5


def test_optimizer_reaches():
    from megatron.core.optimizer import optimizer as upstream

    # A save goes through each part's sharded_state_dict ...
    saved = []

    def part(i):
        return SimpleNamespace(
            sharded_state_dict=lambda model, loading, **kw: saved.append(i) or {})

    parts = [part(0), part(1)]
    chained = SimpleNamespace(chained_optimizers=parts, _synchronize_steps=lambda: None)
    upstream.ChainedOptimizer.sharded_state_dict(chained, {})
    upstream.ChainedOptimizer.sharded_state_dict(SimpleNamespace(chained_optimizers=parts[:1]), {})
    assert saved == [0, 1, 0]

    # ... which reads the part's own state_dict first.
    class Reached(Exception):
        pass

    def state_dict():
        raise Reached

    for cls in (upstream.Float16OptimizerWithFloat16Params, upstream.FP32Optimizer):
        with pytest.raises(Reached):
            cls.sharded_state_dict(SimpleNamespace(state_dict=state_dict), {}, False)
    calls = []

    class Part:
        def state_dict(self):
            calls.append("state_dict")
            return {"step": 1}

    @contextlib.contextmanager
    def scope():
        calls.append("enter")
        yield
        calls.append("exit")

    part = Part()
    megatron_optimizer.run_state_dict_within(part, scope)
    megatron_optimizer.install_optimizer_step(part, "graph")
    assert part.state_dict() == {"step": 1} and calls == ["enter", "state_dict", "exit"]
    assert part.step == "graph"


# -- dynamic CP: megatron-core's hybrid DP x CP groups at Megatron-LM's start-up ---------------

def test_upstream_start_up_builds_the_hybrid_cp_groups_from_the_args_field():
    """pretrain() starts up through initialize_megatron, which builds the process groups in
    _initialize_distributed (looked up by name at call time), passing the args field on."""
    import megatron.training.initialize as start_up
    import megatron.training.training as loop

    # source sentinel: pretrain and _initialize_distributed set up CUDA devices (a GPU run)
    assert "initialize_megatron(" in source(loop.pretrain)
    assert "_initialize_distributed(" in source(start_up.initialize_megatron)
    build = source(start_up._initialize_distributed)
    assert "args = get_args()" in build
    assert "hybrid_context_parallel=args.hybrid_context_parallel" in build


def test_upstream_hybrid_cp_is_more_than_its_groups(monkeypatch):
    """Why the field is on only while the groups are built: upstream's own hybrid CP wraps the
    training data, switches the schedule and wants its own data loader type."""
    import megatron.training.training as loop
    from megatron.core.pipeline_parallel import schedules

    # source sentinel: train() needs a Megatron-LM run on a GPU
    assert "HybridCPDataLoaderWrapper(train_data_iterator" in source(loop.train)
    # The no-pipelining schedule hands the step to hybrid CP's own forward-backward.
    taken = []
    monkeypatch.setattr(schedules, "torch", _HostTorch())
    monkeypatch.setattr(schedules, "get_model_type", lambda model: None)
    monkeypatch.setattr(schedules, "get_model_config", lambda model: config)
    monkeypatch.setattr(schedules, "hybrid_context_parallel_forward_backward",
                        lambda *args: taken.append(args[0]) or (["hybrid"], torch.zeros([])))
    config = SimpleNamespace(timers=None, no_sync_func=None, hybrid_context_parallel=True,
                             overlap_moe_expert_parallel_comm=False,
                             finalize_model_grads_func=None, calculate_per_token_loss=True)
    step = object()
    assert schedules.forward_backward_no_pipelining(
        forward_step_func=step, data_iterator=None, model=torch.nn.Linear(1, 1),
        num_microbatches=1, seq_length=1, micro_batch_size=1, forward_only=True,
        pg_collection=SimpleNamespace(tp=None, cp=None)) == ["hybrid"]
    assert taken == [step]
    # Megatron-LM's argument checks refuse it with the fork's own (external) data loader type.
    from megatron.packed_training.arguments import parse_args

    with pytest.raises(ValueError,
                       match="Hybrid context parallelism only supported with single dataloader"):
        parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                    "--seq-length", "128", "--max-position-embeddings", "128",
                    "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                    "--lr", "1e-3", "--mock-data", "--sft", "--vocab-size", "128",
                    "--hybrid-context-parallel", "--calculate-per-token-loss"], "gpt",
                   raise_on_error=True)


def test_upstream_hybrid_groups_are_the_aligned_power_of_two_blocks_dynamic_cp_takes(
        monkeypatch):
    """dynamic_cp.dynamic_cp_group: sizes 2 .. half the DP x CP ranks are hybrid groups of
    aligned blocks; the full size is the DP x CP group itself."""
    from megatron.core import parallel_state

    made = []
    monkeypatch.setattr(parallel_state, "create_group",
                        lambda ranks, **kwargs: made.append(tuple(ranks)) or tuple(ranks))
    ranks = list(range(16, 32))  # the DP x CP ranks of one model-parallel position
    groups = parallel_state.create_hybrid_dp_cp_groups(21, ranks, None)
    assert groups == {2: (20, 21), 4: (20, 21, 22, 23), 8: tuple(range(16, 24))}
    assert made == [tuple(ranks[i:i + size]) for size in (2, 4, 8)
                    for i in range(0, len(ranks), size)]  # every aligned block, on every rank

    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size",
                        lambda with_context_parallel=False: 16)
    monkeypatch.setattr(parallel_state, "_DATA_PARALLEL_GROUP_WITH_CP", "dp x cp")
    monkeypatch.setattr(parallel_state, "_HYBRID_DP_CP_GROUPS", groups)
    get = parallel_state.get_hybrid_data_context_parallel_groups
    assert get(group_size=16) == "dp x cp" and get(group_size=4) == (20, 21, 22, 23)


def test_hybrid_cp_groups_are_asked_for_only_while_the_groups_are_built(monkeypatch):
    import megatron.training.initialize as start_up
    from megatron.training import global_vars

    args = SimpleNamespace(hybrid_context_parallel=False)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    seen = []

    def upstream(get_embedding_ranks, get_position_embedding_ranks, store,
                 skip_model_parallel_init=False):
        seen.append((args.hybrid_context_parallel, store, skip_model_parallel_init))
        if store == "fail":
            raise RuntimeError("no rendezvous")

    monkeypatch.setattr(start_up, "_initialize_distributed", upstream)
    training_loop.build_hybrid_cp_groups_at_start_up.body()
    training_loop.build_hybrid_cp_groups_at_start_up.body()  # idempotent: wrapped once
    start_up._initialize_distributed(None, None, "store", skip_model_parallel_init=True)
    assert seen == [(True, "store", True)] and args.hybrid_context_parallel is False
    with pytest.raises(RuntimeError, match="no rendezvous"):
        start_up._initialize_distributed(None, None, "fail")
    assert args.hybrid_context_parallel is False


def test_upstream_local_graphs_share_one_pool_forward_only_graphs_can_join(cpu_dist, monkeypatch):
    """local_graph_pool: megatron-core creates one class-level pool with its first manager and
    captures every local runner into it (forward_graphs.py captures there too)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from tests.unit.conftest import tiny_moe_config

    pools = iter(["pool", "another pool"])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(get_cuda_rng_tracker(), "use_cudagraphable_rng", True, raising=False)
    monkeypatch.setattr(cuda_graphs.CudaGraphManager, "global_mempool", None)
    monkeypatch.setattr(cuda_graphs._CudagraphGlobalRecord, "cudagraph_created", False)
    monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kwargs: None)
    config = tiny_moe_config(cuda_graph_impl="local")
    modules = [SimpleNamespace(part=lambda x: x) for _ in range(2)]
    managers = [cuda_graphs.CudaGraphManager(config, module, "part", need_backward=False)
                for module in modules]
    assert cuda_graphs.CudaGraphManager.global_mempool == "pool"  # made once, with the first
    for module, manager, reuse in zip(modules, managers, (True, False)):  # both runner kinds
        runner = manager.get_cudagraph_runner(module, (torch.zeros(1, 2),), {}, reuse)
        assert runner.mempool == "pool" and manager.cudagraph_runners == [runner]
    # source sentinel: the runner's pool is handed to torch.cuda.graph, at capture only
    assert "pool=self.mempool" in source(cuda_graphs._CudaGraphRunner.create_fwd_graph)
    pool = object()
    monkeypatch.setattr(cuda_graphs.CudaGraphManager, "global_mempool", pool)
    assert graph_engine.local_graph_pool() is pool


# -- gradient accumulation fusion without apex ---------------------------------------------

def _linear_config(**fields):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                             use_cpu_initialization=True, **fields)


def test_upstream_linears_need_apex_for_fused_accumulation(cpu_dist, upstream_linears,
                                                           monkeypatch):
    layers = upstream_linears
    init = torch.nn.init.zeros_

    def build(fusion):
        config = _linear_config(gradient_accumulation_fusion=fusion)
        return config, [layers.ColumnParallelLinear(8, 8, config=config, init_method=init,
                                                    bias=False),
                        layers.RowParallelLinear(8, 8, config=config, init_method=init,
                                                 bias=False, input_is_parallel=True,
                                                 skip_bias_add=False)]

    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        build(True)  # the flag without apex's kernel: refused
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    for fusion in (True, False):  # each linear keeps its own copy of the config's flag
        config, linears = build(fusion)
        assert [linear.gradient_accumulation_fusion for linear in linears] == [fusion, fusion]
    # The forward reads the linear's own copy, not the config.
    config.gradient_accumulation_fusion = True
    for linear in linears:
        seen = []
        monkeypatch.setattr(linear, "_forward_impl", lambda *args, **kwargs: seen.append(
            kwargs["gradient_accumulation_fusion"]) or torch.zeros(2, 1, 8))
        linear(torch.zeros(2, 1, 8))
        assert seen == [False]
    # source sentinel: TE's linears need Transformer Engine, which only runs on a GPU
    from megatron.core.extensions import transformer_engine as te_extension

    assert "fuse_wgrad_accumulation=self.config.gradient_accumulation_fusion" in source(te_extension)


@pytest.fixture
def upstream_linears(monkeypatch):
    """Each test patches megatron-core's linears afresh and leaves them as they were."""
    from megatron.core.tensor_parallel import layers

    monkeypatch.setattr(layers.ColumnParallelLinear, "__init__",
                        model_layers.UPSTREAM_COLUMN_PARALLEL_INIT)
    monkeypatch.setattr(layers.RowParallelLinear, "__init__", model_layers.UPSTREAM_ROW_PARALLEL_INIT)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    # Installable again on the restored linears; the process's record comes back after.
    monkeypatch.setattr(gate, "applied_patches", {
        name: state for name, state in gate.applied_patches.items()
        if name != "megatron_core_linears_unfused_without_apex"})
    return layers


def test_without_apex_megatron_core_linears_build_unfused_and_the_config_keeps_fusion(
        cpu_dist, upstream_linears):
    layers = upstream_linears
    config = _linear_config(gradient_accumulation_fusion=True)
    init = torch.nn.init.zeros_
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):  # upstream alone
        layers.ColumnParallelLinear(8, 8, config=config, init_method=init)
    assert model_layers.megatron_core_linears_unfused_without_apex() == "applied"
    column = layers.ColumnParallelLinear(8, 8, config=config, init_method=init, bias=False)
    row = layers.RowParallelLinear(8, 8, config=config, init_method=init, bias=False,
                                   input_is_parallel=True, skip_bias_add=False)
    assert column.gradient_accumulation_fusion is False and row.gradient_accumulation_fusion is False
    assert config.gradient_accumulation_fusion is True  # TE's linears still read it
    # Their weight gradient is the ordinary one, returned to autograd.
    x = torch.randn(3, 1, 8, requires_grad=True)
    out, _ = row(column(x)[0])
    out.sum().backward()
    assert column.weight.grad is not None and row.weight.grad is not None
    # Installed once, whatever the number of calls.
    model_layers.megatron_core_linears_unfused_without_apex()
    assert layers.ColumnParallelLinear.__init__.__wrapped__ is model_layers.UPSTREAM_COLUMN_PARALLEL_INIT


def test_linears_are_left_alone_with_apex(upstream_linears, monkeypatch):
    monkeypatch.setattr(upstream_linears, "_grad_accum_fusion_available", True)
    assert model_layers.megatron_core_linears_unfused_without_apex.body().startswith("not needed")
    assert upstream_linears.ColumnParallelLinear.__init__ is model_layers.UPSTREAM_COLUMN_PARALLEL_INIT


def _ddp_shell(impl: str, params: list):
    """What megatron-core's ``zero_grad_buffer`` reads of a DDP, with no gradient buckets."""
    return SimpleNamespace(config=SimpleNamespace(cuda_graph_impl=impl), params_with_grad=params,
                           buffers=[], expert_parallel_buffers=[], bucket_groups=[],
                           expert_parallel_bucket_groups=[])


def test_ddp_keeps_the_flag_te_fused_accumulation_set(monkeypatch):
    from megatron.core.distributed import DistributedDataParallel

    monkeypatch.setattr(DistributedDataParallel, "zero_grad_buffer",
                        megatron_ddp.UPSTREAM_ZERO_GRAD_BUFFER)
    fused, unfused = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    fused.grad_added_to_main_grad, unfused.grad_added_to_main_grad = True, False
    # Upstream clears every flag unless its own TE graphs run.
    megatron_ddp.UPSTREAM_ZERO_GRAD_BUFFER(_ddp_shell("local", [fused, unfused]))
    assert fused.grad_added_to_main_grad is False
    megatron_ddp.UPSTREAM_ZERO_GRAD_BUFFER(_ddp_shell("transformer_engine", [fused]))
    fused.grad_added_to_main_grad = True
    megatron_ddp.ddp_keeps_fused_wgrad_flags.body()
    megatron_ddp.ddp_keeps_fused_wgrad_flags.body()  # once
    assert DistributedDataParallel.zero_grad_buffer.__wrapped__ is megatron_ddp.UPSTREAM_ZERO_GRAD_BUFFER
    DistributedDataParallel.zero_grad_buffer(_ddp_shell("local", [fused, unfused]))
    assert fused.grad_added_to_main_grad is True and unfused.grad_added_to_main_grad is False
    # DDP's hook adds a returned gradient only while the flag is clear.
    ddp = SimpleNamespace(param_to_bucket_group={fused: None, unfused: None},
                          ddp_config=SimpleNamespace(overlap_grad_reduce=False))
    for param in (fused, unfused):
        param.main_grad, param.grad = torch.zeros(2), torch.ones(2)
        DistributedDataParallel._make_backward_post_hook(ddp, param)()
        assert param.grad is None
    assert torch.equal(fused.main_grad, torch.zeros(2))  # TE accumulated it already
    assert torch.equal(unfused.main_grad, torch.ones(2))


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_the_fork_model_builders_build_megatron_core_linears_unfused(
        cpu_dist, upstream_linears, model):
    from megatron.packed_training import models
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import transformer_config_from_args

    layers = (["--hybrid-layer-pattern", "*-", "--mamba-num-groups", "1"] if model == "hybrid"
              else ["--num-layers", "2"])
    args = parse_args([*layers, "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "128", "--max-position-embeddings", "128",
                       "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                       "--lr", "1e-3", "--mock-data", "--sft", "--vocab-size", "128",
                       "--position-embedding-type", "none", "--no-bias-dropout-fusion",
                       "--no-bias-swiglu-fusion", "--attention-dropout", "0"], model,
                      raise_on_error=True)
    args.padded_vocab_size = 128
    config = transformer_config_from_args(args)
    config.use_cpu_initialization = True
    config.gradient_accumulation_fusion = True  # as kept on for a TE model without apex
    built = (models.gpt_model if model == "gpt" else models.hybrid_model)(args, config)
    own = [m for m in built.modules() if isinstance(
        m, (upstream_linears.ColumnParallelLinear, upstream_linears.RowParallelLinear))]
    assert built.output_layer in own
    assert not any(m.gradient_accumulation_fusion for m in own)
    assert config.gradient_accumulation_fusion is True


def _overlapping_ddp(use_forward_hook: bool, params: list, finished: list):
    """What megatron-core's DDP forward pre-hook reads: each parameter's bucket group, whose
    ``finish_param_sync`` (wait for the gather, dispatch the next) is recorded."""
    group = SimpleNamespace(finish_param_sync=lambda **_: finished.append(group))
    return SimpleNamespace(
        use_forward_hook=use_forward_hook, param_to_bucket_group={p: group for p in params},
        ddp_config=SimpleNamespace(align_param_gather=False),
        overlap_param_gather_with_optimizer_step=False)


@pytest.mark.parametrize("overlap", [True, False])
def test_te_replays_run_ddps_param_gather_hooks_of_every_module_inside(overlap):
    from megatron.core.distributed import DistributedDataParallel

    layer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    layer.cuda_graph_manual_hooks = []
    finished = []
    ddp = _overlapping_ddp(overlap, list(layer.parameters()), finished)
    # DDP's own hook factory (the reach), bound to the stand-in: upstream's hook body runs.
    ddp._make_forward_pre_hook = lambda: DistributedDataParallel._make_forward_pre_hook(ddp)
    megatron_ddp.ddp_param_gather_before_te_replays(ddp, [layer])
    modules = [module for _, (module,) in layer.cuda_graph_manual_hooks]
    assert modules == ([layer[0], layer[1][0]] if overlap else [])  # the ones holding weights
    for hook, hook_args in layer.cuda_graph_manual_hooks:  # as TEGraphDispatch._replay_graph
        hook(*hook_args)
    assert len(finished) == (4 if overlap else 0)  # weight and bias of both linears


@pytest.mark.parametrize("hooks_on", [True, False])
def test_te_capture_runs_with_ddps_gather_hooks_removed_after_one_gather(hooks_on):
    """TE refuses to capture modules with hooks: they come off (parameters gathered first)
    and go back on after the capture, through DDP's own methods."""
    from megatron.core.distributed import DistributedDataParallel

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    gathers = []
    ddp = SimpleNamespace(module=model, use_forward_hook=True, remove_forward_pre_hook_handles={},
                          start_param_sync=lambda force_sync: gathers.append(force_sync),
                          param_to_bucket_group={}, ddp_config=SimpleNamespace())
    for name in ("enable_forward_pre_hook", "disable_forward_pre_hook", "_make_forward_pre_hook"):
        setattr(ddp, name, getattr(DistributedDataParallel, name).__get__(ddp))
    if hooks_on:  # off in Megatron-LM's first iteration
        ddp.enable_forward_pre_hook()
    with megatron_ddp.ddp_gather_hooks_removed([ddp]):
        assert not model._forward_pre_hooks and not model[0]._forward_pre_hooks
        assert gathers == ([True] if hooks_on else [])
    assert bool(model[0]._forward_pre_hooks) == hooks_on
    assert len(ddp.remove_forward_pre_hook_handles) == (2 if hooks_on else 0)


def test_upstream_ddp_gathers_parameters_in_forward_pre_hooks_of_their_own_module():
    """DDP's pre-hook finishes the gather of the module's direct parameters only, disabling
    the hooks gathers everything, and the TE replay path runs a layer's manual hooks before
    its graph."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import GraphableMegatronModule

    layer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    finished = []
    ddp = _overlapping_ddp(True, list(layer.parameters()), finished)
    hook = DistributedDataParallel._make_forward_pre_hook(ddp)
    hook(layer)  # holds no parameter of its own: nothing to wait for
    hook(layer[1])
    assert finished == []
    hook(layer[0])
    assert len(finished) == 2  # its weight and bias

    gathers = []
    ddp = SimpleNamespace(module=layer, use_forward_hook=True, remove_forward_pre_hook_handles={},
                          start_param_sync=lambda force_sync: gathers.append(force_sync),
                          param_to_bucket_group={}, ddp_config=SimpleNamespace())
    ddp._make_forward_pre_hook = DistributedDataParallel._make_forward_pre_hook.__get__(ddp)
    DistributedDataParallel.enable_forward_pre_hook(ddp)
    DistributedDataParallel.disable_forward_pre_hook(ddp)
    assert gathers == [True] and not layer[0]._forward_pre_hooks

    events = []
    module = SimpleNamespace(
        cuda_graphs=[lambda *args, **kwargs: events.append(("graph", args)) or "out"],
        cuda_graph_manual_hooks=[(lambda m: events.append(("hook", m)), ("linear",))],
        _get_te_cuda_graph_replay_args=lambda *args, **kwargs: (args, kwargs))
    hidden = torch.zeros(2)
    assert GraphableMegatronModule._te_cuda_graph_replay(module, hidden) == "out"
    assert events[0] == ("hook", "linear") and events[1][0] == "graph"
    assert events[1][1][0] is hidden


def test_upstream_ddp_uses_forward_hooks_to_overlap_the_param_gather():
    from megatron.core.distributed import DistributedDataParallel

    # source sentinel: DDP's constructor allocates its gradient buffers on the GPU
    assert "self.use_forward_hook = self.ddp_config.overlap_param_gather" in source(
        DistributedDataParallel.__init__)
