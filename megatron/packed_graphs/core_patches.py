"""Every reach of this fork into megatron-core internals, in one module, for megatron-core 0.19.2.

Two kinds of entries live here, both guarded by the exact megatron-core version
(`PATCHED_VERSION`): on another version `apply_core_patches` refuses loudly, so a wheel upgrade
re-examines every line below (tests/unit/test_core_patches.py holds a sentinel per entry that
fails when upstream changes the code it relies on).

**Patches** change upstream behaviour process-wide. `apply_core_patches()` applies them once,
explicitly, at the start of training:

* `keep_forward_inputs_until_backward_captured` (replaces 0.16.1's
  ``hold_forward_inputs_until_backward_captured``): the local graph engine releases forward
  buffers it thinks the backward does not need; it learns what the backward needs only from
  Python ``save_for_backward`` calls, so inputs saved by native autograd ops (torch norms)
  were released and reused, the gradient-aliasing bug the 0.16.1 patch fixed.
* `keep_saved_tensor_observer_armed_until_capture`: upstream disarms that observer at the end
  of the first schedule, which in this fork is an eager warm-up iteration.
* `keep_chunk_graph_buffers_private` (replaces 0.16.1's ``keep_graph_buffers_private``):
  chunk-graph slots replay out of capture order, and eager code reads a partial MoE router
  graph's outputs, so the buffers of those runners are never shared.
* `sync_free_multi_tensor_fallbacks`, `clip_gradients_without_host_sync`: gradient norm and
  clipping without host syncs where neither TE >= 2.14 nor apex provides the kernels.
* `warm_up_graphs_on_recorded_layouts`: the capture's warm-up passes run on the recorded
  call's integer inputs (packed boundaries) instead of zero-filled buffers.
* `te_cross_entropy_capturable`: megatron-core asks TE's fused cross entropy for its
  capturable backward only under upstream's own full-iteration graphs; TE versions that still
  take the flag then copy a host scalar to the GPU each backward, which a capture refuses.
* `check_arg_types_without_reimporting`, `record_capture_statistics`: host time and statistics.

`route_training_loop` puts the graph runtime into Megatron-LM's loop (the seam) and takes the
loop's per-iteration host syncs out: its statistics where they are identities
(`all_model_parallel_ranks_updated`, `max_stat_across_model_parallel_ranks`,
`keep_loss_scale_on_host`), the log's loss sums (`training_log_summing_losses_on_device`) and
the rerun machine's flags (`reduce_rerun_flags_on_host`) and the exit-signal check
(`check_exit_signal_on_host`). It also builds DDP on the process's stream
(`ddp_on_the_process_stream`) and sizes the MoE metrics alike on every pipeline stage
(`size_moe_metrics_as_the_routers_do`). With dynamic context parallelism,
`build_hybrid_cp_groups_at_start_up` has Megatron-LM's start-up build megatron-core's hybrid
DP x CP groups without turning on Megatron-LM's own hybrid CP.

**Reaches** are small functions the fork calls where a subclass cannot do the job: the GPT
decoder class switch (`switch_block_class`), the TE capture flag
(`te_graph_capture`), which layers TE graphs for a module list (`layer_graphed_for_modules`),
the order of a manager's runners
(`replay_runner_first`, `rotate_runners`, `sort_runners`), upstream's private "graphs
created" flag (`local_graphs_created`), TE's class-level CP stream (`te_cp_stream`), the
process-wide stream switch (`use_side_stream`) and a graph manager that keeps it
(`graph_manager_on_the_process_stream`), the buffers and pool of a runner
(`keep_runner_buffers`), a layer's graphed partial function (`route_graphed_function`), the MoE
dispatcher's graph state and dropless mode (`set_dispatcher_graph_state`,
`dispatch_dropless`), the optimizer's step and state_dict (`install_optimizer_step`,
`run_state_dict_within`), TE's private capture keywords (`te_layer_capture_keywords`),
and, for fused gradient accumulation without apex, megatron-core's own linears built unfused
(`megatron_core_linears_unfused_without_apex`) and DDP keeping TE's fused-gradient flags
under TE graphs (`ddp_keeps_fused_wgrad_flags`); with ``--overlap-param-gather``, DDP's
parameter-gather pre-hooks come off for the TE capture (`ddp_gather_hooks_removed`) and run
before each TE graph replay (`ddp_param_gather_before_te_replays`). Megatron-LM's parser gets
its bare-'%' help texts escaped and its enum typos reported as usage errors
(`megatron_parser_flaws_fixed`).
No other module reaches into upstream internals (tests/unit/test_upstream_reaches.py).

Dropped with the move from 0.16.1 to 0.19.2, because upstream fixed the bug:

* ``fix_warmup_flag_never_cleared``: ``_set_warmup_end`` clears the flag since 0.17.0 (#3373).
* ``keep_parameter_versions_on_replay``: replay copies an input only when its address differs
  since 0.17.0 (#3948), so parameters are no longer copied into themselves.
* ``finalize_model_grads_without_host_sync``: ``finalize_model_grads`` scales by the token
  count on the device since 0.18.0 (#4663); the fork uses upstream's.
"""

import argparse
import collections
import contextlib
import copy
import dataclasses
import functools
import re
from typing import Callable, ContextManager, Iterator, Tuple

import torch

import megatron.core
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import clip_grads
from megatron.core.pipeline_parallel import schedules
from megatron.core.rerun_state_machine import RerunStateMachine
from megatron.core.transformer import cuda_graphs

from megatron.packed_graphs.graph_memory import reserved_without_cache

PATCHED_VERSION = "0.19.2"

# The upstream functions as imported, before any patch (tests check the code they rely on).
UPSTREAM_WEAKREF_FORWARD_BUFFERS = cuda_graphs._CudaGraphRunner._weakref_forward_buffers
UPSTREAM_CREATE_BWD_GRAPH = cuda_graphs._CudaGraphRunner.create_bwd_graph
UPSTREAM_CREATE_CUDAGRAPHS = cuda_graphs._CudagraphGlobalRecord.create_cudagraphs.__func__
UPSTREAM_CHECK_SUPPORTED_TYPE = cuda_graphs._check_supported_type
UPSTREAM_ARG_METADATA_INIT = cuda_graphs.ArgMetadata.__init__
UPSTREAM_ARG_METADATA_ZEROS_LIKE = cuda_graphs.ArgMetadata.zeros_like
UPSTREAM_GET_GRAD_NORM = clip_grads.get_grad_norm_fp32
UPSTREAM_CLIP_BY_TOTAL_NORM = clip_grads.clip_grad_by_total_norm_fp32
UPSTREAM_REDUCE_ANY = RerunStateMachine._reduce_any
UPSTREAM_COLUMN_PARALLEL_INIT = tensor_parallel.ColumnParallelLinear.__init__
UPSTREAM_ROW_PARALLEL_INIT = tensor_parallel.RowParallelLinear.__init__
UPSTREAM_ZERO_GRAD_BUFFER = DistributedDataParallel.zero_grad_buffer

# Filled by the capture-statistics patch, one entry per graph capture; the graph runtime
# empties it after each capture iteration, and it keeps the last few at most.
capture_log: collections.deque = collections.deque(maxlen=4)

# Which patches apply_core_patches applied, and why the others were not needed.
applied_patches: dict = {}

_applied = False


