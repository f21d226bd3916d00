"""Partial MoE layer graphs (``--cuda-graph-modules moe_router [moe_preprocess]``).

**Local implementation.** megatron-core 0.19.2 builds them in ``MoETransformerLayer`` (transformer_layer.py,
``create_mcore_cudagraph_manager`` / ``transition_cudagraph_scope``). The local implementation
does not tell ``moe_router`` and ``moe_preprocess`` apart: either one selects both
(``TransformerConfig.__post_init__``), and the layer owns two CudaGraphManagers instead of a
whole-layer one. One MoE layer call then runs:

1. **router graph** (``_forward_mlp_router``): pre-MLP norm, shared expert (when not
   overlapped), router, and the dispatcher's preprocess (tokens permuted into expert order).
   Its inputs are the hidden states and the padding mask; its outputs the residual, the
   permuted tokens and probabilities, the shared-expert output and the dispatcher's tensor
   state (token counts, the permutation map), which the eager part reads back.
2. **one host sync** (``_router_dtoh_event.synchronize()``): the CPU waits until the router
   graph has run, in every MoE layer of every micro-batch, dropless or not.
3. **eager** (``_forward_mlp_expert_compute``): token all-to-all, experts, combine
   all-to-all. Dropless dispatch reads the per-expert token counts back to the host here
   (the dispatcher's D2H copy and event sync); drop-and-pad reads nothing.
4. **postprocess graph** (``_forward_mlp_postprocess``): unpermute, shared-expert add,
   bias-dropout-add with the residual.

What this module adds for packed training (`PartialMoEGraphs`, a layer mixin):

* with ``attn`` as well, an **attention graph** (``_forward_attention``) in an MoE layer that
  has self-attention (GPT MoE layers): upstream's MoE layer would run its attention eager;
* every partial graph follows the running micro-batch's plan: eager for an overflowing
  micro-batch, warm-up, evaluation and the health check's eager pass, as the whole-layer
  manager does through ``_should_call_local_cudagraph`` (layers.py);
* a bypassed micro-batch takes its runner turn in every manager of the layer
  (``graph_manager_names``; with pipeline parallelism runners replay by turn);
* the router graph's buffers stay owned by its runners (`keep_router_graph_buffers`): eager
  code reads its outputs until the layer's backward.

The padding mask reaches the router graph as a graph input: `moe.PackedMoEMaskMixin` takes it
from the packed params before upstream's ``_forward_mlp`` hands it to the router graph. While
graphs are recorded, that input is a copy (`router_graph_padding_mask`), not a ``[1, T]`` view
of ``packed_seq_params.padding_mask``: megatron-core 0.19.2 keeps one buffer record for a
tensor and all its views (``_apply_cudagraph_buffer_metadata`` follows ``_base``), counts each
graph input among them as a use of one shared buffer, and at capture allocates that buffer
in the shape of the first graph input it meets. The packed params, ``[T]`` mask included (the
dataclass is walked field by field), are an input of the attention graph and of the other
layers' graphs, so one of the two shapes got the other's buffer: an attention or Mamba graph
captured first handed the router graph a ``[T]`` mask, and moe_layer.py's
``transpose(0, 1)`` failed at capture. Replays need no copy: they copy every input into the
graph's own buffer.

Without a partial module the layer keeps TransformerLayer's rule (a whole-layer manager, also
under ``attn``), so a GPT MoE layer graphs as before.

**Transformer Engine implementation.** megatron-core's TE partial graph holds the pre-MLP norm,
shared expert and router (with ``moe_preprocess`` also the preprocess; with ``attn`` the
attention first); after its replay the MoE layer resumes eager from the graph's outputs
through its ``cudagraph_tensor_store``. No event sync. Upstream replays the graph with the
hidden states only, so its router never sees a padding mask; here the graph takes the
micro-batch's packed tensors (te_graphs.py), the padding mask among them, and the capture
rebuilds the params from them: `_te_cuda_graph_capture` / `_te_cuda_graph_replay`.
"""

from megatron.core.transformer.enums import CudaGraphModule
from megatron.core.transformer.identity_op import IdentityOp

from megatron.packed_upstream import graph_engine, model_layers
from megatron.packed_model.moe import layer_padding_mask
from megatron.packed_graphs.plan import graphs_bypassed, in_iteration_graph

