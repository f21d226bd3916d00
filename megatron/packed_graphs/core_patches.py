"""Patches of megatron-core 0.16.1 behaviour that no subclass can reach. Applied once, explicitly.

Each patch is a named function: what it changes, why, and the upstream reference. All are
guarded by the exact megatron-core version; on another version `apply_core_patches` refuses
loudly so that a wheel upgrade re-examines every patch (tests/unit/test_core_patches.py fails
when upstream fixes a bug, telling us to drop its patch).
"""

import dataclasses

import torch

import megatron.core
from megatron.core.optimizer import clip_grads
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import cuda_graphs

from megatron.packed_graphs.graph_memory import reserved_without_cache

PATCHED_VERSION = "0.16.1"

# The upstream functions as imported, before any patch (tests check the bugs are still there).
UPSTREAM_SET_WARMUP_END = cuda_graphs._set_warmup_end
UPSTREAM_CREATE_FWD_GRAPH = cuda_graphs._CudaGraphRunner.create_fwd_graph
UPSTREAM_CREATE_BWD_GRAPH = cuda_graphs._CudaGraphRunner.create_bwd_graph
UPSTREAM_CHECK_SUPPORTED_TYPE = cuda_graphs._check_supported_type
UPSTREAM_GET_GRAD_NORM = clip_grads.get_grad_norm_fp32
UPSTREAM_CLIP_BY_TOTAL_NORM = clip_grads.clip_grad_by_total_norm_fp32

# Filled by the capture-statistics patch: one entry per graph capture.
capture_log: list = []

_applied = False


def fix_warmup_flag_never_cleared() -> None:
    """0.16.1's ``cuda_graphs._set_warmup_end`` forgets to clear ``_IS_GRAPH_WARMUP``.

    After the first capture ``is_graph_warmup()`` stays True for the rest of training, which
    silently disables ``CheckpointWithoutOutput`` recomputation (tensor_parallel/random.py).
    Upstream fix: megatron-core main #3373 (e19fbe2e1d).
    """

    def _set_warmup_end():
        cuda_graphs._IS_GRAPH_WARMUP = False

    cuda_graphs._set_warmup_end = _set_warmup_end


def hold_forward_inputs_until_backward_captured() -> None:
    """Keep a runner's forward-input buffers out of the reuse pool until its backward exists.

    0.16.1's ``create_fwd_graph`` returns each copied-in input buffer (the first layer's
    hidden states, per-layer metadata) to ``TensorReusePool`` right after the forward
    capture. But the captured forward saved that buffer for its backward (a norm keeps its
    input), and the next capture of the same shape takes it from the pool: at PP=1 the last
    layer's grad-output buffer. On replay the last layer's backward writes its incoming
    gradient over the first layer's saved input, and the first layer's backward reads it:
    wrong first-norm and embedding gradients (H200: 0.3 to 2.8 relative error, exact with the
    patch; tools/compare_graph_grads.py prints the aliasing). Released once the runner's
    backward graph is captured, the buffer is reused only by graphs that replay after it.
    """
    pool = cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool

    def create_fwd_graph(self, *args, **kwargs):
        held = []
        pool.insert = held.append  # the only pool.insert calls in a forward capture
        try:
            UPSTREAM_CREATE_FWD_GRAPH(self, *args, **kwargs)
        finally:
            del pool.insert
        if self.grad_enabled and self.training:
            self.held_input_buffers = held
        else:  # forward-only graph: nothing is saved for a backward
            for buf in held:
                pool.insert(buf)

    def create_bwd_graph(self):
        UPSTREAM_CREATE_BWD_GRAPH(self)
        for buf in getattr(self, "held_input_buffers", ()):
            pool.insert(buf)
        self.held_input_buffers = []

    cuda_graphs._CudaGraphRunner.create_fwd_graph = create_fwd_graph
    cuda_graphs._CudaGraphRunner.create_bwd_graph = create_bwd_graph


def keep_parameter_versions_on_replay() -> None:
    """After each backward capture, apply `detach_parameter_version_counters` to the runner."""
    captured = cuda_graphs._CudaGraphRunner.create_bwd_graph

    def create_bwd_graph(self):
        captured(self)
        detach_parameter_version_counters(self)

    cuda_graphs._CudaGraphRunner.create_bwd_graph = create_bwd_graph


def detach_parameter_version_counters(runner) -> None:
    """Stop every replay from bumping the autograd version of the runner's parameters.

    0.16.1's replay copies each entry of ``fwd_graph_input_surface`` into itself, the layer's
    parameters included (``param.copy_(param)``: no kernel, but a version bump). An eager
    micro-batch that saved a weight for its backward then fails if another micro-batch
    replays the layer before that backward runs, which the 1F1B schedule does at PP > 1 with
    a fallback micro-batch ("modified by an inplace operation", H200 x2). The surface keeps
    ``param.data`` instead: same memory (the copy stays a no-op), own version counter.
    """
    surface, n = runner.fwd_graph_input_surface, runner.num_dgrads
    runner.fwd_graph_input_surface = type(surface)(
        list(surface[:n]) + [param.data for param in surface[n:]])