def require_patched_version() -> None:
    """Raise unless the installed megatron-core is the one every entry here was checked on.

    megatron-core appends the git hash of a repository its files sit in (``0.19.2+abc1234``,
    e.g. a venv inside a clone); that local label is the same release.
    """
    installed = megatron.core.__version__
    if installed.split("+")[0] != PATCHED_VERSION:
        raise RuntimeError(
            f"megatron.packed_graphs.core_patches targets megatron-core {PATCHED_VERSION}, "
            f"found {installed}. Install megatron-core=={PATCHED_VERSION} "
            "(pyproject.toml pins it), or re-check each patch against the new version.")


# --------------------------------------------------------------------------------------------
# Local graph engine: buffer lifetimes
# --------------------------------------------------------------------------------------------

def keep_forward_inputs_until_backward_captured() -> None:
    """Treat every forward-graph input of a training runner as saved for its backward.

    0.19.2's forward capture hands the memory of input buffers back to the graph pool
    (``_weakref_forward_buffers``, active when TE is importable) unless an observer of
    ``FunctionCtx.save_for_backward`` tagged them. Native autograd ops (``F.rms_norm``,
    ``F.linear`` in the TE-free spec) save their input without that call, so the first
    layer's input buffer was released although its norm's backward reads it; a later
    capture can then place a grad buffer on it, the 0.16.1 aliasing bug (wrong first-norm and
    embedding gradients, tools/compare_graph_grads.py). Upstream releases the buffers after
    the runner's backward capture; this keeps them alive until then, as 0.16.1 + our patch did.
    """
    def _weakref_forward_buffers(self, preserve_forward_to_backward_lifetimes: bool) -> None:
        if getattr(self, "keep_buffers_private", False):
            return  # chunk-graph runner: keep_chunk_graph_buffers_private
        if preserve_forward_to_backward_lifetimes:
            for buf in self.fwd_graph_input_surface:
                cuda_graphs._tag_cudagraph_buffer_saved_for_backward(buf)
        UPSTREAM_WEAKREF_FORWARD_BUFFERS(self, preserve_forward_to_backward_lifetimes)

    cuda_graphs._CudaGraphRunner._weakref_forward_buffers = _weakref_forward_buffers


def keep_chunk_graph_buffers_private() -> None:
    """Never give a chunk-graph runner's buffers back to the shared graph pool.

    A runner's static inputs and grad buffers come from megatron-core's one global pool, and
    0.19.2 returns them to it once captured (``make_weakref``), assuming graphs replay in
    capture order. Chunk-graph slots replay in the order the schedule needs, which changes
    with the micro-batch count, so a slot reusing another slot's released buffer would
    overwrite it. Runners that chunk graphs mark ``keep_buffers_private`` keep strong
    references (chunks are few: the cost is a few activation-sized buffers per slot). The
    router graphs of partial MoE layers are marked too: eager code reads their outputs
    (moe_partial.keep_router_graph_buffers).
    Forward buffers are handled in `keep_forward_inputs_until_backward_captured`.
    """
    def create_bwd_graph(self):
        if not getattr(self, "keep_buffers_private", False):
            return UPSTREAM_CREATE_BWD_GRAPH(self)
        release = cuda_graphs.make_weakref
        cuda_graphs.make_weakref = lambda tensor, inplace=True: tensor
        try:
            return UPSTREAM_CREATE_BWD_GRAPH(self)
        finally:
            cuda_graphs.make_weakref = release

    cuda_graphs._CudaGraphRunner.create_bwd_graph = create_bwd_graph


def keep_saved_tensor_observer_armed_until_capture() -> None:
    """Re-arm upstream's ``save_for_backward`` observer until the graphs are captured.

    0.19.2 arms it when a CudaGraphManager is built and disarms it at the end of every
    schedule (``create_cudagraphs``), captured or not. This fork runs eager warm-up
    iterations first, so the recording iteration ran with the observer off and buffers
    saved for backward were not tagged. Re-armed only where it was armed (a local-graph
    manager exists): eager and TE-graph runs never pay for it. Upstream's own
    ``_enable_saved_tensors_observer`` does nothing once graphs exist.
    """
    def create_cudagraphs(cls):
        armed = cls._saved_tensors_observer is not None
        try:
            return UPSTREAM_CREATE_CUDAGRAPHS(cls)
        finally:
            if armed:
                cls._enable_saved_tensors_observer()

    cuda_graphs._CudagraphGlobalRecord.create_cudagraphs = classmethod(create_cudagraphs)


def forward_inputs_reused_as_grad_buffers(runners) -> list:
    """Check of the buffer patches on captured runners: ``["<runner> grad out == <runner> fwd in"]``.

    ``runners`` in forward order of one micro-batch (PP = 1: module order), so backwards
    replay in reverse. Lists a backward-graph buffer that is memory a forward graph kept as
    its input while that input is still live: the writer's backward replays before (or is)
    the reader's backward. Reuse after the reader's backward (upstream's pool at work) is
    fine and not listed. Empty when no such clash exists.
    """
    def name(runner):
        module = runner.base_module
        return f"{type(module).__name__}#{getattr(module, 'layer_number', 'chunk')}"

    inputs = {}
    for index, runner in enumerate(runners):
        for buf in runner.fwd_graph_input_surface[:runner.num_dgrads]:
            inputs.setdefault(buf.data_ptr(), []).append((index, name(runner)))
    clashes = []
    for index, runner in enumerate(runners):
        for kind, bufs in (("grad out", runner.static_grad_outputs),
                           ("grad in", runner.static_grad_inputs)):
            for buf in bufs:
                live = [reader for at, reader in inputs.get(buf.data_ptr(), [])
                        if index >= at] if buf is not None else []
                if live:
                    clashes.append(f"{name(runner)} {kind} == {live} fwd in")
    return clashes


# --------------------------------------------------------------------------------------------
# Optimizer step without host syncs
# --------------------------------------------------------------------------------------------

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


def sync_free_multi_tensor_fallbacks() -> str:
    """Replace megatron-core's multi-tensor fallbacks used when neither TE >= 2.14 nor apex is there.

    clip_grads.py takes TE's kernels only when TE exports ``multi_tensor_scale_tensor``
    (TE >= 2.14); with TE 2.11 or no TE it falls back to ``local_multi_tensor_l2_norm``,
    which builds a CPU tensor from the per-tensor CUDA norms (one host sync per gradient
    tensor per step), and ``local_multi_tensor_scale``, one kernel per tensor. Torch's
    foreach kernels do both in a few launches and no sync. Only the fallbacks are replaced.
    """
    from megatron.core import utils
    from megatron.core.optimizer import optimizer as mixed_precision

    replaced = []
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
        replaced.append("l2 norm")
    for module in (clip_grads, mixed_precision):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
            replaced.append(f"scale ({module.__name__.rsplit('.', 1)[-1]})")
    return ", ".join(replaced) or "not needed: TE or apex kernels are installed"


