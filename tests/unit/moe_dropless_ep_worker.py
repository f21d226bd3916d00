"""One rank of tests/unit/test_moe_dropless.py's expert-parallel check: a two-process gloo
world on CPU with megatron-core's parallel state at expert parallel size 2.

The rank builds a --moe-dropless-graphs MoE layer, takes the reference layer's router and its
own half of the experts from ``inputs``, runs its half of the tokens forward and backward and
saves the results to ``outputs/rank<r>.pt``. Groups are unaligned (alignment 1), as in the
test's single-process reference, so both multiply the same rows.
"""

import torch


def run(rank: int, store: str, inputs: str, outputs: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.spec_utils import build_module

    from megatron.packed_model import moe_dropless
    from megatron.packed_graphs.specs import gpt_layer_spec
    from tests.unit.test_moe_dropless import config

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                         world_size=2)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    # MoELayer builds megatron-core's alltoall dispatcher first, which makes a CUDA stream.
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    moe_dropless.group_alignment = lambda dtype: 1
    data = torch.load(inputs)
    cfg = config(moe_dropless_graphs=True, expert_model_parallel_size=2,
                 num_moe_experts=data["experts"], moe_router_topk=data["topk"],
                 moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    layer = build_module(gpt_layer_spec("torch", num_experts=data["experts"]), config=cfg,
                         layer_number=1)
    local = slice(rank * data["experts"] // 2, (rank + 1) * data["experts"] // 2)
    with torch.no_grad():
        layer.mlp.router.weight.copy_(data["router"])
        layer.mlp.experts.fc1_weight.copy_(data["fc1"][local])
        layer.mlp.experts.fc2_weight.copy_(data["fc2"][local])
    tokens = slice(rank * data["tokens"], (rank + 1) * data["tokens"])
    x = data["hidden"][tokens].clone().requires_grad_()
    out, _ = layer.mlp(x, padding_mask=data["mask"][:, tokens])
    out.backward(data["grad"][tokens])
    torch.save({"out": out.detach(), "dx": x.grad, "router": layer.mlp.router.weight.grad,
                "fc1": layer.mlp.experts.fc1_weight.grad,
                "fc2": layer.mlp.experts.fc2_weight.grad,
                "allreduce": layer.mlp.experts.fc1_weight.allreduce,
                "checkpoint": (lambda t: (t.global_shape, t.global_offset))(
                    layer.mlp.experts.sharded_state_dict()["fc1_weight"])},
               f"{outputs}/rank{rank}.pt")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
