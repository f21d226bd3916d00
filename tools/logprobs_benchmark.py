"""Forward-only throughput of one configuration: `PackedPolicy.logprobs` calls, timed.

What ``tools/benchmark.py --mode logprobs`` runs once per (preset, variant), under torchrun:

    torchrun --standalone --nproc-per-node 1 tools/logprobs_benchmark.py --model gpt \
        --calls 30 --warmup 5 --micro-batches 8 --json row.json -- <training flags>

The training flags (Megatron-LM's command line, as for pretrain_gpt.py / pretrain_mamba.py)
build the policy (`PackedPolicy.build`); with a graph implementation, log-probs replay
forward-only graphs, without one they run eager. Each call hands over ``--micro-batches``
micro-batches of synthetic documents (mock data's length law, ``--mock-doc-length-median``
and ``--mock-doc-length-sigma``), packed whole into rows of micro_batch_size x seq_length
positions, other documents each call; the first ``--warmup`` calls (captures, autotuning)
are left out. ``--profile``: the last two calls run once more under torch.profiler, for the
GPU-busy time of a call (the union of its kernels, megatron/packed_training/profiling.py),
and one more under cProfile for its top host functions, all left out of the timing. Rank 0
writes one JSON object: ``call_ms`` (median) and ``call_iqr_ms``, ``tokens_per_sec`` (row
positions per second, as training's benchmark counts them), ``peak_mem_gib``, ``capture_s``
and ``graph_mem_mib`` (the forward-only graphs'), ``fallback_rate`` (micro-batches run eager
for overflow, per micro-batch), ``gpu_busy_ms`` (median of the profiled calls; null without
``--profile``), ``host_top`` (the cProfile lines; empty without it) and ``stats`` (the graph
runtime's counters of the last call).

``--entropy`` and ``--top-k K`` ask the calls for those outputs too; ``--vocab-chunk N`` sets
the head's vocabulary chunk (`PackedPolicy.logprob_vocab_chunk`; 0: the whole shard at once,
megatron-core's cross entropy). ``--peak-memory`` measures memory instead of time, on the
first call's micro-batches: the peak allocated above what was allocated before the call, for
an eager call, for the first graphed call (which captures the forward-only graphs) and for a
replay, and the graphs' memory (their pool's growth and static inputs). Its JSON:
``eager_peak_gib``, ``capture_peak_gib``, ``replay_peak_gib``, ``graph_mem_mib``,
``vocab_chunk``, ``positions``, ``vocab_size``. One configuration per process: graphs of
several chunk sizes would share one pool.
"""

import argparse
import json
import os
import statistics
import sys
import time
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_calls(calls: int, micro_batches: int, row_positions: int, vocab_size: int,
                    median: float, sigma: float, seed: int = 1234) -> List[list]:
    """``calls`` lists of ``micro_batches`` `PackedSequences` each (host), documents of mock
    data's length law cut to a row, packed whole and in order."""
    import torch

    from megatron.packed_training.datasets.mock import mock_documents
    from megatron.packed_training.rl import pack_sequences

    out = []
    for call in range(calls):
        documents = mock_documents((micro_batches + 1) * row_positions, row_positions,
                                   vocab_size, seed + call, median, sigma)
        tokens = [torch.from_numpy(doc.input_ids[:row_positions + 1]) for doc in documents]
        packed = pack_sequences(tokens, row_positions)
        if len(packed) < micro_batches:
            raise RuntimeError(f"synthetic data gave {len(packed)} micro-batches for "
                               f"{micro_batches}; this is a bug")
        out.append(packed[:micro_batches])
    return out


def peak_memory(policy, micro_batches: list, **options) -> dict:
    """Peak allocated memory of `logprobs` calls on ``micro_batches`` (module doc), GiB above
    what was allocated before each call; ``options``: the calls' keywords."""
    import torch

    def call_peak(**extra) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        policy.logprobs(micro_batches, **options, **extra)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**30

    eager = call_peak(eager=True)
    capture = call_peak()
    graph_mib = policy.last_stats.get("forward graph memory (MiB)", 0.0)
    replay = call_peak()
    return {"eager_peak_gib": eager, "capture_peak_gib": capture, "replay_peak_gib": replay,
            "graph_mem_mib": graph_mib, "vocab_chunk": policy.logprob_vocab_chunk,
            "positions": len(micro_batches) * policy.row_positions,
            "vocab_size": policy.vocab_size, "stats": dict(policy.last_stats)}


