"""The process-wide patches every training process installs before building a model.

`apply_core_patches` is the one list; the patches themselves live with the upstream part
they change (graph_engine.py, megatron_ddp.py, megatron_optimizer.py, model_layers.py,
training_loop.py). The other patches install themselves through the same gate where their
condition is known: `training_loop.route_training_loop` (the seam into Megatron-LM's loop),
`training_loop.build_hybrid_cp_groups_at_start_up` (dynamic CP, at start-up),
`model_layers.megatron_core_linears_unfused_without_apex` (the model builders) and
`megatron_ddp.ddp_keeps_fused_wgrad_flags` (TE layer graphs with fused weight gradients).
`training_loop.megatron_parser_flaws_fixed` changes one parser, not the process: no patch.
`graph_engine.graph_runtime_owns_fp8_weight_flag` is installed by the graph runtime of an FP8 run.
docs/architecture.md lists every patch with its reason and its test.
"""

from megatron.packed_upstream import graph_engine, megatron_optimizer, model_layers, training_loop

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