def grad_norm_on_device(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """``get_grad_norm_fp32`` without the final ``.item()``: the L2 norm as a 0-dim CUDA tensor.

    Same kernel (clip_grads' ``l2_norm_impl``) and the same all-reduce; other norm types and
    DTensor (FSDP) gradients take upstream's path.
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

    Upstream compares the coefficient with 1 on the host unless TE >= 2.14 gives it a
    tensor-scale kernel; multiplying by a coefficient clamped to 1 gives the same gradients
    (``x * 1.0 == x``) without reading it.
    """
    if not torch.is_tensor(total_norm):
        return UPSTREAM_CLIP_BY_TOTAL_NORM(parameters, max_norm, total_norm, use_decoupled_grad)
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [clip_grads.to_local_if_dtensor(getattr(p, attr)).detach()
             for p in (parameters if isinstance(parameters, list) else [parameters])
             if getattr(p, attr, None) is not None]
    if grads:
        torch._foreach_mul_(grads, (max_norm / (total_norm + 1.0e-6)).clamp(max=1.0))


def clip_gradients_without_host_sync() -> str:
    """Keep the gradient norm on the GPU where upstream still reads it on the host.

    0.19.2 keeps the norm on the device only when TE exports ``multi_tensor_scale_tensor``
    (TE >= 2.14, clip_grads.py); otherwise ``get_grad_norm_fp32`` ends with ``.item()`` and
    ``clip_grad_by_total_norm_fp32`` decides on the host whether to scale. That sync sits
    between the backward and the optimizer kernels of every step, so the GPU drains while
    Python launches the optimizer (docs/benchmarks.md). Patched where the optimizers look the
    two functions up (optimizer.py); the step then returns the norm as a tensor, which the
    training loop reads only when it logs.
    """
    if clip_grads.multi_tensor_scale_tensor_impl is not None:
        return "not needed: upstream clips on the device with TE's multi_tensor_scale_tensor"
    from megatron.core.optimizer import optimizer as mixed_precision

    mixed_precision.get_grad_norm_fp32 = grad_norm_on_device
    mixed_precision.clip_grad_by_total_norm_fp32 = clip_by_device_norm
    return "applied"


def te_cross_entropy_capturable() -> str:
    """Always ask TE's fused cross entropy (``--cross-entropy-fusion-impl te``) to be capturable.

    language_module.py passes ``is_cg_capturable`` only when ``config.cuda_graph_impl`` is
    upstream's "full_iteration"; this fork's graphs keep it "local" (config.py). TE versions
    whose Triton backward still takes the flag (2.7 to at least 2.11) otherwise compare the
    gradient with ``torch.tensor(1.0, device=...)``, a host-to-device copy per micro-batch that
    fails inside a graph capture and stalls the host outside one. With the flag the backward
    always scales by the gradient: one small kernel, the same values. TE versions where the
    flag is deprecated are always capturable, and the patch is not needed there.
    """
    import inspect

    from megatron.core.models.common.language_module import language_module

    upstream = language_module.te_parallel_cross_entropy
    if upstream is None:
        return "not needed: Transformer Engine is not installed"
    from transformer_engine.pytorch.triton import cross_entropy as te_triton_cross_entropy

    if "is_cg_capturable" not in inspect.signature(
            te_triton_cross_entropy.cross_entropy_backward).parameters:
        return "not needed: this TE's cross entropy is always capturable"

    def capturable_cross_entropy(logits, labels, tp_group, is_cg_capturable=False):
        return upstream(logits, labels, tp_group, True)

    language_module.te_parallel_cross_entropy = capturable_cross_entropy
    return "applied"


# --------------------------------------------------------------------------------------------
# Host time and statistics
# --------------------------------------------------------------------------------------------

def check_arg_types_without_reimporting() -> None:
    """Build the set of argument types a CUDA graph accepts once, not at every check.

    Upstream's ``_check_supported_type`` runs two ``from ... import`` statements and builds an
    11-type set on every call, and a replay calls it twice for each argument and for each
    field of a dataclass argument: 34 calls per layer replay with our PackedBatchParams, all
    while the GPU waits (tools/step_gaps.py put it first among the host frames of a hybrid
    graph step). 72 us per replay on one CPU core, 22 us with this patch. Same accepted
    types, same assertion.
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


def warm_up_graphs_on_recorded_layouts() -> None:
    """Start a graph input buffer of an integer or bool tensor as a copy of the recorded call's
    value, not as zeros.

    0.19.2 maps graph inputs through dataclasses, so the packed boundaries (``cu_seqlens``
    of `PackedSeqParams`) become graph input buffers, allocated zero-filled
    (``ArgMetadata.zeros_like``) for the eager warm-up passes before each capture. All-zero
    boundaries are no packed layout: TE's eager context-parallel backward
    (``get_thd_padding_mask``) then indexes past their end, a device-side assert seen at
    CP = 2 with TE 2.20.2. Upstream works around the same for Mamba's ``seq_idx`` only. The
    graph does not depend on these values (each replay copies the real inputs in); the
    warm-up needs a valid layout, and the recorded call's is one. Keeping a reference to the
    recorded tensor costs no copy; the copy happens once per buffer, at capture.
    """
    def __init__(self, arg):
        UPSTREAM_ARG_METADATA_INIT(self, arg)
        if torch.is_tensor(arg) and not (arg.is_floating_point() or arg.is_complex()):
            self.recorded_layout = arg

    def zeros_like(self):
        recorded = getattr(self, "recorded_layout", None)
        if recorded is None:
            return UPSTREAM_ARG_METADATA_ZEROS_LIKE(self)
        return recorded.detach().clone()

    cuda_graphs.ArgMetadata.__init__ = __init__
    cuda_graphs.ArgMetadata.zeros_like = zeros_like


_capture_guards: list = []  # set only inside `guard_local_capture`
_side_stream = None  # the process's stream once `use_side_stream` switched to it


@contextlib.contextmanager
def guard_local_capture(guard: Callable[[], ContextManager]) -> Iterator[None]:
    """Within this scope, the end-of-schedule capture of the local implementation (its eager
    warm-up passes on placeholder inputs, then the capture) runs inside ``guard()``: e.g. to
    keep what those passes add to step accumulators out of training's values. Needs
    `record_capture_statistics` applied (it owns the wrapper)."""
    _capture_guards.append(guard)
    try:
        yield
    finally:
        _capture_guards.remove(guard)


@contextlib.contextmanager
def stream_crossings_unreported() -> Iterator[None]:
    """torch's AccumulateGrad stream-mismatch warning off within (graph capture), as before
    outside.

    megatron-core and TE capture a layer's backward on a capture stream of their own, so each
    captured weight gradient meets DDP's accumulation node (built on the process's stream)
    from another stream: once per graph, at capture. Replays run on the process's stream and
    cross nothing. Outside captures the warning, printed once per process, then means a
    crossing on every iteration (`ddp_on_the_process_stream`).
    """
    enabled = torch._C._warn_on_accumulate_grad_stream_mismatch()
    torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    try:
        yield
    finally:
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(enabled)


def record_capture_statistics() -> None:
    """Keep the capture time and measure graph memory at the end-of-iteration capture.

    The schedules call ``create_cudagraphs()`` and drop its return value (capture ``time`` in
    seconds, memory-stat deltas). Its ``reserved_bytes`` delta is not the graph memory: the
    capture empties the allocator cache first, so it can be negative. We measure reserved
    memory with the cache emptied before and after the capture instead: what the graph
    pools and their static buffers hold. Also counts the graphs (forward and backward).

    And keeps the process on its stream: upstream ends the capture by switching the process
    to the default stream, where a later whole-iteration or optimizer capture is refused
    ("CUDA graphs must be captured on a non-default stream") and parameters' gradient
    accumulation no longer runs on the stream DDP built it on (`use_side_stream`).
    """
    upstream = schedules.create_cudagraphs
    record = cuda_graphs._CudagraphGlobalRecord

    def create_cudagraphs():
        if record.cudagraph_created or not record.cudagraph_record:
            return upstream()  # nothing to capture: no cache flush on ordinary iterations
        graphs = len(record.cudagraph_record)  # one entry per forward or backward graph
        before = reserved_without_cache()
        stream = torch.cuda.current_stream()
        with contextlib.ExitStack() as guards:
            guards.enter_context(stream_crossings_unreported())
            for guard in _capture_guards:
                guards.enter_context(guard())
            try:
                stats = upstream()
            finally:
                # Before the guards' exits: what they restore is read on this stream next,
                # and torch's side streams do not wait for the default stream.
                torch.cuda.set_stream(stream)
        if stats:
            stats = dict(stats, graphs=graphs,
                         graph_reserved_bytes=reserved_without_cache() - before)
            capture_log.append(stats)
        return stats

    schedules.create_cudagraphs = create_cudagraphs


# --------------------------------------------------------------------------------------------
# Megatron-LM's parser (megatron.training.arguments)
# --------------------------------------------------------------------------------------------

# A '%' in a help text: an escaped '%%', an argparse field such as '%(default)s', or bare.
_PERCENT = re.compile(r"%(?:%|\([a-z_]+\)[a-z])?")


def megatron_parser_flaws_fixed(parser: argparse.ArgumentParser) -> None:
    """Two flaws of Megatron-LM's parser, fixed on ``parser`` in place: some help texts hold a
    bare '%', on which argparse's ``--help`` fails; enum flags (``--attention-backend``,
    ``--exit-signal``) convert by name lookup, whose KeyError argparse does not catch, so a typo
    ended in a traceback instead of a usage error naming the choices."""
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = _PERCENT.sub(lambda m: "%%" if m.group() == "%" else m.group(),
                                       action.help)
        if callable(action.type) and not isinstance(action.type, type):
            action.type = _unknown_name_is_a_bad_value(action.type, action.choices)


def _unknown_name_is_a_bad_value(convert, choices):
    @functools.wraps(convert)  # argparse names the type in its other errors
    def convert_or_refuse(value):
        try:
            return convert(value)
        except KeyError:
            names = ", ".join(getattr(c, "name", str(c)) for c in choices or [])
            raise argparse.ArgumentTypeError(
                f"invalid value {value!r}" + (f" (use one of {names})" if names else ""))
    return convert_or_refuse


def apply_core_patches() -> dict:
    """Apply every patch once. Raises on a megatron-core version these were not written for.

    Returns ``{patch name: "applied" | "not needed: <why>"}`` (also kept in `applied_patches`).
    """
    global _applied
    if _applied:
        return applied_patches
    require_patched_version()
    for patch in (keep_forward_inputs_until_backward_captured,
                  keep_chunk_graph_buffers_private,
                  keep_saved_tensor_observer_armed_until_capture,
                  sync_free_multi_tensor_fallbacks,
                  clip_gradients_without_host_sync,
                  warm_up_graphs_on_recorded_layouts,
                  te_cross_entropy_capturable,
                  check_arg_types_without_reimporting,
                  record_capture_statistics,
                  skip_dataset_helper_build):
        applied_patches[patch.__name__] = patch() or "applied"
    _applied = True
    return applied_patches


# --------------------------------------------------------------------------------------------
# The seam into Megatron-LM's training loop (the wheel's megatron.training, 0.19.2)
# --------------------------------------------------------------------------------------------

def route_training_loop(on_setup: Callable, capturable_optimizer: bool = False) -> None:
    """Put the fork's graph runtime into Megatron-LM's ``pretrain()`` at its one seam.

    ``train()`` and ``evaluate()`` look up ``get_forward_backward_func`` in their module at call
    time and run every iteration through what it returns; ``pretrain()`` builds the model and
    optimizer through ``setup_model_and_optimizer``. So:

    * after ``setup_model_and_optimizer`` returns, ``on_setup(model, optimizer, scheduler)``
      builds the runtime and returns a callable ``wrap(schedule) -> schedule`` (e.g.
      `schedule.GraphRuntimeSchedule`);
    * ``get_forward_backward_func(...)`` then returns ``wrap(<megatron-core's schedule>)``;
      before the set-up (never, in ``pretrain``) megatron-core's own;
    * with ``capturable_optimizer`` the optimizer is built capturable
      (``OptimizerConfig.optimizer_cuda_graph``, for the fork's optimizer graph) while upstream's
      own ``--optimizer-cuda-graph`` wrapper stays off;
    * DDP is built on the stream the process runs on (`ddp_on_the_process_stream`);
    * every pipeline stage holds the MoE metrics at the routers' size
      (`size_moe_metrics_as_the_routers_do`);
    * the end of each iteration reads nothing back from the GPU where nothing needs reading
      (`all_model_parallel_ranks_updated`, `max_stat_across_model_parallel_ranks`,
      `keep_loss_scale_on_host`, `training_log_summing_losses_on_device`,
      `reduce_rerun_flags_on_host`, `check_exit_signal_on_host`).

    Upstream's own graph wrappers (``FullCudaGraphWrapper``, ``TECudaGraphHelper``, the
    optimizer wrapper) key on ``args.cuda_graph_impl`` / ``args.optimizer_cuda_graph``, which
    the fork's entry keeps at "local"/"none" and False: every graph decision is the runtime's.
    """
    import megatron.training.training as loop
    from megatron.core.utils import get_model_config
    from megatron.training import get_args

    upstream_setup = loop.setup_model_and_optimizer
    upstream_schedule = loop.get_forward_backward_func
    upstream_optimizer_config = loop.get_megatron_optimizer_config
    wrap = None

    def setup_model_and_optimizer(*args, **kwargs):
        nonlocal wrap
        model, optimizer, scheduler = upstream_setup(*args, **kwargs)
        keep_loss_scale_on_host(optimizer)
        size_moe_metrics_as_the_routers_do(get_args(), get_model_config(model[0]))
        wrap = on_setup(model, optimizer, scheduler)
        return model, optimizer, scheduler

    def get_forward_backward_func(*args, **kwargs):
        schedule = upstream_schedule(*args, **kwargs)
        return schedule if wrap is None else wrap(schedule)

    def get_megatron_optimizer_config(args, *more, **kwargs):
        # Upstream copies args' fields into the config and derives per-parameter overrides
        # from it, so the flag is set on args for the duration of the call.
        if not capturable_optimizer:
            return upstream_optimizer_config(args, *more, **kwargs)
        shown, args.optimizer_cuda_graph = args.optimizer_cuda_graph, True
        try:
            return upstream_optimizer_config(args, *more, **kwargs)
        finally:
            args.optimizer_cuda_graph = shown

    loop.setup_model_and_optimizer = setup_model_and_optimizer
    loop.get_forward_backward_func = get_forward_backward_func
    loop.get_megatron_optimizer_config = get_megatron_optimizer_config
    if not getattr(loop.wrap_model_chunks_with_ddp, "on_process_stream", False):
        loop.wrap_model_chunks_with_ddp = ddp_on_the_process_stream(
            loop.wrap_model_chunks_with_ddp)
    loop.logical_and_across_model_parallel_group = all_model_parallel_ranks_updated
    loop.reduce_max_stat_across_model_parallel_group = max_stat_across_model_parallel_ranks
    if not getattr(loop.training_log, "sums_losses_on_device", False):
        loop.training_log = training_log_summing_losses_on_device(loop.training_log)
    reduce_rerun_flags_on_host()
    check_exit_signal_on_host()


def moe_metric_names(args) -> list:
    """The MoE metrics Megatron-LM's ``training_log`` reports and reduces, in its order."""
    balancing = args.moe_router_load_balancing_type  # a name or a list of names
    names = [name for name in ("load_balancing_loss", "seq_load_balancing_loss",
                               "global_load_balancing_loss")
             if name.replace("load_balancing_loss", "aux_loss") in balancing]
    return names + (["z_loss"] if args.moe_z_loss_coeff is not None else [])


def size_moe_metrics_as_the_routers_do(args, config) -> None:
    """Create Megatron-LM's MoE metrics on this rank at the size its routers record them.

    megatron-training 0.19.2's ``training_log`` reduces each MoE metric over the pipeline
    group, having created it where no router did at the size it passes: for a hybrid model,
    the number of MoE layers. The routers create it with one slot per layer
    (``config.num_layers`` plus MTP layers). A hybrid pipeline stage without an MoE layer
    (Nemotron-H at PP = 2: ``M*-`` | ``EM*``) then reduces a tensor of another size than
    its peer, and the run hangs at its first log line. Created here first, at the routers'
    size, every stage reduces the same shape; a router's own record sets its groups.
    """
    if args.num_experts is None:
        return
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    for name in moe_metric_names(args):
        tracker.ensure_initialized(name, config.num_layers + (config.mtp_num_layers or 0))


def ddp_on_the_process_stream(upstream: Callable) -> Callable:
    """Upstream's ``wrap_model_chunks_with_ddp`` run on the process's side stream
    (`use_side_stream`, which the fork's model providers call); upstream's call as it is
    where the process is not on one.

    megatron-training 0.19.2's ``get_model`` wraps the model in DDP on a fresh stream unless
    ``cuda_graph_impl`` is "full_iteration" (which the fork's entry keeps at "local"). DDP
    keeps each parameter's AccumulateGrad node, and autograd runs a node on the stream it was
    created on: every weight gradient of every backward then crosses streams
    (``record_stream`` and an event wait per parameter, torch's "AccumulateGrad node's stream
    does not match" warning). That costs host time per parameter (many with MoE experts).
    Not the default stream either: nodes on the legacy default stream make a layer graph's
    backward capture fail (a capturing stream may not make the legacy stream wait), which is
    why upstream avoids it.
    """
    def wrap_model_chunks_with_ddp(*args, **kwargs):
        if _side_stream is None:  # no CUDA, or a model provider that did not switch
            return upstream(*args, **kwargs)
        with torch.cuda.stream(_side_stream):
            return upstream(*args, **kwargs)

    wrap_model_chunks_with_ddp.on_process_stream = True
    return wrap_model_chunks_with_ddp


# Megatron-LM's train_step and training_log end every iteration with three host reads: whether
# the update succeeded on every model-parallel rank, the gradient norm's maximum over them
# (train_step) and the learning rate's (training_log), each a one-element tensor built on the
# GPU, all-reduced and read back; and train() reads the optimizer's loss scale, a CUDA tensor,
# every iteration. Each read waits for the whole step, so the GPU idles while the host plans
# the next iteration (docs/benchmarks.md). With a model-parallel group of one these reductions
# are identities, and without a loss scaler the scale is the constant 1: route_training_loop
# installs the two functions below, and the loss scale goes to the host after the set-up.
def _model_parallel_size(group) -> int:
    from megatron.core import parallel_state

    group = group if group is not None else parallel_state.get_model_parallel_group()
    return torch.distributed.get_world_size(group)


def all_model_parallel_ranks_updated(update_successful: bool, group=None) -> bool:
    """Upstream's ``logical_and_across_model_parallel_group`` without the device round trip in
    a model-parallel group of one (then it is ``update_successful``); upstream's otherwise."""
    if _model_parallel_size(group) == 1:
        return bool(update_successful)
    return _upstream_loop_utils()[0](update_successful, group=group)


def max_stat_across_model_parallel_ranks(stat, group=None):
    """Upstream's ``reduce_max_stat_across_model_parallel_group`` (the gradient norm, the zero
    count, the learning rate) without a host read where none is needed:

    * a model-parallel group of one: ``stat`` itself (a float or None), or the optimizer's
      CUDA gradient norm as a 0-dim tensor, which the log reads only when it prints it;
    * a CUDA tensor in a larger group: its maximum over the group as a 0-dim CUDA tensor (an
      all-reduce on the device; ranks without the statistic take upstream's path, which joins
      the same all-reduce with -1);
    * otherwise upstream's (a float: one all-reduce and a host read).
    """
    if _model_parallel_size(group) == 1:
        # 0-dim, so the log line's f"{grad_norm:.3f}" formats it (a 1-element tensor cannot)
        return stat.detach().reshape(()) if torch.is_tensor(stat) else stat
    if torch.is_tensor(stat) and stat.is_cuda:
        reduced = stat.detach().float().reshape(1).clone()
        torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX, group=group)
        return reduced.reshape(())
    return _upstream_loop_utils()[1](stat, group=group)


