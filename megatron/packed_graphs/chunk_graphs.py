"""Chunk granularity: one forward and one backward CUDA graph per model chunk and slot.

A *chunk* is the block of one (virtual) pipeline stage: GPT's TransformerBlock, the hybrid
model's HybridStack. `ChunkGraphDispatch` is a mixin for those blocks; with
``--cuda-graph-granularity chunk`` it sends each training call of the block through the
block's own megatron-core `CudaGraphManager` (the layers stay eager inside, see layers.py),
so recording, capture, RNG registration and parameter gradients are megatron-core's.

What is ours (docs/cuda-graphs.md, "Chunk granularity"):

* **Slots.** A chunk keeps up to S micro-batches between forward and backward, S read off
  megatron-core's schedule (`slots.slot_counts`); it gets S runners. Which slot a micro-batch
  replays is in its graph plan (``plan.key.slot``, `dispatch.assign_chunk_slots`): the k-th
  graphed forward of an iteration takes slot ``k mod S``; backward runs in forward order, so
  with at most S in flight that runner is free again. Eager micro-batches take no slot. Any
  micro-batch count per iteration replays the same S runners; nothing is re-captured.
* **A memory pool per slot** (``runner.mempool``, set before the end-of-iteration capture).
  All runners of one pool must replay in capture order; one slot's forward and backward
  always alternate, different slots interleave freely. Static input and grad buffers come
  from megatron-core's shared pool and stay private to their runner
  (``keep_buffers_private``, graph_engine.keep_chunk_graph_buffers_private).
* **Capture of exactly S runners.** In the capture iteration only the first S graphed
  forwards of a chunk are recorded; the plan sends later ones eager (`Reason.SLOT_CAP`).
* **The received activation is a graph input** on later pipeline stages (upstream reads it
  from ``self.input_tensor``, an address a graph would bake in), and the schedule gets a
  fresh tensor object over the static output, so freeing its ``.data`` after the send
  (``deallocate_output_tensor``) leaves the graph's buffer alone.
"""

from typing import List, Optional

from megatron.core import parallel_state
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import MakeViewlessTensor

from megatron.packed_upstream import graph_engine, model_layers
from megatron.packed_graphs.plan import (
    Mode,
    StepGraphPlan,
    active_plan,
    graphs_bypassed,
    in_iteration_graph,
)
from megatron.packed_graphs.slots import PipelineShape, slot_counts


def chunk_granularity(config) -> bool:
    """Whether a model config asks for chunk graphs (our config field; layer by default)."""
    return (getattr(config, "cuda_graph_impl", "none") == "local"
            and getattr(config, "cuda_graph_granularity", "layer") == "chunk")


def chunk_slot_count(config, chunk: int) -> int:
    """Slots of virtual chunk ``chunk`` on this rank, from the pipeline schedule."""
    shape = PipelineShape(
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        num_model_chunks=config.virtual_pipeline_model_parallel_size or 1,
        microbatch_group_size=config.microbatch_group_size_per_vp_stage,
    )
    return slot_counts(shape)[chunk]


class ChunkGraphDispatch:
    """Mixin for a block (a GraphableMegatronModule); put it first in the bases."""

    def _chunk_plan(self) -> Optional[StepGraphPlan]:
        """The running micro-batch's plan when this call goes through the chunk's graphs."""
        if not (self.training and chunk_granularity(self.config)):
            return None
        plan = active_plan()
        if plan is None:
            raise RuntimeError(
                "a training call of a chunk-graph block needs the graph runtime's plan for its "
                "micro-batch (GraphRuntime runs each micro-batch under one)")
        # Inside a whole-iteration graph the chunk runs its plain forward.
        return plan if plan.uses_graphs and not in_iteration_graph() else None

    def __call__(self, *args, **kwargs):
        plan = self._chunk_plan()
        if plan is None:
            return super().__call__(*args, **kwargs)
        if not self.pre_process:
            # The schedule's received activation, made an argument so the graph copies it in.
            kwargs["hidden_states"] = self.input_tensor
        slots = self._chunk_slots()
        manager = graph_engine.chunk_graph_manager(self)
        if plan.mode is Mode.CAPTURE:
            output = manager(self, args, graph_engine.unshare_cached_graph_inputs(kwargs))
            slots.record(manager, plan.key.slot)
        else:
            slots.select(manager, plan.key.slot)
            output = manager(self, args, kwargs)
        output = output[0] if isinstance(output, tuple) else output
        # A new tensor object over the static output: the schedule may free its .data.
        return MakeViewlessTensor.apply(output, True)

    def forward(self, hidden_states, *args, **kwargs):
        # Also reached from megatron-core's end-of-iteration capture, outside any plan.
        graphed = (self.training and chunk_granularity(self.config) and not graphs_bypassed()
                   and not in_iteration_graph())
        if graphed and not self.pre_process:
            self.input_tensor = hidden_states  # upstream forward reads the input from here
        return super().forward(hidden_states, *args, **kwargs)

    def _chunk_slots(self) -> "ChunkSlots":
        slots = getattr(self, "chunk_slots", None)
        if slots is None:
            graph_engine.chunk_graph_manager(self)  # HybridStack is no GraphableMegatronModule
            slots = self.chunk_slots = ChunkSlots()
        return slots


class ChunkSlots:
    """The runners of one chunk, one per slot, each with its own memory pool."""

    def __init__(self):
        self.runners: List = []

    @property
    def recorded(self) -> int:
        return len(self.runners)

    def record(self, manager, slot: int) -> None:
        """After a recording call for ``slot``: the runner it created gets that slot and a pool
        (and no FP8 bookkeeping of its own: the layers inside keep theirs).

        At PP == 1 megatron-core reuses one runner (matched by arguments), created once.
        """
        runner = graph_engine.runners(manager)[-1]
        if runner in self.runners:
            return
        if slot != len(self.runners):
            raise RuntimeError(f"chunk graph slot {slot} recorded after {len(self.runners)} "
                               "slots; the capture iteration records slots in order")
        # A pool of the slot's own, buffers kept: slots replay out of capture order.
        graph_engine.keep_runner_buffers(runner, own_pool=True)
        graph_engine.drop_chunk_runner_fp8_bookkeeping(runner)
        self.runners.append(runner)

    def select(self, manager, slot: int) -> Optional[int]:
        """Before a replay: put the runner of ``slot`` first (upstream replays runners[0])."""
        if graph_engine.matches_runners_by_arguments(manager):
            return None  # PP == 1: a single runner
        graph_engine.replay_runner_first(manager, self.runners[slot], self.runners)
        return slot


class ChunkGraphedTransformerBlock(ChunkGraphDispatch, TransformerBlock):
    """GPT's TransformerBlock with chunk graphs (GPTModel builds TransformerBlock by name)."""


def use_chunk_graph_block(block: TransformerBlock) -> None:
    """Give a GPTModel's decoder the chunk-graph dispatch, in place (GPTModel builds
    ``TransformerBlock`` by name; model_layers.switch_block_class)."""
    model_layers.switch_block_class(block, ChunkGraphedTransformerBlock)
