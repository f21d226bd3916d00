import pytest
import megatron.core
from megatron.core.transformer import cuda_graphs

from megatron.packed_graphs import core_patches


def test_patches_target_the_pinned_version():
    assert megatron.core.__version__ == core_patches.PATCHED_VERSION


def test_upstream_warmup_flag_bug_is_still_there_and_patched():
    # When this first assertion fails, megatron-core fixed the bug: drop the patch.
    cuda_graphs._IS_GRAPH_WARMUP = True
    core_patches.UPSTREAM_SET_WARMUP_END()
    assert cuda_graphs.is_graph_warmup(), "upstream fixed _set_warmup_end; remove the patch"
    core_patches.apply_core_patches()
    cuda_graphs._set_warmup_start()
    cuda_graphs._set_warmup_end()
    assert not cuda_graphs.is_graph_warmup()


def test_capture_statistics_are_kept(monkeypatch):
    core_patches.apply_core_patches()
    from megatron.core.pipeline_parallel import schedules

    assert schedules.create_cudagraphs is not cuda_graphs.create_cudagraphs
    # Nothing recorded: upstream returns None and nothing is logged.
    before = len(core_patches.capture_log)
    schedules.create_cudagraphs()
    assert len(core_patches.capture_log) == before


def test_upstream_still_releases_forward_inputs_at_forward_capture():
    # When this fails, upstream changed when a forward capture returns its input buffers to
    # the reuse pool: re-check hold_forward_inputs_until_backward_captured.
    import inspect

    source = inspect.getsource(core_patches.UPSTREAM_CREATE_FWD_GRAPH)
    assert "tensor_reuse_pool.insert(buf)" in source


class _Runner:
    def __init__(self, grad_enabled):
        self.grad_enabled, self.training = grad_enabled, True
        self.fwd_graph_input_surface, self.num_dgrads = (), 0


def test_forward_inputs_are_held_until_the_backward_capture(monkeypatch):
    import torch

    core_patches.apply_core_patches()
    pool = cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool
    released = []
    monkeypatch.setattr(type(pool), "insert", lambda self, buf: released.append(buf))
    # Stand-ins for the upstream captures, doing only their pool traffic: a forward capture
    # returns its copied-in input buffer; the backward capture returns nothing of its own.
    buf = torch.zeros(4)
    monkeypatch.setattr(core_patches, "UPSTREAM_CREATE_FWD_GRAPH", lambda self: pool.insert(buf))
    monkeypatch.setattr(core_patches, "UPSTREAM_CREATE_BWD_GRAPH", lambda self: None)

    runner = _Runner(grad_enabled=True)
    cuda_graphs._CudaGraphRunner.create_fwd_graph(runner)
    assert released == [] and "insert" not in vars(pool)  # held, and the pool is itself again
    cuda_graphs._CudaGraphRunner.create_bwd_graph(runner)
    assert released == [buf] and runner.held_input_buffers == []

    forward_only = _Runner(grad_enabled=False)
    cuda_graphs._CudaGraphRunner.create_fwd_graph(forward_only)
    assert released == [buf, buf]  # nothing saved for a backward: released at once


def test_aliasing_check_names_the_clashing_runners():
    from types import SimpleNamespace

    import torch

    def runner(layer, inputs, grad_out, grad_in):
        return SimpleNamespace(base_module=SimpleNamespace(layer_number=layer), num_dgrads=len(inputs),
                               fwd_graph_input_surface=list(inputs) + [torch.zeros(1)],
                               static_grad_outputs=grad_out, static_grad_inputs=grad_in)

    shared, other = torch.zeros(8), torch.zeros(8)
    first = runner(1, [shared], [other], [None])
    last = runner(4, [other], [shared], [None])
    clashes = core_patches.forward_inputs_reused_as_grad_buffers([first, last])
    assert clashes == ["SimpleNamespace#1 grad out == ['SimpleNamespace#4'] fwd in",
                       "SimpleNamespace#4 grad out == ['SimpleNamespace#1'] fwd in"]
    assert core_patches.forward_inputs_reused_as_grad_buffers(
        [runner(1, [torch.zeros(8)], [torch.zeros(8)], [None])]) == []


def test_replay_surface_parameters_keep_their_memory_but_not_their_version_counter():
    import torch

    param = torch.nn.Parameter(torch.ones(4, 2))
    hidden = torch.zeros(3)
    runner = _Runner(grad_enabled=True)
    runner.fwd_graph_input_surface, runner.num_dgrads = (hidden, param), 1
    core_patches.detach_parameter_version_counters(runner)
    kept_hidden, alias = runner.fwd_graph_input_surface
    assert kept_hidden is hidden and alias.data_ptr() == param.data_ptr()
    saved_version = param._version
    alias.copy_(param)  # what every replay does to each surface entry
    assert param._version == saved_version
    # Upstream's surface held the parameter itself: the same copy bumps its version.
    with torch.no_grad():
        param.copy_(param)
    assert param._version == saved_version + 1