def _upstream_loop_utils():
    from megatron.training.utils import common_utils

    return (common_utils.logical_and_across_model_parallel_group,
            common_utils.reduce_max_stat_across_model_parallel_group)


def training_log_summing_losses_on_device(upstream_log: Callable) -> Callable:
    """Megatron-LM's ``training_log`` that adds the iteration's losses to the interval's sums
    without a host copy. Upstream evaluates ``torch.tensor([0.0], device='cuda')`` for every
    loss key of every iteration (the default of a ``dict.get``): a pageable host-to-device
    copy, which waits for the whole step. Here the sums start from ``torch.zeros`` on the
    device (a fill kernel) and the same additions run on the device, so the values are
    upstream's bitwise. Upstream still gets the iteration's losses where it reads them itself:
    a skipped iteration (its NaN check) and a TensorBoard/W&B iteration (the writers)."""
    import inspect

    from megatron.training.global_vars import get_args, get_tensorboard_writer

    signature = inspect.signature(upstream_log)

    def training_log(*positional, **keywords):
        call = signature.bind(*positional, **keywords)
        losses, sums = call.arguments["loss_dict"], call.arguments["total_loss_dict"]
        args, iteration = get_args(), call.arguments["iteration"]
        writes = (get_tensorboard_writer() is not None
                  and iteration % args.tensorboard_log_interval == 0)
        if losses and not call.arguments["skipped_iter"] and not writes:
            for key, loss in losses.items():
                total = sums.get(key)
                if total is None:
                    total = torch.zeros(1, dtype=torch.float, device=loss.device)
                sums[key] = total + loss
            call.arguments["loss_dict"] = {}
        return upstream_log(*call.args, **call.kwargs)

    training_log.sums_losses_on_device = True
    training_log.__wrapped__ = upstream_log
    return training_log


