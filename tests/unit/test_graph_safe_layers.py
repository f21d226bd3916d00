"""The graph-safe layers' per-micro-batch bypass takes exactly one runner turn per call."""

import torch
import torch.nn.functional as F

from megatron.packed_graphs.layers import GraphSafeTransformerLayer
from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_graphs.plan import Reason, run_eager
from megatron.packed_graphs.specs import gpt_layer_spec


def test_bypassed_transformer_layer_takes_one_runner_turn(cpu_dist, monkeypatch):
    # Regression: upstream TransformerLayer.__call__ and GraphableMegatronModule.__call__ both
    # ask _should_call_local_cudagraph; a turn taken there was taken twice, and with PP=2 the
    # next replayed micro-batch ran another micro-batch's runner (an autograd version error).
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_dropout_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0)
    layer = build_module(gpt_layer_spec("torch"), config=config, layer_number=1)
    turns = []
    monkeypatch.setattr(GraphSafeTransformerLayer, "_skip_runner", lambda self: turns.append(1))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = build_packed_batch_params(cu, torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]), 5,
                                       with_seq_idx=False)
    hidden = torch.randn(8, 1, 32)

    with run_eager(Reason.OVERFLOW):
        layer(hidden, attention_mask=None, packed_seq_params=params)
    assert turns == [1]
    layer(hidden, attention_mask=None, packed_seq_params=params)  # not bypassed
    layer.eval()
    with run_eager(Reason.EVAL):
        layer(hidden, attention_mask=None, packed_seq_params=params)  # eval never uses graphs
    assert turns == [1]


def test_runners_of_the_micro_batch_capacity_are_tried_first():
    from types import SimpleNamespace

    from megatron.packed_graphs.layers import LocalGraphDispatch, recorded_cu_seqlens_shape

    def runner(capacity):
        params = SimpleNamespace(cu_seqlens_q=torch.zeros(capacity + 1, dtype=torch.int32))
        return SimpleNamespace(fwd_graph_input_kwarg_metas={
            "packed_seq_params": SimpleNamespace(value=params)})

    runners = [runner(64), runner(16), runner(256)]
    layer = SimpleNamespace(cudagraph_manager=SimpleNamespace(reuse_cudagraphs=True,
                                                              cudagraph_runners=list(runners)))
    micro_batch = SimpleNamespace(cu_seqlens_q=torch.zeros(17, dtype=torch.int32))
    LocalGraphDispatch._try_this_capacity_first(layer, micro_batch)
    order = layer.cudagraph_manager.cudagraph_runners
    assert [recorded_cu_seqlens_shape(r)[0] - 1 for r in order] == [16, 64, 256]
    # Pipeline parallel runners go by turn: never reordered.
    layer.cudagraph_manager.reuse_cudagraphs = False
    layer.cudagraph_manager.cudagraph_runners = list(runners)
    LocalGraphDispatch._try_this_capacity_first(layer, micro_batch)
    assert layer.cudagraph_manager.cudagraph_runners == runners