def keep_graph_buffers_private() -> None:
    """Never hand a graph's input or grad buffer to another runner (chunk graphs).

    0.16.1 recycles graph buffers between runners through ``TensorReusePool``; that is safe
    only when the graphs replay in capture order. Chunk graphs replay their slots in the
    order the schedule needs, which changes with the micro-batch count. Chunks are few, so
    private buffers cost little. Applied when the first chunk graph is recorded.
    """
    cuda_graphs.TensorReusePool.insert = lambda self, tensor: None


def forward_inputs_reused_as_grad_buffers(runners) -> list:
    """Check of the patch above on captured runners: ``["<runner> grad out == <runner> fwd in"]``.

    Empty when no backward graph writes into memory a forward graph saved as its input.
    """
    def name(runner):
        return f"{type(runner.base_module).__name__}#{runner.base_module.layer_number}"

    inputs = {}
    for runner in runners:
        for buf in runner.fwd_graph_input_surface[:runner.num_dgrads]:
            inputs.setdefault(buf.data_ptr(), []).append(name(runner))
    clashes = []
    for runner in runners:
        for kind, bufs in (("grad out", runner.static_grad_outputs),
                           ("grad in", runner.static_grad_inputs)):
            for buf in bufs:
                if buf is not None and buf.data_ptr() in inputs:
                    clashes.append(f"{name(runner)} {kind} == {inputs[buf.data_ptr()]} fwd in")
    return clashes


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm`` contract with torch's foreach kernels: ``([norm], None)``."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    return torch.nn.utils.get_total_norm(tensors, 2.0).float().reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale`` contract: ``dst[i] = src[i] * scale``, foreach kernels."""
    src, dst = tensor_lists
    if src:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def sync_free_multi_tensor_fallbacks() -> None:
    """Replace megatron-core's multi-tensor fallbacks used when neither TE nor apex is installed.

    0.16.1's ``local_multi_tensor_l2_norm`` (gradient norm, clip_grads.py) builds a CPU
    tensor from the per-tensor CUDA norms: one host sync per gradient tensor per step, after
    which the GPU idles while Python walks the rest; ``local_multi_tensor_scale`` (clipping,
    optimizer copies) launches one kernel per tensor. Torch's foreach kernels do both in a
    few launches and no sync. Only the fallbacks are replaced; TE's or apex's stay.
    """
    from megatron.core import utils
    from megatron.core.optimizer import optimizer as mixed_precision

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, mixed_precision):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def grad_norm_on_device(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """``get_grad_norm_fp32`` without the final ``.item()``: the L2 norm as a 0-dim CUDA tensor.

    Same kernel (clip_grads' ``l2_norm_impl``: TE's, apex's or the foreach fallback) and the
    same all-reduce; other norm types and DTensor (FSDP) gradients take upstream's path.
    """
    grads = grads_for_norm if isinstance(grads_for_norm, list) else [grads_for_norm]
    dtensor_group = None
    for grad in grads:
        dtensor_group = clip_grads.get_data_parallel_group_if_dtensor(grad, dtensor_group)
    if float(norm_type) != 2.0 or dtensor_group is not None:
        return UPSTREAM_GET_GRAD_NORM(grads_for_norm, norm_type, grad_stats_parallel_group)
    if grads:
        flag = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, flag, [grads], False)
    else:
        norm = torch.zeros(1, dtype=torch.float, device="cuda")
    squared = norm.float() ** 2
    torch.distributed.all_reduce(squared, op=torch.distributed.ReduceOp.SUM,
                                 group=grad_stats_parallel_group)
    return squared.sqrt().reshape(())


def clip_by_device_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """``clip_grad_by_total_norm_fp32`` for a norm on the device: scale by ``min(1, coeff)``.

    Upstream compares the coefficient with 1 on the host; multiplying by a coefficient
    clamped to 1 gives the same gradients (``x * 1.0 == x``) without reading it.
    """
    if not torch.is_tensor(total_norm):
        return UPSTREAM_CLIP_BY_TOTAL_NORM(parameters, max_norm, total_norm, use_decoupled_grad)
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [clip_grads.to_local_if_dtensor(getattr(p, attr)).detach()
             for p in (parameters if isinstance(parameters, list) else [parameters])
             if getattr(p, attr, None) is not None]
    if grads:
        torch._foreach_mul_(grads, (max_norm / (total_norm + 1.0e-6)).clamp(max=1.0))


def clip_gradients_without_host_sync() -> None:
    """Keep the gradient norm on the GPU: no host sync in the optimizer step.

    0.16.1's ``get_grad_norm_fp32`` ends with ``total_norm.item()`` and
    ``clip_grad_by_total_norm_fp32`` decides on the host whether to scale. That sync sits
    between the backward and the optimizer kernels of every step, so the GPU drains and
    then waits while Python launches the optimizer (docs/benchmarks.md, issue 3). Patched
    where the optimizers look the two functions up (optimizer.py); the step then returns
    the norm as a 0-dim tensor, which the training loop reads only when it logs.
    """
    from megatron.core.optimizer import optimizer as mixed_precision

    mixed_precision.get_grad_norm_fp32 = grad_norm_on_device
    mixed_precision.clip_grad_by_total_norm_fp32 = clip_by_device_norm


