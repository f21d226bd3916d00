"""Graph-safe layer subclasses: honour the per-micro-batch eager fallback at the one dispatch site.

`LocalGraphDispatch` (below) serves ``--cuda-graph-impl local``; `te_graphs.TEGraphDispatch`
serves ``transformer_engine``. Only the configured implementation's hooks ever fire.

megatron-core's ``GraphableMegatronModule.__call__`` asks ``_should_call_local_cudagraph``
whether to go through the layer's CudaGraphManager. These subclasses answer "no" when the
running micro-batch's plan is eager (`plan.graphs_bypassed`, set by the graph runtime) and
in evaluation, where graphs are not used (a forward-only replay would also advance the
runner rotation of pipeline-parallel runs out of step with the captured order). Without a
plan (a model called outside the runtime) megatron-core decides alone.

With pipeline parallelism the manager replays its runners round-robin, one per call, in the
order they were captured. A bypassed micro-batch still takes its turn (`_skip_runner`), so
every later micro-batch replays exactly the runner captured for its slot and the shared
memory pool sees the captured order with gaps, never a reordering. A layer under partial MoE
graphs owns several managers (moe_partial.py); each takes its turn.
"""

from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from megatron.packed_upstream import graph_engine
from megatron.packed_graphs.chunk_graphs import ChunkGraphDispatch, chunk_granularity
from megatron.packed_model.hybrid_stack import PackedHybridStack
from megatron.packed_model.moe import PackedMoEMaskMixin
from megatron.packed_model.padding_rows import (ZeroedPaddingRowsLayer,
                                                  ZeroedPaddingRowsMambaLayer)
from megatron.packed_graphs.moe_partial import PartialMoEGraphs
from megatron.packed_graphs.plan import graphs_bypassed, in_iteration_graph
from megatron.packed_graphs.te_graphs import TEGraphDispatch


class LocalGraphDispatch:
    """Mixin for a GraphableMegatronModule layer; put it first in the bases."""

    def __call__(self, *args, **kwargs):
        # The runner turn is taken here, once per call: upstream asks
        # _should_call_local_cudagraph twice per TransformerLayer call (its own __call__ and
        # GraphableMegatronModule's), so a side effect there would skip two turns.
        if self.training and graphs_bypassed():
            self._skip_runner()
        elif self.training and in_iteration_graph():
            pass  # inside a whole-iteration graph: no layer graph, no runner turn (PP = 1)
        elif self.training and self.config.cuda_graph_impl == "local":
            self._try_this_capacity_first(kwargs.get("packed_seq_params"))
            kwargs = graph_engine.unshare_cached_graph_inputs(kwargs)
        return super().__call__(*args, **kwargs)

    def _should_call_local_cudagraph(self, *args, **kwargs):
        if (not self.training or graphs_bypassed() or in_iteration_graph()
                or chunk_granularity(self.config)):
            # eval, an eager micro-batch, or the whole chunk or iteration is one graph
            return False
        return super()._should_call_local_cudagraph(*args, **kwargs)

    def _try_this_capacity_first(self, params) -> None:
        """PP == 1 with a capacity ladder: put the runners of this micro-batch's capacity first.

        Upstream takes the first runner whose arguments match, checking each in turn (a
        Python walk over every argument); sorted, the first check hits.
        """
        if params is None or params.cu_seqlens_q is None:
            return
        shape = params.cu_seqlens_q.shape
        for manager in graph_engine.graph_managers(self):
            recorded = graph_engine.runners(manager)
            if not graph_engine.matches_runners_by_arguments(manager) or len(recorded) < 2:
                continue
            if recorded_cu_seqlens_shape(recorded[0]) != shape:
                graph_engine.sort_runners(
                    manager, key=lambda r: recorded_cu_seqlens_shape(r) != shape)

    def _skip_runner(self) -> None:
        for manager in graph_engine.graph_managers(self):
            if graph_engine.matches_runners_by_arguments(manager):
                continue  # PP == 1: runners are matched by arguments, not by turn
            if graph_engine.local_graphs_created() and graph_engine.runners(manager):
                graph_engine.rotate_runners(manager)


def recorded_cu_seqlens_shape(runner):
    """Shape of the ``cu_seqlens`` a runner was recorded with (its capacity + 1)."""
    params = graph_engine.recorded_kwarg(runner, "packed_seq_params")
    return None if params is None or params.cu_seqlens_q is None else params.cu_seqlens_q.shape


class GraphSafeTransformerLayer(LocalGraphDispatch, TEGraphDispatch, PackedMoEMaskMixin,
                                ZeroedPaddingRowsLayer, TransformerLayer):
    """TransformerLayer with the per-micro-batch eager fallback (local and TE graphs); an MoE
    MLP gets the micro-batch's padding mask (moe.py); under FP8 its input's padding rows are
    zero (padding_rows.py)."""


class GraphSafeMoELayer(PartialMoEGraphs, LocalGraphDispatch, TEGraphDispatch,
                        PackedMoEMaskMixin, ZeroedPaddingRowsLayer, MoETransformerLayer):
    """MoE layer (megatron-core's MoETransformerLayer): a GPT layer with --num-experts
    (attention + MoE) or a hybrid 'E' layer (pre-MLP norm + MoE), with the per-micro-batch
    eager fallback, the micro-batch's padding mask and partial MoE graphs (moe_partial.py)."""


class GraphSafeMLPLayer(LocalGraphDispatch, TEGraphDispatch, ZeroedPaddingRowsLayer, MLPLayer):
    """Hybrid MLP-only layer with the per-micro-batch eager fallback (local and TE graphs)."""


class GraphSafeMambaLayer(LocalGraphDispatch, TEGraphDispatch, ZeroedPaddingRowsMambaLayer,
                          MambaLayer):
    """MambaLayer with the per-micro-batch eager fallback (local and TE graphs)."""


class GraphSafeHybridStack(ChunkGraphDispatch, PackedHybridStack):
    """The hybrid model's stack (spec-provided final norm) as one chunk for chunk graphs."""
