"""Per-parameter gradients of CUDA-graph replay vs eager, on the same micro-batches.

Builds a small model of the real scripts in one process (one GPU), captures graphs through
the real schedule and forward step (one eager warm-up iteration, one capture iteration) for
one implementation and granularity (local layer, local chunk, or TE layer graphs), then runs
the same micro-batch(es) forward + backward twice: replayed and eager (the per-micro-batch
bypass). Prints the relative gradient difference, total and for the worst parameters, for:
one micro-batch; the same one again (replay must be repeatable); two micro-batches
accumulated; an eager then a replayed micro-batch. Eager vs eager is the noise floor. First it
lists any backward-graph buffer that is memory a forward graph kept as its input (the
aliasing behind the first bug this tool found; the fix:
graph_engine.keep_forward_inputs_until_backward_captured).

    python tools/compare_graph_grads.py --model gpt --impl local --granularity chunk -- \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention \\
        --num-query-groups 4 --swiglu --seq-length 1024 --vocab-size 1024

Training flags after ``--`` describe the model, in Megatron-LM's command line; data, batch
and graph flags are added by the tool. Where Megatron-LM's defaults are not the old fork's,
the fork's go first (`model_defaults`: RMSNorm, no linear biases, no dropout, which would
make the compared passes draw different masks; RoPE for GPT, none for the hybrid; positions
up to --seq-length), so the flags after ``--`` override them.
"""

import argparse
import os
import sys

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


def model_defaults(kind: str, model_argv: list) -> list:
    """The old fork's defaults, as Megatron-LM's flags, for a model of ``kind`` described by
    ``model_argv``: put before it, so its own flags win (tools/benchmark.py's FORK_NUMERICS,
    the position embedding by kind, --max-position-embeddings = --seq-length)."""
    from tools.benchmark import FORK_NUMERICS, flag_value

    defaults = [*FORK_NUMERICS, "--position-embedding-type", "rope" if kind == "gpt" else "none"]
    seq_length = flag_value(model_argv, "--seq-length")
    if seq_length is not None:
        defaults += ["--max-position-embeddings", seq_length]
    return defaults


def ddp_config(args):
    """megatron-core's DistributedDataParallelConfig of validated ``args``, as Megatron-LM's
    training builds it (fp32 gradient reduction with bf16, DDP's NaN check as the flags say)."""
    from megatron.training.training import get_megatron_ddp_config

    return get_megatron_ddp_config(args)


def captured_runners(model) -> list:
    """The layer graph runners of a model, in module order (a partial MoE layer's in forward
    order: attention, router, postprocess)."""
    from megatron.packed_upstream.graph_engine import graph_managers, runners

    return [runner for module in model.modules() for manager in graph_managers(module)
            for runner in runners(manager)]


