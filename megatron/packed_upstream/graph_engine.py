"""Reaches into megatron-core's local graph engine (``transformer/cuda_graphs.py``) and
Transformer Engine's graph capture, for megatron-core 0.19.2 (`gate.PATCHED_VERSION`).

Patches (installed once by `patches.apply_core_patches`):

* `keep_forward_inputs_until_backward_captured`: the engine releases forward buffers it
  believes the backward does not need, learning that only from Python
  ``save_for_backward`` calls; inputs saved by native autograd ops (torch norms) were
  released and reused (wrong first-norm and embedding gradients).
* `keep_saved_tensor_observer_armed_until_capture`: upstream disarms that observer at the end
  of the first schedule, which in this fork is an eager warm-up iteration.
* `keep_chunk_graph_buffers_private`: chunk-graph slots replay out of capture order, and eager
  code reads a partial MoE router graph's outputs, so those runners' buffers are never shared.
* `warm_up_graphs_on_recorded_layouts`: the capture's warm-up passes run on the recorded
  call's integer inputs (packed boundaries) instead of zero-filled buffers.
* `check_arg_types_without_reimporting`, `record_capture_statistics`: host time and statistics.
* `graph_runtime_owns_fp8_weight_flag` (installed by the graph runtime of an FP8 run): the
  replays stop writing TE's weight-cache flag, which the runtime writes per micro-batch.

Reaches (called where a subclass cannot do the job): the order of a manager's runners
(`replay_runner_first`, `rotate_runners`, `sort_runners`), upstream's private "graphs
created" flag (`local_graphs_created`), a runner's recorded arguments, buffers and pool
(`recorded_kwarg`, `keep_runner_buffers`, `local_graph_pool`), a layer's graph managers and
TE graphed callables, the TE capture flag and keywords (`te_graph_capture`,
`te_layer_capture_keywords`, `layer_graphed_for_modules`), TE's CP stream (`te_cp_stream`),
and the process-wide side stream (`use_side_stream`, `graph_manager_on_the_process_stream`).
"""

import collections
import contextlib
import gc
import dataclasses
from typing import Callable, ContextManager, Iterator
import torch
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import cuda_graphs

from megatron.packed_upstream.gate import PATCHED_VERSION, patch


def reserved_without_cache() -> int:
    """Bytes the CUDA caching allocator holds after releasing its free cache (syncs).

    A capture's growth of this number is what its graph pools and static buffers keep. Plain
    ``memory_reserved`` deltas are not: a capture (or a kernel autotuner inside it) may empty
    the cache, so they can come out negative.
    """
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()



# The upstream functions as imported, before any patch (tests check the code they rely on).
UPSTREAM_WEAKREF_FORWARD_BUFFERS = cuda_graphs._CudaGraphRunner._weakref_forward_buffers


UPSTREAM_CREATE_BWD_GRAPH = cuda_graphs._CudaGraphRunner.create_bwd_graph


UPSTREAM_CREATE_CUDAGRAPHS = cuda_graphs._CudagraphGlobalRecord.create_cudagraphs.__func__


UPSTREAM_CHECK_SUPPORTED_TYPE = cuda_graphs._check_supported_type


UPSTREAM_ARG_METADATA_INIT = cuda_graphs.ArgMetadata.__init__


UPSTREAM_ARG_METADATA_ZEROS_LIKE = cuda_graphs.ArgMetadata.zeros_like


# Filled by the capture-statistics patch, one entry per graph capture; the graph runtime
# empties it after each capture iteration, and it keeps the last few at most.
capture_log: collections.deque = collections.deque(maxlen=4)


@patch
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


@patch
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


@patch
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


@patch
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


@patch
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


def process_stream():
    """The side stream `use_side_stream` switched the process to, or None."""
    return _side_stream


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


@patch
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


def drop_chunk_runner_fp8_bookkeeping(runner) -> None:
    """Switch off a chunk runner's FP8 bookkeeping (its ``fp8_enabled`` / ``fp4_enabled``).

    0.19.2's runner keys that bookkeeping on TE's global recipe, read where the runner runs:
    delayed-scaling state saved around capture, the modules registered in TE's delayed
    buffers before each replay, amaxes reduced after each backward replay. Its own layer
    runners run inside the layer's FP8 autocast. A chunk's runner runs outside any autocast,
    where TE answers its default, delayed scaling, and would treat current-scaling layers as
    delayed (``save_fp8_tensors`` fails on ``scale``, the replay's registration on
    ``amax_history``, and it would overwrite each module's recipe). The chunk's layers enter
    their own autocast inside the graph, and delayed scaling is refused under chunk graphs
    (fp8_state.check_fp8_graphs): there is nothing for the runner to keep. Call before the
    runner's capture."""
    runner.fp8_enabled = False
    runner.fp4_enabled = False