def measure(policy, calls: List[list], warmup: int, profile: bool = False,
            **options) -> dict:
    """Time ``policy.logprobs`` over ``calls``; the row's values (module doc)."""
    import torch

    from megatron.packed_training.profiling import StepProfiler

    times, overflow, first = [], 0, {}
    for index, micro_batches in enumerate(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        policy.logprobs(micro_batches, **options)
        torch.cuda.synchronize()
        if index == 0:
            first = dict(policy.last_stats)
        if index >= warmup:
            times.append(time.perf_counter() - start)
            overflow += policy.last_stats.get("eager overflow", 0)
    busy, host_top = [], []
    if profile:  # the last two calls again, each under the profiler, outside the timing
        profiler = StepProfiler(True, 1, 3)
        for index, micro_batches in enumerate(calls[-2:], 1):
            profiler.begin(index)
            policy.logprobs(micro_batches, **options)
            busy.append(profiler.finish(index)["gpu busy (ms)"])
        host_top = host_profile(policy, calls[-1], **options)
    timed = len(calls) - warmup
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    positions = len(calls[0]) * policy.row_positions
    return {"call_ms": 1000 * statistics.median(times),
            "call_iqr_ms": 1000 * (quartiles[2] - quartiles[0]),
            "tokens_per_sec": positions / statistics.median(times),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "capture_s": first.get("forward graph capture (s)", 0.0),
            "graph_mem_mib": first.get("forward graph memory (MiB)", 0.0),
            "fallback_rate": overflow / (timed * len(calls[0])),
            "gpu_busy_ms": statistics.median(busy) if busy else None,
            "host_top": host_top,
            "stats": dict(policy.last_stats)}


def host_profile(policy, micro_batches: list, top: int = 15, **options) -> List[str]:
    """One more call under cProfile: its ``top`` Python functions by own time, one line each
    (own ms, cumulative ms, calls, where). Tells which host code a host-bound call spends its
    time in; time spent waiting for the GPU shows as the synchronize that ends the call (or as
    a host read inside it)."""
    import cProfile
    import pstats

    import torch

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    policy.logprobs(micro_batches, **options)
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    lines = []
    for (path, line, name), (_, calls, own, cumulative, _) in sorted(
            stats.stats.items(), key=lambda item: -item[1][2])[:top]:
        where = f"{os.path.relpath(path, REPO) if path.startswith('/') else path}:{line}({name})"
        lines.append(f"{1000 * own:8.2f} {1000 * cumulative:9.2f} {calls:7d}  {where}")
    return lines


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt", "hybrid"), required=True)
    parser.add_argument("--calls", type=int, default=30, help="logprobs calls")
    parser.add_argument("--warmup", type=int, default=5, help="leading calls left out")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per call")
    parser.add_argument("--json", required=True, help="where rank 0 writes the row")
    parser.add_argument("--profile", action="store_true",
                        help="GPU-busy time of the last two calls, run again under the profiler")
    parser.add_argument("--entropy", action="store_true", help="ask the calls for entropy")
    parser.add_argument("--top-k", type=int, default=0, help="ask the calls for top-k")
    parser.add_argument("--vocab-chunk", type=int, default=None,
                        help="vocabulary columns per chunk of the head (0: the whole shard); "
                             "default: the policy's")
    parser.add_argument("--peak-memory", action="store_true",
                        help="peak memory of one call (eager, capture, replay) instead of time")
    parser.add_argument("flags", nargs=argparse.REMAINDER,
                        help="-- then the training flags (Megatron-LM's command line)")
    options = parser.parse_args(argv)
    flags = options.flags[1:] if options.flags[:1] == ["--"] else options.flags
    if options.calls <= options.warmup:
        parser.error(f"--calls is wrong: {options.calls}. It must exceed --warmup "
                     f"({options.warmup}).")
    if options.micro_batches < 1:
        parser.error(f"--micro-batches is wrong: {options.micro_batches}. Give at least 1.")
    if options.vocab_chunk is not None and options.vocab_chunk < 0:
        parser.error(f"--vocab-chunk is wrong: {options.vocab_chunk}. Give 0 (the whole "
                     f"shard) or a positive number of columns.")
    return options, flags


def main(argv=None) -> int:
    options, flags = parse(argv)
    import torch

    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.rl import PackedPolicy, PolicyConfig

    args = parse_args(flags, options.model, raise_on_error=True)
    policy = PackedPolicy.build(PolicyConfig(args, model=options.model))
    if options.vocab_chunk is not None:
        policy.logprob_vocab_chunk = options.vocab_chunk
    head = {"entropy": options.entropy, "top_k": options.top_k}
    calls = synthetic_calls(1 if options.peak_memory else options.calls, options.micro_batches,
                            policy.row_positions, args.padded_vocab_size,
                            args.mock_doc_length_median, args.mock_doc_length_sigma,
                            seed=args.seed)
    if options.peak_memory:
        row = peak_memory(policy, calls[0], **head)
        line = (f"logprobs peak memory (vocab chunk {row['vocab_chunk']}, {row['positions']} "
                f"positions, vocabulary {row['vocab_size']}): eager {row['eager_peak_gib']:.2f} "
                f"GiB, capture {row['capture_peak_gib']:.2f} GiB, replay "
                f"{row['replay_peak_gib']:.2f} GiB, graph memory {row['graph_mem_mib']:.0f} MiB")
    else:
        row = measure(policy, calls, options.warmup, options.profile, **head)
        line = (f"logprobs: {row['call_ms']:.1f} ms per call, {row['tokens_per_sec']:,.0f} "
                f"tokens/s")
    if torch.distributed.get_rank() == 0:
        with open(options.json, "w") as f:
            json.dump(row, f)
        print(line, flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