def compare_replay_with_eager(kind: str, model_argv: list, *, capacity: int = 32,
                              micro_batches: int = 2, impl: str = "local",
                              granularity: str = "layer"):
    """Capture graphs through the real schedule, then compare replayed and eager grads.

    ``impl``: 'local' (megatron-core's engine; ``granularity`` 'layer' or 'chunk') or
    'transformer_engine' (TE's make_graphed_callables, layer granularity).

    Needs an initialised one-GPU process group with megatron-core's parallel state and a
    graph-safe RNG tracker. Returns ``(aliasing, results)``: the buffer clashes of
    `forward_inputs_reused_as_grad_buffers` and an ordered ``{case: (total, rows)}`` of
    `relative_differences` (replay vs eager; eager vs eager is the noise floor). Leaves the
    captured graphs alive; callers that capture again call ``delete_cuda_graphs()``.
    """
    import torch

    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    import pretrain_gpt
    import pretrain_mamba
    from megatron.packed_upstream.graph_engine import (
        forward_inputs_reused_as_grad_buffers,
        use_side_stream,
    )
    from megatron.packed_upstream.patches import apply_core_patches
    from megatron.packed_graphs.plan import Reason, StepGraphPlan
    from megatron.packed_graphs.runtime import GraphRuntime
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import (
        graph_settings_from_args,
        transformer_config_from_args,
    )
    from megatron.packed_training.datasets.mock import MockPackedDataset
    from megatron.packed_training.datasets.packing import collate_packed_rows
    from megatron.packed_training.packed_step import PackedForwardStep

    apply_core_patches()
    args = parse_args(model_defaults(kind, model_argv) + model_argv + [
        "--mock-data", "--sft", "--bf16", "--lr", "1e-4", "--train-iters", "4",
        "--micro-batch-size", "1", "--global-batch-size", str(micro_batches), "--eval-iters", "0",
        "--cuda-graph-impl", impl, "--cuda-graph-granularity", granularity,
        "--cuda-graph-max-packed-seqs", str(capacity), "--cuda-graph-warmup-steps", "1"],
        model=kind)
    module = pretrain_gpt if kind == "gpt" else pretrain_mamba
    config = transformer_config_from_args(args)
    built = Float16Module(config, module.model_provider(args, config).cuda())
    use_side_stream()  # after the build, before DDP, as training's model provider does
    model = DistributedDataParallel(config, ddp_config(args), built)
    config.no_sync_func = model.no_sync
    with_seq_idx = kind == "hybrid"
    step = PackedForwardStep.from_args(args, with_seq_idx=with_seq_idx)
    runtime = GraphRuntime.from_settings(graph_settings_from_args(args), [model], config)
    data = MockPackedDataset(64, args.seq_length, args.vocab_size, seed=7, doc_length_median=128)
    batches = [collate_packed_rows([data[i]]) for i in range(64)]

    def schedule(forward_step, planned):
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(planned[0]), model=model,
            num_microbatches=len(planned[0]), seq_length=args.seq_length, micro_batch_size=1)

    source = iter(batches)
    for _ in range(2):  # eager warm-up iteration, then the capture iteration
        model.zero_grad_buffer()
        with runtime.iteration([[next(source) for _ in range(micro_batches)]], step) as it:
            it.run(schedule)

    def grads(sequence, graphed):
        model.zero_grad_buffer()
        if isinstance(graphed, bool):
            graphed = [graphed] * len(sequence)
        for batch, replay in zip(sequence, graphed):
            # The runtime's plan for a lone micro-batch (it replays: the batches fit), or eager.
            plan = (runtime.plan([[batch]])[0][0] if replay
                    else StepGraphPlan.eager(Reason.FORCED))
            if replay and not plan.uses_graphs:
                raise ValueError(f"a compared micro-batch does not fit the capacity: {plan}")
            output, loss_func = runtime.run_micro_batch(step, model, dict(batch), plan)
            loss, _, _ = loss_func(output)
            loss.backward()
        return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}

    first, second = batches[20], batches[21]
    eager_one, eager_two = grads([first], False), grads([first, second], False)
    replay_one = grads([first], True)
    results = {
        "eager again vs eager (noise floor)": relative_differences(grads([first], False), eager_one),
        "replay vs eager, one micro-batch": relative_differences(replay_one, eager_one),
        "replay again vs replay": relative_differences(grads([first], True), replay_one),
        "replay vs eager, two micro-batches accumulated":
            relative_differences(grads([first, second], True), eager_two),
        "eager then replay vs eager, two micro-batches":
            relative_differences(grads([first, second], [False, True]), eager_two),
    }
    torch.cuda.synchronize()
    return forward_inputs_reused_as_grad_buffers(captured_runners(model)), results


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, model_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "hybrid"], default="gpt")
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=2,
                        help="micro-batches per iteration during capture")
    parser.add_argument("--top", type=int, default=6, help="worst parameters to list")
    parser.add_argument("--impl", choices=["local", "transformer_engine"], default="local")
    parser.add_argument("--granularity", choices=["layer", "chunk"], default="layer")
    opts = parser.parse_args(own)

    from megatron.packed_training.initialize import initialize_single_gpu, require_cuda

    require_cuda("compare_graph_grads.py")
    initialize_single_gpu(port=29561)

    aliasing, results = compare_replay_with_eager(
        opts.model, model_argv, capacity=opts.capacity, micro_batches=opts.micro_batches,
        impl=opts.impl, granularity=opts.granularity)
    print(f"forward-input buffers also used as grad buffers: {len(aliasing)}")
    for line in aliasing[:20]:
        print("    " + line)
    for title, (total, rows) in results.items():
        print(f"{title}: total relative difference {total:.3e}")
        for rel, name, ref_norm, norm in rows[:opts.top]:
            print(f"    {rel:.3e}  {name}  |eager| {ref_norm:.3e}  |got| {norm:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
