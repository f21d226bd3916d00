"""Chunk-graph host logic on CPU: config, slot choice, block wiring (captures run on the GPU)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.packed_graphs import chunk_graphs
from megatron.packed_graphs.chunk_graphs import (
    ChunkGraphedTransformerBlock,
    ChunkSlots,
    chunk_granularity,
    chunk_slot_count,
    use_chunk_graph_block,
)


def test_chunk_granularity_comes_from_our_config_field():
    from megatron.training.arguments import parse_args
    from megatron.training.config import PackedTransformerConfig, transformer_config_from_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--mock-data", "--train-iters", "1", "--lr", "1e-4"]
    graphs = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "8"]
    chunk = transformer_config_from_args(parse_args(base + graphs + [
        "--cuda-graph-granularity", "chunk"], model="gpt"))
    assert isinstance(chunk, PackedTransformerConfig) and chunk_granularity(chunk)
    assert not chunk_granularity(transformer_config_from_args(parse_args(base + graphs, model="gpt")))
    assert not chunk_granularity(SimpleNamespace(cuda_graph_impl="local"))  # upstream config


class _Manager:
    """The two attributes of megatron-core's CudaGraphManager that slot choice touches."""

    def __init__(self, reuse):
        self.reuse_cudagraphs, self.cudagraph_runners = reuse, []


def test_slots_record_one_runner_each_then_replay_round_robin(monkeypatch):
    pools = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    slots, manager = ChunkSlots(count=2), _Manager(reuse=False)
    for name in ("r0", "r1"):  # the capture iteration: upstream appends a runner per call
        manager.cudagraph_runners.append(SimpleNamespace(name=name))
        slots.record(manager)
    assert slots.recorded == 2 and [r.mempool for r in slots.runners] == [0, 1]  # own pools
    picked = []
    for _ in range(5):  # any number of graphed forwards afterwards
        slot = slots.select(manager)
        picked.append((slot, manager.cudagraph_runners[0].name))
    assert picked == [(0, "r0"), (1, "r1"), (0, "r0"), (1, "r1"), (0, "r0")]


def test_pipeline_size_one_keeps_a_single_reused_runner(monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    slots, manager = ChunkSlots(count=1), _Manager(reuse=True)
    runner = SimpleNamespace()
    manager.cudagraph_runners.append(runner)
    slots.record(manager)
    slots.record(manager)  # upstream reused the runner for the next micro-batch
    assert slots.runners == [runner] and slots.select(manager) is None


def test_slot_count_of_a_single_stage_is_one(cpu_dist):
    config = SimpleNamespace(virtual_pipeline_model_parallel_size=None,
                             microbatch_group_size_per_vp_stage=None)
    assert chunk_slot_count(config, 0) == 1


def test_gpt_decoder_becomes_the_chunk_block_and_stays_eager_otherwise(cpu_dist):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron.packed_graphs.packed_seq import build_packed_batch_params
    from megatron.packed_graphs.specs import gpt_layer_spec
    from megatron.training.config import PackedTransformerConfig

    torch.manual_seed(0)
    config = PackedTransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_dropout_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, cuda_graph_granularity="chunk")
    model = GPTModel(config, gpt_layer_spec("torch"), vocab_size=64, max_sequence_length=16,
                     position_embedding_type="none")
    tokens = torch.randint(1, 64, (1, 8))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    params = build_packed_batch_params(torch.tensor([0, 3, 8], dtype=torch.int32), pos, 5,
                                       with_seq_idx=False)
    before = model(tokens, pos, None, packed_seq_params=params)
    use_chunk_graph_block(model.decoder)
    assert type(model.decoder) is ChunkGraphedTransformerBlock
    # cuda_graph_impl is 'none' in this config: the chunk path is off and the block is as before.
    torch.testing.assert_close(model(tokens, pos, None, packed_seq_params=params), before)
    use_chunk_graph_block(model.decoder)  # idempotent
    assert type(model.decoder) is ChunkGraphedTransformerBlock
