"""The graph-safe layers' per-micro-batch bypass takes exactly one runner turn per call."""

import torch
import torch.nn.functional as F

from megatron.packed_graphs.dispatch import disable_cuda_graphs_this_step
from megatron.packed_graphs.layers import GraphSafeTransformerLayer
from megatron.packed_graphs.packed_seq import build_packed_batch_params
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

    with disable_cuda_graphs_this_step():
        layer(hidden, attention_mask=None, packed_seq_params=params)
    assert turns == [1]
    layer(hidden, attention_mask=None, packed_seq_params=params)  # not bypassed
    layer.eval()
    with disable_cuda_graphs_this_step():
        layer(hidden, attention_mask=None, packed_seq_params=params)  # eval never uses graphs
    assert turns == [1]