def test_multi_tensor_fallbacks_are_replaced_by_foreach_versions():
    import torch
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mixed_precision

    assert clip_grads.l2_norm_impl in (utils.local_multi_tensor_l2_norm,
                                       core_patches.foreach_l2_norm)  # no TE/apex here
    core_patches.apply_core_patches()
    assert clip_grads.l2_norm_impl is core_patches.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is core_patches.foreach_scale
    assert mixed_precision.multi_tensor_scale_impl is core_patches.foreach_scale

    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    flag = torch.zeros(1, dtype=torch.int)
    norm, per_tensor = core_patches.foreach_l2_norm(2048, flag, [grads], False)
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    assert norm.shape == (1,) and per_tensor is None
    torch.testing.assert_close(norm[0], expected)
    assert core_patches.foreach_l2_norm(2048, flag, [[]], False)[0].tolist() == [0.0]

    dst = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    core_patches.foreach_scale(2048, flag, [grads, dst], 0.5)
    for g, d in zip(grads, dst):
        torch.testing.assert_close(d, (g * 0.5).to(torch.bfloat16))


def test_upstream_replay_still_copies_every_surface_entry():
    # When this fails, upstream stopped copying parameters into themselves on replay:
    # re-check detach_parameter_version_counters.
    import inspect

    source = inspect.getsource(cuda_graphs._CudagraphReplayNode.forward)
    assert "cudagraph_input.copy_(user_input)" in source
    assert "fwd_graph_input_surface + self.params_to_backprop" in inspect.getsource(
        core_patches.UPSTREAM_CREATE_FWD_GRAPH)


def test_argument_type_check_accepts_and_refuses_what_upstream_does():
    import dataclasses

    import pytest
    import torch

    from megatron.packed_graphs.packed_seq import build_packed_batch_params

    core_patches.apply_core_patches()
    patched = cuda_graphs._check_supported_type
    assert patched is not core_patches.UPSTREAM_CHECK_SUPPORTED_TYPE
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
        core_patches.UPSTREAM_CHECK_SUPPORTED_TYPE(meta)
        patched(meta)
    for value in refused:
        meta = cuda_graphs.ArgMetadata(value)
        with pytest.raises(AssertionError):
            core_patches.UPSTREAM_CHECK_SUPPORTED_TYPE(meta)
        with pytest.raises(AssertionError, match="graphs do not support"):
            patched(meta)
    with pytest.raises(AssertionError):
        patched(torch.zeros(1))  # not an ArgMetadata: refused by both


def test_upstream_grad_norm_still_reads_the_norm_on_the_host():
    # When this fails, upstream stopped syncing for the gradient norm: re-check
    # clip_gradients_without_host_sync (it may be droppable).
    import inspect

    assert "total_norm.item()" in inspect.getsource(core_patches.UPSTREAM_GET_GRAD_NORM)
    assert "if clip_coeff < 1.0" in inspect.getsource(core_patches.UPSTREAM_CLIP_BY_TOTAL_NORM)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])  # clipping, and no clipping
def test_device_grad_norm_and_clip_match_upstream(cpu_dist, max_norm):
    import torch
    from megatron.core.optimizer import optimizer as mixed_precision

    core_patches.apply_core_patches()
    assert mixed_precision.get_grad_norm_fp32 is core_patches.grad_norm_on_device
    assert mixed_precision.clip_grad_by_total_norm_fp32 is core_patches.clip_by_device_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(5, 3), (7,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in params]
    norm = core_patches.grad_norm_on_device(grads)
    assert torch.is_tensor(norm) and norm.dim() == 0  # nothing read on the host
    # Upstream's L2 path needs CUDA (its overflow flag); the same norm, in float64:
    expected_norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]).double()))
    assert float(norm) == pytest.approx(expected_norm, rel=1e-6)

    expected = [g.clone() for g in grads]
    coeff = max_norm / (expected_norm + 1.0e-6)
    if coeff < 1.0:  # upstream's rule, on the host
        expected = [g * coeff for g in expected]
    core_patches.clip_by_device_norm(params, max_norm, norm)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    if max_norm == 100.0:  # not clipping leaves the gradients bitwise unchanged
        assert all(torch.equal(g, w) for g, w in zip(grads, expected))

    # A norm read on the host (or any other norm type) keeps upstream's path.
    assert core_patches.grad_norm_on_device(grads, norm_type=1.0) == pytest.approx(
        sum(float(g.abs().sum()) for g in grads), rel=1e-5)


def test_upstream_finalize_still_reads_the_token_count_on_the_host():
    # When this fails, upstream stopped syncing on num_tokens: drop
    # finalize_model_grads_without_host_sync.
    import inspect

    from megatron.core.distributed import finalize_model_grads

    assert "if num_tokens > 0:" in inspect.getsource(finalize_model_grads)


@pytest.mark.parametrize("tokens", [8, 0])
def test_finalize_scales_gradients_by_the_token_count_on_the_device(cpu_dist, monkeypatch, tokens):
    import torch
    from megatron.core import distributed

    upstream_calls = []
    monkeypatch.setattr(distributed, "finalize_model_grads",
                        lambda model, num_tokens, **kw: upstream_calls.append(num_tokens))

    class Chunk:  # the DDP surface the scaling uses
        def __init__(self):
            self.grad = torch.full((4,), 2.0)

        def scale_gradients(self, factor):
            assert torch.is_tensor(factor)  # never read on the host
            self.grad *= factor

    chunks = [Chunk(), Chunk()]
    core_patches.finalize_model_grads_without_host_sync(chunks, torch.tensor(tokens))
    assert upstream_calls == [None]  # upstream does everything but the scaling
    expected = 2.0 / tokens if tokens else 2.0
    for chunk in chunks:
        torch.testing.assert_close(chunk.grad, torch.full((4,), expected))