def reduce_rerun_flags_on_host() -> None:
    """Megatron-LM's rerun state machine all-reduces its request flags over the world after
    every forward-backward (``RerunStateMachine._reduce_any``) as one-element CUDA tensors
    read back on the host: two device syncs per iteration in its default ``validate_results``
    mode. The flags are host booleans, so they are reduced on the host: as they are in a
    world of one, else over a Gloo group of the world (a host all-reduce, no device sync)."""
    RerunStateMachine._reduce_any = any_rank_requested


def any_rank_requested(machine, value):
    """``RerunStateMachine._reduce_any`` on the host: whether any rank's flag is set, for one
    flag or a list of flags (a tuple back), as upstream returns them."""
    flags = [bool(flag) for flag in (value if isinstance(value, list) else [value])]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        counts = torch.tensor(flags, dtype=torch.int32)
        torch.distributed.all_reduce(counts, group=_host_world_group())
        flags = [count > 0 for count in counts.tolist()]
    return tuple(flags) if isinstance(value, list) else flags[0]


def check_exit_signal_on_host() -> None:
    """With ``--exit-signal-handler`` Megatron-LM asks every iteration whether any rank got the
    signal (``DistributedSignalHandler.signals_received``): each rank's flag goes into a CUDA
    tensor, is all-gathered and read back, a device sync per iteration. The flag is a host
    boolean, so it is gathered on the host (`signals_received_on_host`)."""
    from megatron.training.dist_signal_handler import DistributedSignalHandler

    DistributedSignalHandler.signals_received = signals_received_on_host


