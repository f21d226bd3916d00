"""Chunk-graph host logic on CPU: config, slot choice, block wiring (captures run on the GPU)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.packed_graphs.chunk_graphs import (
    ChunkGraphedTransformerBlock,
    ChunkSlots,
    chunk_granularity,
    chunk_slot_count,
    use_chunk_graph_block,
)
from megatron.packed_graphs.plan import Reason, run_eager


def test_chunk_granularity_comes_from_our_config_field(monkeypatch):
    from megatron.packed_training import extra_args
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import PackedTransformerConfig, transformer_config_from_args

    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
            "--mock-data", "--train-iters", "1", "--lr", "1e-4", "--attention-backend", "local"]
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


def test_slots_record_one_runner_each_then_replay_the_planned_slot(monkeypatch):
    pools = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    slots, manager = ChunkSlots(), _Manager(reuse=False)
    for slot, name in enumerate(("r0", "r1")):  # the capture iteration: a runner per call
        manager.cudagraph_runners.append(SimpleNamespace(name=name, fp8_enabled=True))
        slots.record(manager, slot)
    assert slots.recorded == 2 and [r.mempool for r in slots.runners] == [0, 1]  # own pools
    # The layers inside keep their FP8 state; the runner, outside TE's autocast, keeps none.
    assert not any(r.fp8_enabled or r.fp4_enabled for r in slots.runners)
    picked = []
    for slot in (0, 1, 1, 0):  # whatever slots the plans name
        assert slots.select(manager, slot) == slot
        picked.append(manager.cudagraph_runners[0].name)
    assert picked == ["r0", "r1", "r1", "r0"]
    manager.cudagraph_runners.append(SimpleNamespace(name="r3"))
    with pytest.raises(RuntimeError, match="slot 3 recorded after 2 slots"):
        slots.record(manager, 3)


def test_pipeline_size_one_keeps_a_single_reused_runner(monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    slots, manager = ChunkSlots(), _Manager(reuse=True)
    runner = SimpleNamespace()
    manager.cudagraph_runners.append(runner)
    slots.record(manager, 0)
    slots.record(manager, 0)  # upstream reused the runner for the next micro-batch
    assert slots.runners == [runner] and slots.select(manager, 0) is None


def test_slot_count_of_a_single_stage_is_one(cpu_dist):
    config = SimpleNamespace(virtual_pipeline_model_parallel_size=None,
                             microbatch_group_size_per_vp_stage=None)
    assert chunk_slot_count(config, 0) == 1


def test_gpt_decoder_becomes_the_chunk_block_and_stays_eager_otherwise(cpu_dist):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron.packed_graphs.packed_seq import build_packed_batch_params
    from megatron.packed_graphs.specs import gpt_layer_spec
    from megatron.packed_training.config import PackedTransformerConfig

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
    # With it on, a training call needs the runtime's plan; an eager plan runs the block eager.
    config.cuda_graph_impl = "local"
    try:
        with pytest.raises(RuntimeError, match="needs the graph runtime's plan"):
            model(tokens, pos, None, packed_seq_params=params)
        with run_eager(Reason.OVERFLOW):
            torch.testing.assert_close(model(tokens, pos, None, packed_seq_params=params), before)
    finally:
        config.cuda_graph_impl = "none"
    use_chunk_graph_block(model.decoder)  # idempotent
    assert type(model.decoder) is ChunkGraphedTransformerBlock
