"""What sleep and wake cost at a model's layer shapes: `PackedPolicy.offload` / `onload`.

    python tools/offload_benchmark.py                 # Llama-3-8B layers, 4 of them
    python tools/offload_benchmark.py --layers 2 --ffn-hidden-size 12288 --graphs full

Builds an offloadable GPT policy (`PolicyConfig(offloadable=True)`) at 8B layer shapes with
the layers cut (hidden 4096, FFN ``--ffn-hidden-size``, 32 query heads in 8 groups, vocab
128256, untied output layer, bf16, Adam), one process on one GPU. Started without
torch_memory_saver's preload library, it starts itself again with it. Trains
``--warmup-steps`` + 1 steps (the last captures the training graphs) after a log-prob call
(which captures the forward-only graphs), then ``--cycles`` offload / onload cycles, then a
log-prob call and one more step, which must replay (nothing captured again); the log-probs
must equal those taken just before the cycles, bitwise. Prints two Markdown tables: per cycle, what
PyTorch's allocator held, the MiB released and taken back and the seconds each way; and what
releasing the graphs and capturing them again would cost instead (the capture times the
runtime reports, and the capturing step's time over a replaying one's).
"""

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (8B: 32)")
    parser.add_argument("--ffn-hidden-size", type=int, default=14336,
                        help="Llama-3-8B: 14336; 12288 for a smaller FFN")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="micro-batches per step (the global batch size)")
    parser.add_argument("--graphs", choices=("layer", "full"), default="layer",
                        help="local layer graphs, or full-iteration graphs")
    parser.add_argument("--warmup-steps", type=int, default=1, help="eager steps before capture")
    parser.add_argument("--cycles", type=int, default=2, help="offload / onload cycles")
    options = parser.parse_args(argv)
    for name in ("layers", "micro_batches", "cycles", "seq_length"):
        if getattr(options, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is wrong: {getattr(options, name)}. "
                         f"Give at least 1.")
    return options


def training_config(options: argparse.Namespace) -> dict:
    """The policy's training config: Llama-3-8B's layer shapes, ``options``' cuts."""
    impl = {"layer": "local", "full": "full_iteration"}[options.graphs]
    return {
        "num_layers": options.layers, "hidden_size": 4096,
        "ffn_hidden_size": options.ffn_hidden_size, "num_attention_heads": 32,
        "group_query_attention": True, "num_query_groups": 8, "swiglu": True,
        "position_embedding_type": "rope", "rotary_base": 500000,
        "untie_embeddings_and_output_weights": True, "vocab_size": 128256,
        "seq_length": options.seq_length, "max_position_embeddings": options.seq_length,
        "normalization": "RMSNorm", "add_bias_linear": False, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "micro_batch_size": 1,
        "global_batch_size": options.micro_batches, "train_iters": 100, "lr": 1e-5,
        "bf16": True, "seed": 1234, "sft": True, "mock_data": True, "eval_iters": 0,
        "cuda_graph_impl": impl, "cuda_graph_max_packed_seqs": 16,
        "cuda_graph_warmup_steps": options.warmup_steps,
        # Full-iteration graphs cannot hold DDP's NaN check (it reads norms on the host).
        "check_for_nan_in_loss_and_grad": options.graphs != "full"}