def signals_received_on_host(handler) -> list:
    """``DistributedSignalHandler.signals_received`` on the host: every rank's flag, in rank
    order (a Gloo all-gather over the world; a world of one: this rank's)."""
    received = bool(handler._signal_received)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [received]
    flags = [torch.zeros(1, dtype=torch.int32)
             for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(flags, torch.tensor([int(received)], dtype=torch.int32),
                                 group=_host_world_group())
    return [bool(flag.item()) for flag in flags]  # host tensors: no device sync


_HOST_WORLD_GROUP = []


def _host_world_group():
    """A Gloo group of the whole world, made at the first reduction (a collective every rank
    reaches at the same point: the rerun machine's reduction is one already)."""
    if not _HOST_WORLD_GROUP:
        _HOST_WORLD_GROUP.append(torch.distributed.new_group(backend="gloo"))
    return _HOST_WORLD_GROUP[0]


LOSS_SCALE_ONE = torch.tensor(1.0)  # 0-dim on the host: a scalar operand for a CUDA loss


def keep_loss_scale_on_host(optimizer) -> bool:
    """Without a loss scaler (bf16, fp32), make ``optimizer.get_loss_scale()`` return the host
    scalar 1.0 instead of upstream's one-element CUDA tensor, on the optimizer and each chained
    one: train() calls ``.item()`` on it every iteration, a device sync. ``scale_loss`` and
    megatron-core's schedules multiply the loss by it as before (a 0-dim host tensor is a scalar
    operand of a CUDA op; the product is the loss, bitwise). With a loss scaler (fp16) the scale
    lives on the device and changes: nothing is replaced. Returns whether it replaced it."""
    parts = [optimizer, *getattr(optimizer, "chained_optimizers", [])]
    if any(getattr(part, "grad_scaler", None) is not None for part in parts):
        return False
    for part in parts:
        part.get_loss_scale = lambda: LOSS_SCALE_ONE
    return True


def skip_dataset_helper_build() -> str:
    """Megatron-LM's start-up runs ``make`` in megatron-core's datasets folder on rank 0 to
    build its C++ helpers, and exits when that fails; the wheel ships the helpers prebuilt
    and no Makefile, so ``make`` always fails. The fork's packed datasets never call them."""
    from megatron.core.datasets import utils as dataset_utils

    if not hasattr(dataset_utils, "compile_helpers"):
        return "not needed: megatron-core has no compile_helpers"
    dataset_utils.compile_helpers = lambda: None
    return "applied"


# --------------------------------------------------------------------------------------------
# Reaches: what the fork's modules call where no subclass or spec can do the job
# --------------------------------------------------------------------------------------------

def megatron_core_linears_unfused_without_apex() -> str:
    """megatron-core's own linears (``ColumnParallelLinear``, ``RowParallelLinear``: the output
    layer, and every linear of a TE-free spec) accumulate their weight gradient unfused where
    apex's ``fused_weight_gradient_mlp_cuda`` is missing, so ``--gradient-accumulation-fusion``
    can stay on for TE's linears, which fuse with TE's own GEMM. Upstream reads the flag from
    the shared config at build: ``ColumnParallelLinear`` raises without apex and
    ``RowParallelLinear`` would fail at its first backward. The flag is off only while such a
    linear is built; it keeps its own copy (``self.gradient_accumulation_fusion``). Applied
    (once) by the fork's model builders (packed_training/models.py), so every path that builds
    a model from arguments that kept the flag on (`extra_args.check_gradient_accumulation_fusion`)
    has it."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return "not needed: apex's fused_weight_gradient_mlp_cuda is importable"

    def unfused(upstream_init):
        @functools.wraps(upstream_init)
        def __init__(self, *args, config, **kwargs):
            fused, config.gradient_accumulation_fusion = config.gradient_accumulation_fusion, False
            try:
                upstream_init(self, *args, config=config, **kwargs)
            finally:
                config.gradient_accumulation_fusion = fused

        __init__.unfused_without_apex = True
        return __init__

    for linear in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        if not getattr(linear.__init__, "unfused_without_apex", False):
            linear.__init__ = unfused(linear.__init__)
    return "applied"


def ddp_keeps_fused_wgrad_flags() -> None:
    """DDP's ``zero_grad_buffer`` leaves ``grad_added_to_main_grad`` set on the weights whose
    gradient TE accumulates into ``main_grad`` itself (``--gradient-accumulation-fusion``),
    for TE layer graphs (`te_graphs.TELayerGraphs`).

    TE's backward sets the flag and returns a placeholder gradient (uninitialised memory), and
    DDP's hook adds a returned gradient into ``main_grad`` only while the flag is clear.
    megatron-core 0.19.2 clears every flag at each ``zero_grad_buffer`` unless
    ``cuda_graph_impl`` is "transformer_engine", which the fork's entry keeps at "local"; a
    replayed TE graph runs no Python to set it again, so DDP would add the placeholder. No
    other path sets the flag, so a weight that had it set keeps it.
    """
    upstream = DistributedDataParallel.zero_grad_buffer
    if getattr(upstream, "keeps_fused_wgrad_flags", False):
        return

    @functools.wraps(upstream)
    def zero_grad_buffer(self):
        fused = [p for p in self.params_with_grad if getattr(p, "grad_added_to_main_grad", False)]
        upstream(self)
        for param in fused:
            param.grad_added_to_main_grad = True

    zero_grad_buffer.keeps_fused_wgrad_flags = True
    DistributedDataParallel.zero_grad_buffer = zero_grad_buffer


@contextlib.contextmanager
def ddp_gather_hooks_removed(ddp_chunks):
    """While TE captures layer graphs, remove DDP's parameter-gather forward pre-hooks (TE's
    ``make_graphed_callables`` refuses modules with hooks) after one synchronous gather of
    every parameter, so the capture reads current weights; register them again after.

    A collective: every rank must enter it at the same capture. Upstream's loop does the same
    around its own TE capture. No-op without ``--overlap-param-gather`` and while Megatron-LM's
    first iteration runs with the hooks off.
    """
    hooked = [chunk for chunk in ddp_chunks if getattr(chunk, "use_forward_hook", False)
              and chunk.remove_forward_pre_hook_handles]
    for chunk in hooked:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in hooked:
            chunk.enable_forward_pre_hook()


def ddp_param_gather_before_te_replays(ddp_chunk, layers) -> None:
    """With ``--overlap-param-gather``, a replayed TE layer graph first runs DDP's parameter
    all-gather pre-hook for each module inside it that holds parameters (the layer's
    ``cuda_graph_manual_hooks``, which `te_graphs.TEGraphDispatch` runs before each replay).

    DDP waits for a module's gathered parameters, and dispatches the next bucket's gather, in
    that module's forward pre-hook; a replay runs no submodule's forward, so without these the
    parameter shards other ranks updated would never arrive. Upstream's own TE graph helper
    does the same after capture, with DDP's private hook factory. No-op without the overlap.
    """
    if not getattr(ddp_chunk, "use_forward_hook", False):
        return
    hook = ddp_chunk._make_forward_pre_hook()  # one closure; it takes the module as argument
    for layer in layers:
        layer.cuda_graph_manual_hooks = [
            (hook, (module,)) for module in layer.modules()
            if next(module.parameters(recurse=False), None) is not None]


def local_graphs_created() -> bool:
    """Whether megatron-core's local graphs have been captured (upstream's private flag)."""
    return cuda_graphs._CudagraphGlobalRecord.cudagraph_created


def unshare_cached_graph_inputs(kwargs: dict) -> dict:
    """While local graphs are being recorded, give each graph call its own RoPE table.

    megatron-core caches the RoPE table (``RotaryEmbedding.forward`` is ``lru_cache``d), so
    one tensor object reaches the graphs of every micro-batch. 0.19.2's buffer accounting
    counts each use of a tensor as a graph input and requires all its forward graphs to be
    captured before the first backward graph (``assert fwd_buffer_reuse_ref_count == 0`` in
    ``_create_cudagraphs``). That fails as soon as graphs of two micro-batches are recorded
    with a backward in between: a capacity ladder at PP = 1, runners per micro-batch at
    PP > 1. A copy per call, in the recording iteration only, keeps the accounting per graph.
    Returns ``kwargs`` itself when there is nothing to copy.
    """
    rope = kwargs.get("rotary_pos_emb")
    if local_graphs_created() or rope is None:
        return kwargs
    copied = tuple(t.clone() for t in rope) if isinstance(rope, tuple) else rope.clone()
    return dict(kwargs, rotary_pos_emb=copied)


def rotate_runners(manager) -> None:
    """Move a manager's next runner to the back: a bypassed micro-batch takes its turn.

    With PP > 1 the manager replays its runners round-robin, one per call, in capture order
    (``get_cudagraph_runner``, ``reuse_cudagraphs=False``).
    """
    runners = manager.cudagraph_runners
    manager.cudagraph_runners = runners[1:] + runners[:1]


def replay_runner_first(manager, runner, runners) -> None:
    """Make ``runner`` the one the manager replays next; ``runners`` is the full set, in order."""
    manager.cudagraph_runners = [runner] + [r for r in runners if r is not runner]


def sort_runners(manager, key: Callable) -> None:
    """Stable-sort a manager's runners (PP == 1: upstream takes the first whose arguments match)."""
    manager.cudagraph_runners.sort(key=key)