def finalize_model_grads_without_host_sync(model, num_tokens=None, pg_collection=None,
                                           force_all_reduce=False):
    """megatron-core's ``finalize_model_grads`` with the per-token scaling kept on the GPU.

    0.16.1 scales the gradients by ``1 / num_tokens`` behind ``if num_tokens > 0`` on a CUDA
    tensor: a host sync after every backward, so the host waits for the whole forward and
    backward before it launches the optimizer (tools/find_host_syncs.py found it once the
    gradient norm stopped syncing). Upstream runs with ``num_tokens=None`` (everything but
    the scaling); the scaling here uses ``1 / max(num_tokens, 1)``: the same factor when
    there are tokens, and without tokens every gradient is zero, scaled or not. Given to
    the schedules as ``config.finalize_model_grads_func`` (training.py).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel.utils import get_pp_last_rank

    finalize_model_grads(model, None, pg_collection=pg_collection,
                         force_all_reduce=force_all_reduce)
    if num_tokens is None:
        return
    if pg_collection is not None:
        pp_group, dp_cp_group = pg_collection.pp, pg_collection.dp_cp
    else:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    # As upstream: the count lives on the last stage; every stage and DP rank needs the total.
    torch.distributed.broadcast(num_tokens, src=get_pp_last_rank(pp_group), group=pp_group)
    torch.distributed.all_reduce(num_tokens, group=dp_cp_group)
    scaling = 1.0 / num_tokens.clamp(min=1)
    for chunk in model:
        chunk.scale_gradients(scaling)


def check_arg_types_without_reimporting() -> None:
    """Build the set of argument types a CUDA graph accepts once, not at every check.

    0.16.1's ``_check_supported_type`` runs two ``from ... import`` statements and builds an
    11-type set on every call, and a replay calls it twice for each argument and for each
    field of a dataclass argument: 34 calls per layer replay with our PackedBatchParams, all
    while the GPU waits (tools/step_gaps.py put it first among the host frames of a hybrid
    graph step). Upstream's argument check takes 72 us per replay on one core of the CPU
    workstation, 22 us with this patch. Same accepted types, same assertion.
    """
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    # `dataclasses.dataclass` (the decorator) is in upstream's set too; kept for equality.
    supported = frozenset({torch.Tensor, type(None), bool, int, str, float, dataclasses.dataclass,
                           StaticInferenceContext, DynamicInferenceContext,
                           cuda_graphs.ArgMetadata})

    def _check_supported_type(meta):
        assert isinstance(meta, cuda_graphs.ArgMetadata)
        assert meta.type in supported or dataclasses.is_dataclass(meta.value), (
            f"a CUDA graph argument has type {meta.type}, which graphs do not support")

    cuda_graphs._check_supported_type = _check_supported_type


def record_capture_statistics() -> None:
    """Keep the capture time and measure graph memory at the end-of-iteration capture.

    0.16.1's schedules call ``create_cudagraphs()`` and drop its return value (capture
    ``time`` in seconds, memory-stat deltas). Its ``reserved_bytes`` delta is not the graph
    memory: the capture empties the allocator cache first, so it can be negative (-150 MiB
    on the H200 test hybrid). We measure reserved memory with the cache emptied before and
    after the capture instead: what the graph pools and their static buffers hold. Also
    counts the graphs captured (forward and backward each count one).
    """
    upstream = schedules.create_cudagraphs
    record = cuda_graphs._CudagraphGlobalRecord

    def create_cudagraphs():
        if record.cudagraph_created or not record.cudagraph_record:
            return upstream()  # nothing to capture: no cache flush on ordinary iterations
        graphs = len(record.cudagraph_record)  # one entry per forward or backward graph
        before = reserved_without_cache()
        stats = upstream()
        if stats:
            stats = dict(stats, graphs=graphs,
                         graph_reserved_bytes=reserved_without_cache() - before)
            capture_log.append(stats)
        return stats

    schedules.create_cudagraphs = create_cudagraphs


def apply_core_patches() -> None:
    """Apply every patch once. Raises on a megatron-core version these were not written for."""
    global _applied
    if _applied:
        return
    if megatron.core.__version__ != PATCHED_VERSION:
        raise RuntimeError(
            f"megatron.packed_graphs.core_patches targets megatron-core {PATCHED_VERSION}, "
            f"found {megatron.core.__version__}. Re-check each patch against the new version."
        )
    fix_warmup_flag_never_cleared()
    hold_forward_inputs_until_backward_captured()
    keep_parameter_versions_on_replay()
    sync_free_multi_tensor_fallbacks()
    clip_gradients_without_host_sync()
    check_arg_types_without_reimporting()
    record_capture_statistics()
    _applied = True