def micro_batches(count: int, row_positions: int, vocab: int, seed: int) -> list:
    """``count`` micro-batches of 2 to 12 sequences filling most of a row (fit capacity
    16), on the GPU."""
    import torch

    from megatron.packed_training.rl import PackedSequences

    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        sequences = int(torch.randint(2, 13, (1,), generator=generator))
        lengths = [row_positions // sequences + 1] * sequences
        n = sum(lengths)
        out.append(PackedSequences(
            torch.randint(1, vocab, (n,), generator=generator).cuda(), lengths=lengths,
            loss_weights=torch.ones(n).cuda()))
    return out


def timed_step(policy, batch, loss_fn) -> tuple:
    import time

    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    result = policy.train_step(batch, loss_fn)
    loss = result.loss.item()  # syncs
    return time.perf_counter() - start, loss, result.stats


def measure(options: argparse.Namespace) -> dict:
    import torch

    from megatron.packed_training.rl import PackedPolicy, PolicyConfig
    from megatron.packed_training.rl.losses import negative_log_likelihood

    policy = PackedPolicy.build(PolicyConfig(training_config(options), offloadable=True))
    vocab, rows = policy.vocab_size, policy.row_positions
    probe = micro_batches(2, rows, vocab, seed=0)
    policy.logprobs(probe)  # captures the forward-only graphs
    forward_stats = dict(policy.last_stats)
    steps = []
    for step in range(options.warmup_steps + 2):  # warm-up, capture, one replay
        steps.append(timed_step(policy, micro_batches(options.micro_batches, rows, vocab,
                                                      seed=1 + step),
                                negative_log_likelihood))
    before = policy.logprobs(probe)  # the weights the cycles must keep
    cycles = []
    for _ in range(options.cycles):
        gone = policy.offload()
        free_offloaded, _ = torch.cuda.mem_get_info()
        back = policy.onload()
        cycles.append((gone, back, free_offloaded / 2**20))
    after = policy.logprobs(probe)
    replayed_lp = "forward graphs captured" not in policy.last_stats
    last = timed_step(policy, micro_batches(options.micro_batches, rows, vocab, seed=99),
                      negative_log_likelihood)
    capture_stats = steps[options.warmup_steps][2]
    return {
        "cycles": cycles, "steps": steps, "last": last,
        "bitwise": all(torch.equal(a, b) for a, b in zip(before, after)),
        "replayed": replayed_lp and not any(k in last[2] for k in (
            "graphs captured", "iteration graph capture (s)")),
        "capture_s": capture_stats.get("graph capture (s)",
                                       capture_stats.get("iteration graph capture (s)")),
        "forward_capture_s": forward_stats.get("forward graph capture (s)"),
        "parameters": sum(p.numel() for chunk in policy.model for p in chunk.parameters()),
    }


def report(options: argparse.Namespace, row: dict) -> str:
    lines = [f"GPT at 8B layer shapes, {options.layers} layers, FFN {options.ffn_hidden_size}, "
             f"{row['parameters'] / 1e9:.2f} B parameters, {options.micro_batches} "
             f"micro-batches of {options.seq_length} positions, {options.graphs} graphs", "",
             "| cycle | reserved (MiB) | released (MiB) | released / reserved | offload (s) "
             "| onload (s) | taken back (MiB) | free while offloaded (MiB) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k, (gone, back, free) in enumerate(row["cycles"], start=1):
        lines.append(f"| {k} | {gone.reserved_mib:.0f} | {gone.mib:.0f} | "
                     f"{gone.mib / max(gone.reserved_mib, 1e-9):.1%} | {gone.seconds:.2f} | "
                     f"{back.seconds:.2f} | {back.mib:.0f} | {free:.0f} |")
    capture_step, replay_step = row["steps"][-2][0], row["steps"][-1][0]
    lines += ["", "Releasing the graphs instead and capturing them again at the next call:", "",
              "| training graph capture (s) | forward-only graph capture (s) | capturing step "
              "(s) | replaying step (s) |", "| ---: | ---: | ---: | ---: |",
              f"| {row['capture_s']} | {row['forward_capture_s']} | {capture_step:.2f} | "
              f"{replay_step:.2f} |", "",
              f"after the cycles: log-probs bitwise as before: {row['bitwise']}; graphs "
              f"replayed, none captured again: {row['replayed']}; step loss "
              f"{row['last'][1]:.4f} in {row['last'][0]:.2f} s"]
    return "\n".join(lines)


def main(argv=None) -> int:
    options = parse(argv)
    from megatron.packed_training.rl.offload import require_memory_saver

    from megatron.packed_training.extra_args import is_importable

    try:
        require_memory_saver()
    except RuntimeError:
        if os.environ.get("OFFLOAD_BENCHMARK_RELAUNCHED") or not is_importable(
                "torch_memory_saver"):
            raise
        from torch_memory_saver import configure_subprocess

        # The preload library must be there when the process starts: start again with it.
        with configure_subprocess():
            env = dict(os.environ, OFFLOAD_BENCHMARK_RELAUNCHED="1")
            return subprocess.call([sys.executable, os.path.abspath(__file__),
                                    *(sys.argv[1:] if argv is None else argv)], env=env)
    import torch

    row = measure(options)
    print(report(options, row), flush=True)
    torch.distributed.destroy_process_group()
    return 0 if row["bitwise"] and row["replayed"] else 1


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