def layer_graphed_for_modules(layer) -> bool:
    """Whether megatron-core graphs ``layer`` under its config's ``cuda_graph_modules`` with the
    TE implementation (``cuda_graphs._layer_is_graphable``: every layer when the list is
    empty; else e.g. MoE layers for moe_router, attention layers for attn, Mamba for mamba)."""
    return cuda_graphs._layer_is_graphable(layer, layer.config)


def recorded_kwarg(runner, name: str):
    """The value a runner's forward graph was recorded with for keyword argument ``name``."""
    meta = runner.fwd_graph_input_kwarg_metas.get(name)
    return None if meta is None else meta.value


def switch_block_class(block, subclass) -> None:
    """Give a built ``TransformerBlock`` the methods of ``subclass``, in place.

    0.19.2's GPTModel (deprecated upstream, still the GPT path) constructs ``TransformerBlock``
    by name with no spec hook for the block class, so the chunk-graph dispatch enters by
    switching the built block's class to a subclass that adds methods only (no state of its
    own before first use): same parameters, same initialisation.
    """
    from megatron.core.transformer.transformer_block import TransformerBlock

    if not issubclass(subclass, TransformerBlock) or vars(subclass).get("__init__"):
        raise TypeError(f"{subclass.__name__} must subclass TransformerBlock without an __init__")
    if type(block) is TransformerBlock:
        block.__class__ = subclass


@contextlib.contextmanager
def te_graph_capture():
    """Mark a TE ``make_graphed_callables`` capture for megatron-core's layer dispatch.

    ``GraphableMegatronModule.__call__`` routes a layer to ``_te_cuda_graph_capture`` while
    upstream's private capture flag is set (``cuda_graphs.is_graph_capturing``).
    """
    cuda_graphs._set_capture_start()
    try:
        yield
    finally:
        cuda_graphs._set_capture_end()


def te_cp_stream() -> torch.cuda.Stream:
    """TE's class-level context-parallel stream, created on first use.

    ``TEDotProductAttention.__init__`` creates it only for a static CP size > 1; a dynamic-CP
    micro-batch needs one whatever the static size is. All TE attention layers share it, as
    upstream's do.
    """
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    if TEDotProductAttention.cp_stream is None:
        TEDotProductAttention.cp_stream = torch.cuda.Stream()
    return TEDotProductAttention.cp_stream


def use_side_stream() -> None:
    """Run the rest of the process on a side CUDA stream, graphs on or off; once per process
    (later calls keep the stream), and nothing without CUDA. A process already off the
    default stream keeps its stream: megatron-core's first ``CudaGraphManager`` (built with
    a model that has local graphs) switches to one of its own.

    Call it after the model is built, before it is wrapped in DDP, and outside any
    ``torch.cuda.stream`` scope, whose exit would switch the process back: Megatron-LM's
    ``get_model`` wraps DDP inside one, so the fork's model provider calls this. Autograd
    runs a parameter's AccumulateGrad node on the stream it was created on, and DDP keeps
    those nodes from its construction (`ddp_on_the_process_stream` builds it on this stream):
    backward and gradient accumulation then share one stream, and it is not the legacy
    default stream, on which such nodes make graph capture fail ("operation would make the
    legacy stream depend on a capturing blocking stream").
    """
    global _side_stream
    if _side_stream is not None or not torch.cuda.is_available():
        return
    default = torch.cuda.default_stream()
    stream = torch.cuda.current_stream()
    if stream == default:
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
    # The model was built (at least in part) on the default stream, which a side stream does
    # not wait for by itself.
    stream.wait_stream(default)
    _side_stream = stream


def graph_manager_on_the_process_stream(config) -> "cuda_graphs.CudaGraphManager":
    """A megatron-core ``CudaGraphManager`` built without moving the process off its stream.

    The first manager of a process switches it to a new stream, which does not wait for the
    current one. Managers built with the model are fine (`use_side_stream` adopts that stream
    before DDP is built), but a chunk's manager is built at its first forward, after DDP: the
    switch would leave backward on a stream apart from DDP's, and the new stream could read
    the chunk's input before the old one wrote it.
    """
    stream = torch.cuda.current_stream()
    manager = cuda_graphs.CudaGraphManager(config)
    torch.cuda.set_stream(stream)
    return manager


def forget_layer_graph_grad_events(model) -> int:
    """Drop the layer-graph gradient events megatron-core leaves on parameters; returns how many.

    A local backward-graph replay tags each parameter it wrote with its completion event
    (``param._cudagraph_wgrad_ready_event``, cuda_graphs.py), and DDP's gradient sync waits on
    every tagged event before reducing (param_and_grad_buffer.start_grad_sync). Inside a
    whole-iteration capture that wait would be on an event recorded outside the capture,
    which CUDA refuses. Called after a device sync, when those events are complete; the next
    layer-graph replay tags the parameters again.
    """
    dropped = 0
    for chunk in model:
        for param in chunk.parameters():
            if getattr(param, "_cudagraph_wgrad_ready_event", None) is not None:
                del param._cudagraph_wgrad_ready_event
                dropped += 1
    return dropped


def keep_runner_buffers(runner, own_pool: bool = False) -> None:
    """Mark a local-graph runner so `keep_chunk_graph_buffers_private` keeps its buffers;
    ``own_pool``: capture it into a graph pool of its own (the runner's ``mempool`` field)
    instead of megatron-core's one shared pool."""
    if own_pool:
        runner.mempool = torch.cuda.graph_pool_handle()
    runner.keep_buffers_private = True


