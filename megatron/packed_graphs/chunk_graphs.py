"""Chunk granularity: one forward and one backward CUDA graph per model chunk and slot.

A *chunk* is the block of one (virtual) pipeline stage: GPT's TransformerBlock, the hybrid
model's HybridStack. `ChunkGraphDispatch` is a mixin for those blocks; with
``--cuda-graph-granularity chunk`` it sends each training call of the block through the
block's own megatron-core `CudaGraphManager` (the layers stay eager inside, see layers.py),
so recording, capture, RNG registration and parameter gradients are megatron-core's.

What is ours (docs/cuda-graphs.md, "Chunk granularity"):

* **Slots.** A chunk keeps up to S micro-batches between forward and backward, S read off
  megatron-core's schedule (`slots.slot_counts`); it gets S runners. The k-th graphed
  forward of a chunk replays runner ``k mod S``: backward runs in forward order, so with at
  most S in flight that runner is free again. Eager micro-batches take no slot. Any
  micro-batch count per iteration replays the same S runners; nothing is re-captured.
* **A memory pool per slot** (``runner.mempool``, set before the end-of-iteration capture).
  All runners of one pool must replay in capture order; one slot's forward and backward
  always alternate, different slots interleave freely. Static input and grad buffers come
  from megatron-core's shared pool and stay private to their runner
  (``keep_buffers_private``, core_patches.keep_chunk_graph_buffers_private).
* **Capture of exactly S runners.** In the capture iteration only the first S forwards of a
  chunk are recorded; later ones run eager.
* **The received activation is a graph input** on later pipeline stages (upstream reads it
  from ``self.input_tensor``, an address a graph would bake in), and the schedule gets a
  fresh tensor object over the static output, so freeing its ``.data`` after the send
  (``deallocate_output_tensor``) leaves the graph's buffer alone.
"""

from typing import List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.cuda_graphs import CudaGraphManager
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import MakeViewlessTensor

from megatron.packed_graphs import core_patches
from megatron.packed_graphs.dispatch import cuda_graphs_bypassed
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

    def _chunk_graphed_call(self) -> bool:
        """Training, chunk granularity, and this micro-batch not planned eager."""
        return self.training and chunk_granularity(self.config) and not cuda_graphs_bypassed()

    def __call__(self, *args, **kwargs):
        if not self._chunk_graphed_call():
            return super().__call__(*args, **kwargs)
        if not self.pre_process:
            # The schedule's received activation, made an argument so the graph copies it in.
            kwargs["hidden_states"] = self.input_tensor
        slots = self._chunk_slots()
        manager = self.cudagraph_manager
        if not core_patches.local_graphs_created():
            if slots.recorded == slots.count:
                return super().__call__(*args, **kwargs)  # the capture needs S runners only
            output = manager(self, args, core_patches.unshare_cached_graph_inputs(kwargs))
            slots.record(manager)
        else:
            slots.select(manager)
            output = manager(self, args, kwargs)
        output = output[0] if isinstance(output, tuple) else output
        # A new tensor object over the static output: the schedule may free its .data.
        return MakeViewlessTensor.apply(output, True)

    def forward(self, hidden_states, *args, **kwargs):
        if self._chunk_graphed_call() and not self.pre_process:
            self.input_tensor = hidden_states  # upstream forward reads the input from here
        return super().forward(hidden_states, *args, **kwargs)

    def _chunk_slots(self) -> "ChunkSlots":
        slots = getattr(self, "chunk_slots", None)
        if slots is None:
            if not hasattr(self, "cudagraph_manager"):  # HybridStack is no GraphableMegatronModule
                self.cudagraph_manager = CudaGraphManager(self.config)
            chunk = getattr(self, "vp_stage", None) or 0
            slots = self.chunk_slots = ChunkSlots(chunk_slot_count(self.config, chunk))
        return slots


class ChunkSlots:
    """The S runners of one chunk, their memory pools, and which one replays next."""

    def __init__(self, count: int):
        self.count = count
        self.runners: List = []
        self.graphed_forwards = 0

    @property
    def recorded(self) -> int:
        return len(self.runners)

    def record(self, manager) -> None:
        """After a recording call: the runner it created gets the next slot and its pool.

        At PP == 1 megatron-core reuses one runner (matched by arguments), created once.
        """
        runner = manager.cudagraph_runners[-1]
        if runner not in self.runners:
            runner.mempool = torch.cuda.graph_pool_handle()  # this slot's own pool
            runner.keep_buffers_private = True  # slots replay out of capture order
            self.runners.append(runner)
        self.graphed_forwards += 1

    def select(self, manager) -> Optional[int]:
        """Before a replay: put the runner of this forward's slot first (upstream takes [0])."""
        if manager.reuse_cudagraphs:
            return None  # PP == 1: a single runner
        slot = self.graphed_forwards % self.count
        runner = self.runners[slot]
        core_patches.replay_runner_first(manager, runner, self.runners)
        self.graphed_forwards += 1
        return slot


class ChunkGraphedTransformerBlock(ChunkGraphDispatch, TransformerBlock):
    """GPT's TransformerBlock with chunk graphs (GPTModel builds TransformerBlock by name)."""


def use_chunk_graph_block(block: TransformerBlock) -> None:
    """Give a GPTModel's decoder the chunk-graph dispatch, in place (GPTModel builds
    ``TransformerBlock`` by name; core_patches.switch_block_class)."""
    core_patches.switch_block_class(block, ChunkGraphedTransformerBlock)
