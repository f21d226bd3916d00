"""Per-parameter gradients of CUDA-graph replay vs eager, on the same micro-batches.

Builds a small model of the real scripts in one process (one GPU), captures layer graphs
through the real schedule (one eager warm-up iteration, one capture iteration), then runs
the same micro-batch(es) forward + backward twice: replayed and eager (the per-micro-batch
bypass). Prints the relative gradient difference, total and for the worst parameters, for:
one micro-batch; the same one again (replay must be repeatable); two micro-batches
accumulated. Eager vs eager is printed as the noise floor.

    python tools/compare_graph_grads.py --model gpt -- --num-layers 4 --hidden-size 256 \\
        --num-attention-heads 8 --num-query-groups 4 --swiglu --seq-length 1024 --vocab-size 1024

Training flags after ``--`` describe the model; graph flags are added by the tool.
"""

import argparse
import os
import sys
from contextlib import nullcontext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def relative_differences(grads, reference):
    """``(total, [(rel, name, |ref|, |grad|), ...] worst first)`` of two name -> tensor maps."""
    import torch

    rows = []
    num, den = 0.0, 0.0
    for name, ref in reference.items():
        diff = torch.linalg.vector_norm((grads[name] - ref).float()).item()
        norm = torch.linalg.vector_norm(ref.float()).item()
        num, den = num + diff ** 2, den + norm ** 2
        rows.append((diff / (norm + 1e-12), name, norm,
                     torch.linalg.vector_norm(grads[name].float()).item()))
    return (num ** 0.5) / (den ** 0.5 + 1e-12), sorted(rows, reverse=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, model_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt", "hybrid"], default="gpt")
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=2,
                        help="micro-batches per iteration during capture")
    parser.add_argument("--top", type=int, default=6, help="worst parameters to list")
    opts = parser.parse_args(own)

    import torch

    from megatron.training.initialize import require_cuda

    require_cuda("compare_graph_grads.py")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    import pretrain_gpt
    import pretrain_mamba
    from megatron.packed_graphs.core_patches import apply_core_patches
    from megatron.packed_graphs.dispatch import disable_cuda_graphs_this_step
    from megatron.training.arguments import parse_args
    from megatron.training.config import ddp_config_from_args, transformer_config_from_args
    from megatron.training.datasets.mock import MockPackedDataset
    from megatron.training.datasets.packing import collate_packed_rows
    from megatron.training.packed_step import (
        PackedForwardStep,
        masked_lm_loss,
        to_device_micro_batch,
    )

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True)
    apply_core_patches()
    args = parse_args(model_argv + [
        "--mock-data", "--sft", "--bf16", "--lr", "1e-4", "--train-iters", "4",
        "--global-batch-size", str(opts.micro_batches), "--cuda-graph-impl", "local",
        "--cuda-graph-max-packed-seqs", str(opts.capacity), "--cuda-graph-warmup-steps", "1"],
        model=opts.model)
    module = pretrain_gpt if opts.model == "gpt" else pretrain_mamba
    config = transformer_config_from_args(args)
    model = DistributedDataParallel(
        config, ddp_config_from_args(args),
        Float16Module(config, module.model_provider(args, config).cuda()))
    config.no_sync_func = model.no_sync
    with_seq_idx = opts.model == "hybrid"
    step = PackedForwardStep.from_args(args, with_seq_idx=with_seq_idx)
    data = MockPackedDataset(64, args.seq_length, args.vocab_size, seed=7, doc_length_median=128)
    batches = [collate_packed_rows([data[i]]) for i in range(64)]

    source = iter(batches)
    for _ in range(2):  # eager warm-up iteration, then the capture iteration
        micro_batches = [[next(source) for _ in range(opts.micro_batches)]]
        step.begin_iteration(micro_batches)
        model.zero_grad_buffer()
        get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(micro_batches[0]), model=model,
            num_microbatches=opts.micro_batches, seq_length=args.seq_length, micro_batch_size=1)
        step.end_iteration()

    def grads(sequence, graphed):
        model.zero_grad_buffer()
        for batch in sequence:
            mb = to_device_micro_batch(dict(batch), with_seq_idx=with_seq_idx,
                                       static_max_seqlen=True, capacity=opts.capacity)
            with nullcontext() if graphed else disable_cuda_graphs_this_step():
                output = model(mb.tokens, mb.position_ids, None, labels=mb.labels,
                               packed_seq_params=mb.params)
            loss, _, _ = masked_lm_loss(mb.loss_mask, output)
            loss.backward()
        return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}

    def report(title, got, reference):
        total, rows = relative_differences(got, reference)
        print(f"{title}: total relative difference {total:.3e}")
        for rel, name, ref_norm, norm in rows[:opts.top]:
            print(f"    {rel:.3e}  {name}  |eager| {ref_norm:.3e}  |got| {norm:.3e}")

    first, second = batches[20], batches[21]
    eager = grads([first], graphed=False)
    report("eager again vs eager (noise floor)", grads([first], graphed=False), eager)
    replay = grads([first], graphed=True)
    report("replay vs eager, one micro-batch", replay, eager)
    report("replay again vs replay", grads([first], graphed=True), replay)
    report("replay vs eager, two micro-batches accumulated",
           grads([first, second], graphed=True), grads([first, second], graphed=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