def route_graphed_function(module, name: str, call: Callable) -> None:
    """Replace the graphed ``module.<name>`` that a ``CudaGraphManager`` installed with ``call``.

    0.19.2's manager wraps a partial-graph function (``_forward_attention``, the MoE router's
    and postprocess's) by setting an instance attribute of the same name; the fork wraps that
    wrapper again to send some calls eager (``eager=True``)."""
    if name not in vars(module):
        raise RuntimeError(f"megatron-core did not install a graphed {name!r} on "
                           f"{type(module).__name__}: core_patches.route_graphed_function "
                           f"needs re-checking against megatron-core {PATCHED_VERSION}")
    setattr(module, name, call)


def set_dispatcher_graph_state(dispatcher, values) -> None:
    """Write the MoE preprocess graph's outputs into the dispatcher fields megatron-core lists
    in ``valid_cudagraph_attrs`` (dotted paths), as its own TE replay does before dispatch."""
    names = dispatcher.valid_cudagraph_attrs
    if len(values) != len(names):
        raise RuntimeError(f"the MoE preprocess graph returned {len(values)} dispatcher "
                           f"tensors for the attributes {names}")
    for name, value in zip(names, values):
        *path, leaf = name.split(".")
        owner = dispatcher
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, leaf, value)


# What the alltoall dispatcher holds per call or per mode: saved and restored around a
# dropless pass of a drop-and-pad layer.
DISPATCHER_STATE = ("drop_and_pad", "config", "cuda_sync_point", "input_splits",
                    "output_splits", "output_splits_tp")


@contextlib.contextmanager
def dispatch_dropless(dispatcher) -> Iterator[None]:
    """Within the scope, a drop-and-pad ``MoEAlltoAllTokenDispatcher`` dispatches dropless.

    The dispatcher reads its mode from its config copy (``moe_expert_capacity_factor``,
    ``moe_pad_expert_input_to_capacity``) and ``drop_and_pad``, and keeps per-call split
    sizes and its sync point in fields; all of it (`DISPATCHER_STATE`) is restored after."""
    saved = {name: getattr(dispatcher, name) for name in DISPATCHER_STATE}
    dropless_config = copy.copy(dispatcher.config)
    dropless_config.moe_expert_capacity_factor = None
    dropless_config.moe_pad_expert_input_to_capacity = False
    dispatcher.config, dispatcher.drop_and_pad = dropless_config, False
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(dispatcher, name, value)


def yarn_channel_mask_and_scale(rope, device) -> Tuple[torch.Tensor, float]:
    """megatron-core's yarn pieces for the settings of ``rope`` (a ``YarnRotaryEmbedding``):
    per frequency channel 1.0 where it keeps its original frequency and 0.0 where it is
    interpolated (``[dim // 2]`` fp32 on ``device``), and the concentration factor.

    Upstream keeps them as private helpers of its yarn module; the packed MLA tables reuse
    them so that they stay upstream's tables bit for bit.
    """
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    low, high = yarn._yarn_find_correction_range(
        rope.beta_fast, rope.beta_slow, rope.dim, rope.rotary_base,
        rope.original_max_position_embeddings, rope.correction_range_round_to_int)
    kept = 1.0 - yarn._yarn_linear_ramp_mask(low, high, rope.dim // 2, device=device)
    return kept, yarn._yarn_get_concentration_factor(rope.scaling_factor, rope.mscale,
                                                     rope.mscale_all_dim)


def install_optimizer_step(optimizer, step: Callable) -> None:
    """Make ``optimizer.step`` ``step`` (the fork's optimizer graph), as Megatron-LM's own
    optimizer-graph wrapper replaces the step of the optimizer ``train()`` calls."""
    optimizer.step = step


def run_state_dict_within(part, scope: Callable[[], ContextManager]) -> None:
    """Make ``part.state_dict()`` run inside ``scope()``.

    megatron-core's ``ChainedOptimizer`` saves through each part's ``sharded_state_dict``,
    which calls the part's own ``state_dict``: the one place a save reads the live values."""
    upstream = part.state_dict

    def state_dict(*positional, **keywords):
        with scope():
            return upstream(*positional, **keywords)

    part.state_dict = state_dict


def te_layer_capture_keywords(make_graphed_callables, num_layers: int) -> dict:
    """Keywords of TE's ``make_graphed_callables`` for one chunk of ``num_layers`` layers
    captured forward-all-then-backward-all, as megatron-core's TE helper passes them.

    ``_order`` and ``_num_layers_per_chunk`` are TE's private schedule keywords. And TE 2.20
    copies each parameter's static gradient buffer when a backward replay returns it
    (``clone_param_grads_on_return``, default on; TE 2.11 returned the buffer): here each
    gradient goes straight to megatron-core DDP's hook, which adds it into ``main_grad`` on
    the current stream before a later replay can overwrite the buffer, so the copy buys
    nothing and costs one device copy per weight per micro-batch (moonlight-small: 2,272
    copies and 11 ms of GPU time a step)."""
    import inspect

    keywords = {"_order": [1, -1], "_num_layers_per_chunk": [num_layers]}
    if "clone_param_grads_on_return" in inspect.signature(make_graphed_callables).parameters:
        keywords["clone_param_grads_on_return"] = False
    return keywords


# --------------------------------------------------------------------------------------------
# Dynamic context parallelism: megatron-core's hybrid DP x CP groups at Megatron-LM's start-up
# --------------------------------------------------------------------------------------------

def build_hybrid_cp_groups_at_start_up() -> None:
    """Make Megatron-LM's start-up build megatron-core's hybrid DP x CP groups: aligned blocks
    of the data x context-parallel ranks of every power-of-two size, from which dynamic CP
    takes each micro-batch's CP group (dynamic_cp.dynamic_cp_group). Idempotent.

    ``initialize_megatron`` (in ``pretrain()``) builds the process groups in
    ``_initialize_distributed``, which passes ``args.hybrid_context_parallel`` on to
    ``parallel_state.initialize_model_parallel``: that field is True for the duration of the
    call only. Left on, it would also start upstream's own hybrid CP, another scheduler over
    another data format: ``validate_args`` wants ``--dataloader-type single`` with it,
    ``train()`` wraps the data iterator in ``HybridCPDataLoaderWrapper`` (which all-gathers and
    reroutes upstream's sub-samples), and the TransformerConfig field of the same name turns
    megatron-core's no-pipelining schedule into ``hybrid_context_parallel_forward_backward``.
    """
    from megatron.training import get_args
    from megatron.training import initialize as start_up

    upstream = start_up._initialize_distributed
    if getattr(upstream, "builds_hybrid_cp_groups", False):
        return

    def initialize_distributed(*positional, **keywords):
        args = get_args()
        shown, args.hybrid_context_parallel = args.hybrid_context_parallel, True
        try:
            return upstream(*positional, **keywords)
        finally:
            args.hybrid_context_parallel = shown

    initialize_distributed.builds_hybrid_cp_groups = True
    start_up._initialize_distributed = initialize_distributed


# --------------------------------------------------------------------------------------------
# Forward-only graphs: the memory pool they share with the local layer graphs
# --------------------------------------------------------------------------------------------

def local_graph_pool():
    """megatron-core's one memory pool of local CUDA graphs (``CudaGraphManager.global_mempool``,
    created with the first manager, i.e. when the first graphable layer is built under
    ``cuda_graph_impl == "local"``), or None before any manager exists.

    Forward-only graphs (forward_graphs.py) capture into it: they replay only between
    training iterations, when no layer graph's buffers hold a value another layer graph
    still reads, so the two sets of graphs can share free blocks instead of each keeping its
    own activation-sized pool."""
    return cuda_graphs.CudaGraphManager.global_mempool
