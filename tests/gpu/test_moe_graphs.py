"""MoE on packed micro-batches, on the GPU (skipped without CUDA, tests/gpu/conftest.py).

* A padded row routes its documents exactly like the same documents without padding, on the
  GPU, through megatron-core's router and the full MoE layer (dropless and drop-and-pad).
* Training a GPT-MoE and a hybrid model with 'E' layers under layer graphs (drop-and-pad)
  matches eager training; the MoE aux and z losses (Megatron-LM's log line) follow eager.
"""

import pytest
import torch

from tests.gpu.launch import (
    DROP_AND_PAD,
    LAYER_GRAPHS,
    TINY_GPT_MOE,
    TINY_HYBRID_MOE,
    TRAIN,
    assert_moe_follows_eager,
    run_training,
)

STEPS = 30


def _moe_layer(capacity: dict):
    import torch.nn.functional as F

    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.packed_graphs.specs import gpt_layer_spec

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_dropout_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01, **capacity)
    torch.manual_seed(0)
    return build_module(gpt_layer_spec("torch", num_experts=8), config=config,
                        layer_number=1).cuda()


@pytest.mark.parametrize("pad_to_capacity", [None, False, True])
def test_padded_row_routes_like_unpadded(dist, pad_to_capacity):
    """The router's probabilities and map on the documents are the unpadded ones when the
    capacities are equal (64 document tokens alone at factor 0.5 and with 64 padding tokens
    at factor 0.25), and the MoE output on the documents is the same."""
    docs, pad = 64, 64
    factors = ({}, {}) if pad_to_capacity is None else tuple(
        dict(moe_expert_capacity_factor=f, moe_pad_expert_input_to_capacity=pad_to_capacity)
        for f in (0.25, 0.5))
    padded_layer, alone_layer = _moe_layer(factors[0]), _moe_layer(factors[1])
    alone_layer.load_state_dict(padded_layer.state_dict())
    hidden = torch.randn(docs + pad, 1, 64, device="cuda")
    hidden[docs:] *= 10
    mask = (torch.arange(docs + pad, device="cuda") >= docs).view(-1, 1)
    probs, routing_map = padded_layer.mlp.router(hidden, padding_mask=mask)
    doc_probs, doc_map = alone_layer.mlp.router(hidden[:docs])
    assert torch.equal(probs[:docs], doc_probs) and not probs[docs:].any()
    assert torch.equal(routing_map[:docs] & (probs[:docs] > 0), doc_map & (doc_probs > 0))
    if pad_to_capacity is False:  # routed nowhere; dropless keeps tokens x top-k slots
        assert not routing_map[docs:].any()
    out, _ = padded_layer.mlp(hidden, padding_mask=mask.view(1, -1))
    out_alone, _ = alone_layer.mlp(hidden[:docs])
    torch.testing.assert_close(out[:docs], out_alone)


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_layer_graphs_match_eager_with_drop_and_pad(tmp_path, kind):
    script, model = (("pretrain_gpt.py", TINY_GPT_MOE) if kind == "gpt"
                     else ("pretrain_mamba.py", TINY_HYBRID_MOE))
    common = model + DROP_AND_PAD + TRAIN + ["--train-iters", str(STEPS),
                                             "--global-batch-size", "2"]
    eager = run_training(script, common, tmp_path, name="eager")
    graphs = run_training(script, common + LAYER_GRAPHS, tmp_path, name="graphs")
    assert all(r["load_balancing_loss"] > 0 and r["z_loss"] > 0 for r in eager + graphs)
    assert graphs[2]["graph capture (s)"] > 0
    assert_moe_follows_eager(eager, graphs, f"{kind} MoE")


@pytest.mark.gpus(4)
def test_expert_parallel_training_runs(tmp_path):
    """EP = 4 with drop-and-pad under layer graphs: trains and logs the aux loss."""
    records = run_training("pretrain_gpt.py", TINY_GPT_MOE + DROP_AND_PAD + TRAIN + LAYER_GRAPHS + [
        "--train-iters", "10", "--expert-model-parallel-size", "4",
        "--global-batch-size", "8"], tmp_path, nproc=4, name="ep4")
    assert len(records) == 10 and all(r["load_balancing_loss"] > 0 for r in records)