PARTIAL_MODULES = (CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess)

# Layer methods a partial layer's managers wrap, by manager attribute, in forward order. The
# router and postprocess managers are upstream's (MoETransformerLayer.
# transition_cudagraph_scope), the attention manager this module's.
PARTIAL_GRAPH_FUNCTIONS = {
    "cudagraph_manager_attention": "_forward_attention",
    "cudagraph_manager_router": "_forward_mlp_router",
    "cudagraph_manager_postprocess": "_forward_mlp_postprocess",
}


def partial_moe_graphs(config) -> bool:
    """Whether ``config`` (a TransformerConfig) asks for local partial MoE graphs."""
    modules = config.cuda_graph_modules or []
    return config.cuda_graph_impl == "local" and any(m in modules for m in PARTIAL_MODULES)


def te_partial_moe_graphs(config) -> bool:
    """Whether ``config`` asks for partial MoE graphs of the TE implementation (moe_router,
    with or without moe_preprocess)."""
    return (config.cuda_graph_impl == "transformer_engine"
            and CudaGraphModule.moe_router in (config.cuda_graph_modules or []))


def router_graph_padding_mask(layer, hidden_states, packed_seq_params):
    """The layer's padding mask (`moe.layer_padding_mask`, ``[1, T]``) as a tensor of its
    own, no view of ``packed_seq_params.padding_mask``: a separate input of the router graph
    while graphs are recorded (see module doc). None when the params carry no mask."""
    mask = layer_padding_mask(packed_seq_params, hidden_states.shape[0], layer.pg_collection.tp,
                              layer.config.sequence_parallel)
    return None if mask is None else mask.clone()


def keep_router_graph_buffers(manager) -> None:
    """Mark the router graph's runners ``keep_buffers_private``: their buffers stay owned.

    Eager code reads the router graph's outputs until the layer's backward: the dispatch and
    experts between the two graphs, and autograd's saved copies of the routing map and the
    permutation map. megatron-core 0.19.2 keeps a forward output owned only while another
    graph reads it or when it requires grad (``_weakref_forward_buffers``), so the integer
    maps went back to the graph pool at capture; the next layer's graphs were captured onto
    them and overwrote them at replay before this layer's backward read them (wrong expert
    gradients, and an out-of-bounds gather with dropless dispatch). The cost is the router
    graph's buffers, a few activation-sized tensors per MoE layer
    (graph_engine.keep_chunk_graph_buffers_private keeps them)."""
    for runner in graph_engine.runners(manager):
        graph_engine.keep_runner_buffers(runner)


