"""Reaches into megatron-core's ``DistributedDataParallel`` for graphs, for megatron-core
0.19.2 (`gate.PATCHED_VERSION`).

* `ddp_on_the_process_stream`: DDP built on the process's side stream, so backward and
  gradient accumulation share one stream (installed by `training_loop.route_training_loop`).
* `ddp_keeps_fused_wgrad_flags`: TE's fused weight-gradient flags survive DDP's buffer reset
  under TE graphs.
* `ddp_gather_hooks_removed`, `ddp_param_gather_before_te_replays`: with
  ``--overlap-param-gather``, DDP's parameter-gather pre-hooks come off for the TE capture
  (TE refuses modules with hooks) and run before each TE graph replay instead.
"""

import contextlib
import functools
from typing import Callable
import torch
from megatron.core.distributed import DistributedDataParallel

from megatron.packed_upstream import graph_engine

from megatron.packed_upstream.gate import patch


UPSTREAM_ZERO_GRAD_BUFFER = DistributedDataParallel.zero_grad_buffer


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
        stream = graph_engine.process_stream()
        if stream is None:  # no CUDA, or a model provider that did not switch
            return upstream(*args, **kwargs)
        with torch.cuda.stream(stream):
            return upstream(*args, **kwargs)

    return wrap_model_chunks_with_ddp


@patch
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

