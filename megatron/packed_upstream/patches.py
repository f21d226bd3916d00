"""The process-wide patches every training process installs before building a model.

`apply_core_patches` is the one list; the patches themselves live with the upstream part
they change (graph_engine.py, megatron_ddp.py, megatron_optimizer.py, model_layers.py,
training_loop.py). The other patches install themselves through the same gate where their
condition is known: `training_loop.route_training_loop` (the seam into Megatron-LM's loop),
`training_loop.build_hybrid_cp_groups_at_start_up` (dynamic CP, at start-up),
`model_layers.megatron_core_linears_unfused_without_apex` (the model builders) and
`megatron_ddp.ddp_keeps_fused_wgrad_flags` (TE layer graphs with fused weight gradients).
`training_loop.megatron_parser_flaws_fixed` changes one parser, not the process: no patch.
`graph_runtime_owns_fp8_weight_flag` (below) is installed by the graph runtime of an FP8 run.
docs/architecture.md lists every patch with its reason and its test.
"""

from megatron.core.transformer import cuda_graphs

from megatron.packed_upstream import graph_engine, megatron_optimizer, model_layers, training_loop
from megatron.packed_upstream.gate import patch

PROCESS_PATCHES = (
    graph_engine.keep_forward_inputs_until_backward_captured,
    graph_engine.keep_chunk_graph_buffers_private,
    graph_engine.keep_saved_tensor_observer_armed_until_capture,
    megatron_optimizer.sync_free_multi_tensor_fallbacks,
    megatron_optimizer.clip_gradients_without_host_sync,
    graph_engine.warm_up_graphs_on_recorded_layouts,
    model_layers.te_cross_entropy_capturable,
    graph_engine.check_arg_types_without_reimporting,
    graph_engine.record_capture_statistics,
    training_loop.skip_dataset_helper_build,
)


def apply_core_patches() -> dict:
    """Install every process-wide patch (once; later calls change nothing). Raises on a
    megatron-core version these were not written for.

    Returns ``{patch name: "applied" | "not needed: <why>"}`` for `PROCESS_PATCHES`
    (`gate.applied_patches` holds every patch installed in the process).
    """
    return {patch.__name__: patch() for patch in PROCESS_PATCHES}


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