def route_graphed_function(module, name: str, call: Callable) -> None:
    """Replace the graphed ``module.<name>`` that a ``CudaGraphManager`` installed with ``call``.

    0.19.2's manager wraps a partial-graph function (``_forward_attention``, the MoE router's
    and postprocess's) by setting an instance attribute of the same name; the fork wraps that
    wrapper again to send some calls eager (``eager=True``)."""
    if name not in vars(module):
        raise RuntimeError(f"megatron-core did not install a graphed {name!r} on "
                           f"{type(module).__name__}: graph_engine.route_graphed_function "
                           f"needs re-checking against megatron-core {PATCHED_VERSION}")
    setattr(module, name, call)


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


def local_graph_pool():
    """megatron-core's one memory pool of local CUDA graphs (``CudaGraphManager.global_mempool``,
    created with the first manager, i.e. when the first graphable layer is built under
    ``cuda_graph_impl == "local"``), or None before any manager exists.

    Forward-only graphs (forward_graphs.py) capture into it: they replay only between
    training iterations, when no layer graph's buffers hold a value another layer graph
    still reads, so the two sets of graphs can share free blocks instead of each keeping its
    own activation-sized pool."""
    return cuda_graphs.CudaGraphManager.global_mempool



# --------------------------------------------------------------------------------------------
# A manager's runners and a layer's graphs, as megatron-core 0.19.2 keeps them
# --------------------------------------------------------------------------------------------

def runners(manager) -> list:
    """The manager's recorded runners, in replay order (``cudagraph_runners``)."""
    return manager.cudagraph_runners


def matches_runners_by_arguments(manager) -> bool:
    """True at PP == 1, where the manager picks the runner whose recorded arguments match
    (``reuse_cudagraphs``); False where it replays its runners round-robin in call order."""
    return manager.reuse_cudagraphs


def graph_managers(layer) -> list:
    """The layer's local graph managers: upstream's whole-layer ``cudagraph_manager``, or the
    managers a fork layer names in ``graph_manager_names`` (a partial MoE layer's), in forward
    order; each takes one runner turn per layer call."""
    names = getattr(layer, "graph_manager_names", ("cudagraph_manager",))
    return [manager for manager in (getattr(layer, name, None) for name in names)
            if manager is not None]


def chunk_graph_manager(chunk):
    """The chunk's local graph manager, built on first use (on the process's stream) where
    the chunk is no ``GraphableMegatronModule`` (megatron-core's HybridStack)."""
    if not hasattr(chunk, "cudagraph_manager"):
        chunk.cudagraph_manager = graph_manager_on_the_process_stream(chunk.config)
    return chunk.cudagraph_manager


def te_graphed_callables(layer) -> list:
    """The layer's TE graphed callables (``cuda_graphs``, one per CP bank), which megatron-core's
    ``GraphableMegatronModule.__call__`` reads to choose capture or replay."""
    return layer.cuda_graphs


def set_te_graphed_callables(layer, graphed: list) -> None:
    """Set the layer's TE graphed callables; empty makes megatron-core's dispatch capture."""
    layer.cuda_graphs = graphed


def te_replay_hooks(layer) -> list:
    """``(hook, args)`` pairs run before each TE replay (``cuda_graph_manual_hooks``, filled by
    `megatron_ddp.ddp_param_gather_before_te_replays`)."""
    return layer.cuda_graph_manual_hooks


# megatron-core's writer of TE's skip-weight-update flag, kept for tests and a later revert.
UPSTREAM_SET_SKIP_FP8_WEIGHT_UPDATE = cuda_graphs._set_skip_fp8_weight_update_tensor


@patch
def graph_runtime_owns_fp8_weight_flag() -> None:
    """megatron-core's local graphs stop writing TE's skip-weight-update flag; the graph runtime
    writes it (megatron.packed_graphs.fp8_state.WeightCacheFlag). Installed by FP8 runs only.

    Why: 0.19.2's replay node writes the flag from its manager's ``is_first_microbatch`` only
    when it differs from what *that runner* last wrote (``cuda_graphs.py:803-805``, the
    ``fp8_param_cache_updated`` memo), and every runner creation resets it
    (``:976-984``). The flag is process-global, so a layer with several runners (pipeline
    round-robin, a capacity ladder, chunk slots) skips the write that the first micro-batch
    after an optimizer step needs and replays weights quantized before the step; a chunk
    manager made after ``set_is_first_microbatch`` listed its holders (HybridStack's) never
    sees True at all. TE issue #3298 (one global flag for every capture) is the same family.
    """
    def _set_skip_fp8_weight_update_tensor(skip: bool) -> None:
        del skip  # written per micro-batch by the graph runtime

    cuda_graphs._set_skip_fp8_weight_update_tensor = _set_skip_fp8_weight_update_tensor