class PartialMoEGraphs:
    """Mixin for a graph-safe ``MoETransformerLayer``: partial MoE graphs for packed training
    (see module doc). Put it before `layers.LocalGraphDispatch` in the bases."""

    # Every local graph manager the layer may own, in forward order; each takes one runner
    # turn per layer call.
    graph_manager_names = ("cudagraph_manager", *PARTIAL_GRAPH_FUNCTIONS)

    def create_mcore_cudagraph_manager(self, config):
        if not partial_moe_graphs(config):
            # A whole-layer manager, also under `attn` (MoETransformerLayer would build none
            # there, and a GPT MoE layer under `attn` is graphed whole).
            model_layers.create_whole_layer_graph_manager(self, config)
            return
        super().create_mcore_cudagraph_manager(config)  # the router and postprocess managers
        if (CudaGraphModule.attn in config.cuda_graph_modules
                and self.submodules_config.self_attention is not IdentityOp):
            from megatron.core.transformer.cuda_graphs import CudaGraphManager

            self.cudagraph_manager_attention = CudaGraphManager(
                config, self, function_name="_forward_attention")
        for manager, function in PARTIAL_GRAPH_FUNCTIONS.items():
            if hasattr(self, manager):
                self._follow_plan(manager, function)

    def _follow_plan(self, manager_name: str, function: str) -> None:
        """Route calls of ``function`` (already wrapped by its manager, which runs the plain
        function when passed ``eager=True``) eager whenever the layer must not use graphs.
        The router graph's runners keep their buffers (`keep_router_graph_buffers`)."""
        graphed = getattr(self, function)
        manager = getattr(self, manager_name)
        router = manager_name == "cudagraph_manager_router"

        def call(*args, **kwargs):
            out = graphed(*args, eager=self._partial_graphs_off(), **kwargs)
            if router and not graph_engine.local_graphs_created():
                keep_router_graph_buffers(manager)
            return out

        graph_engine.route_graphed_function(self, function, call)

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None,
                     packed_seq_params=None):
        if (padding_mask is None and self.use_partial_cudagraphs
                and not graph_engine.local_graphs_created()):
            padding_mask = router_graph_padding_mask(self, hidden_states, packed_seq_params)
        return super()._forward_mlp(hidden_states, inference_context, padding_mask=padding_mask,
                                    packed_seq_params=packed_seq_params)

    def _partial_graphs_off(self) -> bool:
        """Eager for evaluation and for micro-batches the graph runtime planned eager (as
        `layers.LocalGraphDispatch._should_call_local_cudagraph` decides for whole layers)."""
        return not self.training or graphs_bypassed() or in_iteration_graph()

    # ---------------------------------------------------------------- transformer_engine

    def _attention_in_graph(self) -> bool:
        return (CudaGraphModule.attn in self.config.cuda_graph_modules
                and not isinstance(self.self_attention, IdentityOp))

    def _te_cuda_graph_capture(self, hidden_states, **tensors):
        """TE capture: attention (with ``attn``) and upstream's router part of the MoE layer.

        Returns upstream's partial outputs: the routed tokens and probabilities, then the
        routing map (router graph) or the dispatcher's tensor state (with moe_preprocess),
        the shared-expert output if any, the residual. The padding mask is read from the
        graph-input params, so the router in the graph gets it.
        """
        if not te_partial_moe_graphs(self.config):
            return super()._te_cuda_graph_capture(hidden_states, **tensors)
        rotary_pos_emb = tensors.pop("rotary_pos_emb", None)
        params = self._graph_inputs[-1].params(tensors)  # the bank being captured
        if self._attention_in_graph():
            hidden_states, _ = self._forward_attention(
                hidden_states, rotary_pos_emb=rotary_pos_emb, packed_seq_params=params)
        # Upstream's _forward_mlp stops after the router (or preprocess) while TE captures.
        return tuple(self._forward_mlp(hidden_states, packed_seq_params=params))

    def _te_cuda_graph_replay(self, *args, **kwargs):
        """TE replay: attention eager when the graph holds none, the router graph, then the
        MoE layer resumed eager from the graph's outputs (dispatch, experts, combine) and
        the bias-dropout-add. Returns ``(hidden_states, context)``."""
        if not te_partial_moe_graphs(self.config):
            return super()._te_cuda_graph_replay(*args, **kwargs)
        kwargs = dict(kwargs)
        hidden_states = args[0] if args else kwargs.pop("hidden_states")
        context = None
        if not self._attention_in_graph() and not isinstance(self.self_attention, IdentityOp):
            hidden_states, context = self._forward_attention(hidden_states, **kwargs)
        outputs = list(self._replay_graph(hidden_states, kwargs.get("packed_seq_params"),
                                          kwargs.get("rotary_pos_emb")))
        return self._resume_moe_after_graph(outputs), context

    def _resume_moe_after_graph(self, outputs: list):
        """Run the rest of the MoE layer eager from the router graph's ``outputs`` (see
        `_te_cuda_graph_capture`), as upstream's TE replay does."""
        residual = outputs.pop()
        shared_expert_output = None
        if (self.config.moe_shared_expert_intermediate_size is not None
                and not self.config.moe_shared_expert_overlap):
            shared_expert_output = outputs.pop()
        routing_map = None
        if CudaGraphModule.moe_preprocess in self.config.cuda_graph_modules:
            (hidden_states, probs), state = outputs[:2], outputs[2:]
            model_layers.set_dispatcher_graph_state(self.mlp.token_dispatcher, state)
        else:
            hidden_states, probs, routing_map = outputs
        store = self.mlp.cudagraph_tensor_store
        store.set(hidden_states=hidden_states, probs=probs, routing_map=routing_map,
                  shared_expert_output=shared_expert_output)
        try:
            # The MoE layer skips what the graph computed (upstream's tensor store).
            mlp_output_with_bias = self.mlp(hidden_states)
        finally:
            store.clear()
        return self._forward_post_mlp(mlp_output_with_bias, residual)
