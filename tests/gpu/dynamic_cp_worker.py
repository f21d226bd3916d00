"""Worker of tests/gpu/test_dynamic_cp_graphs.py, run under torchrun on 2 GPUs (static CP = 1, DP = 2).

One packed micro-batch, three ways, same weights on both ranks:

* ``reference``: each rank runs the whole micro-batch without CP;
* ``dynamic CP 2``: the two ranks split it with the THD CP layout and run TE's CP attention
  over the group training gives a size-2 micro-batch (``dynamic_cp_group(2)``: here the
  data-parallel group; RoPE at each rank's own positions), passed per micro-batch
  (``packed_seq_params.cp_group``, ``local_cp_size = 2``); loss sums, token counts and
  gradients are summed over the two ranks;
* ``dynamic CP 1``: the whole micro-batch again with ``local_cp_size = 1`` (no group): the
  layers must have switched back.

Parsed with ``--dynamic-cp-sizes 1 2``, so the start-up builds megatron-core's parallel state
with its hybrid DP x CP groups, as training's does.

Rank 0 writes ``{case: {"loss", "tokens", "grad_rel_diff"}}`` (relative to the reference) as
JSON to the path given as the first argument.
"""

import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import pretrain_gpt  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.packed_model.dynamic_cp import dynamic_cp_group  # noqa: E402
from megatron.packed_training.arguments import parse_args  # noqa: E402
from megatron.packed_training.config import transformer_config_from_args  # noqa: E402
from megatron.packed_training.datasets.mock import MockPackedDataset  # noqa: E402
from megatron.packed_training.datasets.packing import collate_packed_rows  # noqa: E402
from megatron.packed_training.initialize import initialize_distributed, set_seeds  # noqa: E402
from megatron.packed_training.packed_step import masked_lm_loss, to_device_micro_batch  # noqa: E402
from tests.gpu.launch import FORK_NUMERICS, TINY_GPT  # noqa: E402


def run(model, micro_batch):
    """Loss sum, token count and fp32 gradients of one forward + backward."""
    for param in model.parameters():
        param.grad = None
    output = model(micro_batch.tokens, micro_batch.position_ids, None, labels=micro_batch.labels,
                   packed_seq_params=micro_batch.params)
    loss, tokens, _ = masked_lm_loss(micro_batch.loss_mask, output)
    loss.backward()
    grads = {name: param.grad.float().clone() for name, param in model.named_parameters()}
    return loss.detach().float(), tokens.float(), grads


def main(out_path: str) -> None:
    args = parse_args(TINY_GPT + FORK_NUMERICS + [
        "--sft", "--mock-data", "--bf16", "--lr", "1e-4", "--train-iters", "1",
        "--micro-batch-size", "1",
        "--global-batch-size", "2", "--eval-iters", "0", "--attention-backend", "auto",
        "--te-rng-tracker", "--dynamic-cp-sizes", "1", "2",
        # No DDP here: gradients land in param.grad, not in DDP's main_grad buffers.
        "--no-gradient-accumulation-fusion"], model="gpt")
    assert args.dynamic_cp_groups
    initialize_distributed(args)
    set_seeds(args.seed, te_rng_tracker=True)
    config = transformer_config_from_args(args)
    model = Float16Module(config, pretrain_gpt.model_provider(args, config).cuda())
    for param in model.parameters():  # the same weights on both ranks
        torch.distributed.broadcast(param.data, src=0)
    group = dynamic_cp_group(2)
    assert group is parallel_state.get_data_parallel_group(with_context_parallel=True)
    cp = group.size()
    data = MockPackedDataset(4, args.seq_length, args.vocab_size, seed=7, doc_length_median=300,
                             segment_multiple=2 * cp)
    batch = collate_packed_rows([data[1]])
    move = dict(with_seq_idx=False, static_max_seqlen=True)

    ref_loss, ref_tokens, ref_grads = run(model, to_device_micro_batch(batch, **move))

    split = to_device_micro_batch(batch, cp_size=cp, cp_rank=group.rank(), **move)
    split.params.cp_group, split.params.local_cp_size = group, cp
    loss, tokens, grads = run(model, split)
    for value in (loss, tokens, *grads.values()):
        torch.distributed.all_reduce(value, group=group)

    whole = to_device_micro_batch(batch, **move)
    whole.params.local_cp_size = 1
    loss1, tokens1, grads1 = run(model, whole)

    def rel(got):
        num = sum(torch.linalg.vector_norm(got[k] - ref_grads[k]) ** 2 for k in ref_grads)
        den = sum(torch.linalg.vector_norm(ref_grads[k]) ** 2 for k in ref_grads)
        return float((num / den) ** 0.5)

    result = {
        "reference": {"loss": float(ref_loss), "tokens": float(ref_tokens), "grad_rel_diff": 0.0},
        "dynamic CP 2": {"loss": float(loss), "tokens": float(tokens), "grad_rel_diff": rel(grads)},
        "dynamic CP 1": {"loss": float(loss1), "tokens": float(tokens1),
                         "grad_rel_diff": rel(grads1)},
        "documents": int(batch["num_documents"]),
    }
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
