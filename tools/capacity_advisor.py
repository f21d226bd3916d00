"""Recommend ``--cuda-graph-max-packed-seqs`` from the data a run will read, or, for MoE,
``--moe-expert-capacity-factor`` from measured router loads.

Graph capacity: packs the data with the training code, counts ``cu_seqlens`` segments per
micro-batch (the padding tail included: a graph capacity must hold every segment), and picks
the smallest capacity whose predicted eager-fallback rate is at most the target.

MoE capacity (``--moe-router-loads``): reads peak expert loads (the most tokens one expert of
one MoE layer received from one rank, per micro-batch, before the capacity) and picks the
smallest drop-and-pad capacity factor whose predicted overflow rate is at most the target:
with ``--moe-capacity-overflow rerun`` that is the share of micro-batches rerun eager. The
loads come from a training run (`moe_rerun.MoEOverflowRerun.router_load_record`, e.g. a
warm-up with a generous factor) or any dump in the same JSON format (`read_router_loads`).
The report then sets that factor against dropless MoE graphs (``--moe-dropless-graphs``: no
capacity at all) in rows per MoE layer (and MiB with ``--hidden-size``), and says when
drop-and-pad remains the better choice (`format_dropless_comparison`). CPU only.

    python tools/capacity_advisor.py --data-path train.jsonl --seq-length 4096 --vocab-size 32000
    python tools/capacity_advisor.py --mock-data --seq-length 4096 --vocab-size 32000
    CAPACITY=$(python tools/capacity_advisor.py --mock-data ... --print-capacity)   # for scripts
    python tools/capacity_advisor.py --moe-router-loads loads.json --target-overflow-rate 0.01
"""

import argparse
import json
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Iterable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

# torch's note about a CUDA_HOME without a CUDA runtime, on machines without a GPU
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
with warnings.catch_warnings():  # megatron-core's notes about optional packages it lacks
    warnings.simplefilter("ignore")
    from megatron.packed_training.datasets import MockPackedDataset, PackedRow  # noqa: E402
    from megatron.packed_training.datasets.builder import split_dataset  # noqa: E402
    from megatron.packed_training.datasets.chat import chat_line  # noqa: E402
    from megatron.packed_training.datasets.packing import (  # noqa: E402
        LONG_DOCUMENT_POLICIES,
        resolve_long_document_policy,
    )
    from megatron.packed_training.datasets.row_plan import (  # noqa: E402
        DEFAULT_PACKING_ALGORITHM,
        DEFAULT_PACKING_MAX_DOCUMENTS,
        DEFAULT_PACKING_WINDOW,
        PACKING_ALGORITHMS,
    )
    from megatron.packed_training.datasets.sources import pack_data  # noqa: E402

ROUND_CAPACITIES = (16, 32, 64, 128, 256, 512, 1024)
"""Capacities whose fallback rate the report always shows."""

PERCENTILES = (50, 90, 99)


def micro_batch_counts(
    rows: Iterable[PackedRow], micro_batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(segments, documents) per micro-batch: int64 arrays, one entry per ``micro_batch_size``
    consecutive rows; an incomplete last group is dropped, as training drops it.

    The segment count equals ``collate_packed_rows(group)["num_segments"]``: rows' segments
    simply add up in the flattened stream.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size is wrong: {micro_batch_size}. Set --micro-batch-size >= 1.")
    per_row = np.array([(row.num_segments, row.num_documents) for row in rows], dtype=np.int64)
    segments, documents = per_row.reshape(-1, 2).T
    groups = len(segments) // micro_batch_size
    if groups == 0:
        raise ValueError(
            f"data is wrong: {len(segments)} packed rows, fewer than one micro-batch of "
            f"{micro_batch_size}. Use more data or a smaller --micro-batch-size."
        )
    keep = groups * micro_batch_size
    return (
        segments[:keep].reshape(groups, micro_batch_size).sum(axis=1),
        documents[:keep].reshape(groups, micro_batch_size).sum(axis=1),
    )


def fallback_rate(segment_counts: Sequence[int], capacity: int) -> float:
    """Fraction of micro-batches with more segments than ``capacity`` (they would run eager)."""
    counts = np.asarray(segment_counts)
    return float(np.mean(counts > capacity))


def recommend_capacity(segment_counts: Sequence[int], target_fallback_rate: float) -> tuple[int, float]:
    """Smallest capacity whose fallback rate is ``<= target_fallback_rate``, and that rate.

    With ``n`` micro-batches at most ``k = floor(target * n)`` may overflow, so the answer is
    the ``(k+1)``-th largest count: any smaller capacity lets at least ``k + 1`` overflow.
    """
    counts = np.sort(np.asarray(segment_counts, dtype=np.int64))
    if counts.size == 0:
        raise ValueError("segment counts are wrong: empty. Pass at least one micro-batch.")
    if not 0.0 <= target_fallback_rate < 1.0:
        raise ValueError(
            f"target fallback rate is wrong: {target_fallback_rate}. "
            f"Set --target-fallback-rate in [0, 1), e.g. 0.01."
        )
    allowed = math.floor(target_fallback_rate * counts.size + 1e-9)
    capacity = max(1, int(counts[counts.size - 1 - allowed]))
    return capacity, fallback_rate(counts, capacity)


def suggest_ladder(segment_counts: Sequence[int], top: int) -> list[int]:
    """Rungs for ``--cuda-graph-capacity-ladder`` below ``top``: P50 and P90 of the segment
    counts rounded up to powers of two, when padding to ``top`` would at least double them.

    Padding costs grow with the capacity (docs/benchmarks.md), so typical micro-batches
    should replay a graph sized for them; ``top`` still catches the tail.
    """
    counts = np.asarray(segment_counts)
    rungs = []
    for p in (50, 90):
        rung = 1 << max(0, int(np.percentile(counts, p, method="higher")) - 1).bit_length()
        if 2 * rung <= top and rung not in rungs:
            rungs.append(rung)
    return rungs


def mean_padded_capacity(segment_counts: Sequence[int], capacities: Sequence[int]) -> float:
    """Mean capacity the graphed micro-batches are padded to (smallest that fits each)."""
    ladder = np.sort(np.asarray(capacities))
    counts = np.asarray(segment_counts)
    fits = counts[counts <= ladder[-1]]
    return float(ladder[np.searchsorted(ladder, fits)].mean()) if fits.size else float("nan")


def format_report(
    segments: np.ndarray,
    documents: np.ndarray,
    micro_batch_size: int,
    seq_length: int,
    target_fallback_rate: float,
) -> str:
    """The printed report: percentile table, rates at round capacities, recommended flag."""
    lines = [
        f"{len(segments)} micro-batches of {micro_batch_size} row(s) x {seq_length} positions",
        "",
        f"{'per micro-batch':<16}" + "".join(f"{'P' + str(p):>8}" for p in PERCENTILES) + f"{'max':>8}",
    ]
    for name, values in (("documents", documents), ("segments", segments)):
        cells = [int(np.percentile(values, p, method="higher")) for p in PERCENTILES]
        cells.append(int(values.max()))
        lines.append(f"{name:<16}" + "".join(f"{c:>8}" for c in cells))
    lines += ["(segments = documents + padding tails: what the capacity must hold)", ""]
    capacity, rate = recommend_capacity(segments, target_fallback_rate)
    lines.append(f"{'capacity':>8}  predicted fallback rate")
    for round_capacity in sorted(set(ROUND_CAPACITIES) | {capacity}):
        marker = "  <- recommended" if round_capacity == capacity else ""
        lines.append(f"{round_capacity:>8}  {100 * fallback_rate(segments, round_capacity):6.2f}%{marker}")
    lines += [
        "",
        f"recommended: --cuda-graph-max-packed-seqs {capacity}   "
        f"(predicted fallback rate {100 * rate:.2f}%, target {100 * target_fallback_rate:.2f}%)",
    ]
    rungs = suggest_ladder(segments, capacity)
    if rungs:
        lines.append(
            f"and (PP=1) --cuda-graph-capacity-ladder {' '.join(map(str, rungs))}   "
            f"(mean padded capacity {mean_padded_capacity(segments, rungs + [capacity]):.1f} "
            f"instead of {capacity})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ MoE capacity

ROUND_FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
"""Capacity factors whose overflow rate the MoE report always shows (those allowed)."""


@dataclass(frozen=True)
class RouterLoads:
    """Peak expert loads of sampled micro-batches and the shape that sizes the capacity."""

    num_experts: int
    topk: int
    tokens_per_rank: int  # tokens one rank's MoE layer routes per micro-batch, padding included
    peak_loads: np.ndarray  # int64, one per micro-batch
    micro_batches_per_iteration: int = 0  # 0: unknown

    @property
    def max_factor(self) -> float:
        """The largest factor drop-and-pad takes (factor x top-k <= experts), to 2 decimals."""
        return math.floor(100 * self.num_experts / self.topk + 1e-9) / 100


def expert_capacity(loads: RouterLoads, factor: float) -> int:
    """Rows per expert under drop-and-pad at ``factor`` (megatron-core's get_capacity)."""
    return math.ceil(loads.tokens_per_rank * loads.topk / loads.num_experts * factor)


def read_router_loads(path: str) -> RouterLoads:
    """A router-load JSON: ``num_experts``, ``moe_router_topk``, ``tokens_per_rank``, optional
    ``micro_batches_per_iteration``, and the loads as one of ``peak_loads`` (a list, one int
    per micro-batch, or ``{"load": micro-batches}``) or ``expert_loads`` (per micro-batch, the
    token count of every expert, nested per layer or rank as you like: its maximum counts)."""
    with open(path) as f:
        record = json.load(f)
    missing = [key for key in ("num_experts", "moe_router_topk", "tokens_per_rank")
               if not isinstance(record.get(key), int) or record[key] < 1]
    if missing:
        raise ValueError(f"router loads are wrong: {path} lacks a positive integer "
                         f"{', '.join(missing)}. Write them with the loads (format: "
                         "tools/capacity_advisor.py read_router_loads).")
    if "peak_loads" in record:
        peaks = record["peak_loads"]
        if isinstance(peaks, dict):
            peaks = np.repeat([int(load) for load in peaks], [int(n) for n in peaks.values()])
    elif "expert_loads" in record:
        peaks = [int(np.max(np.asarray(sample))) for sample in record["expert_loads"]]
    else:
        raise ValueError(f"router loads are wrong: {path} has neither peak_loads nor "
                         "expert_loads. Add one.")
    peaks = np.asarray(peaks, dtype=np.int64)
    if peaks.size == 0:
        raise ValueError(f"router loads are wrong: {path} holds no micro-batch. Record loads "
                         "over at least one iteration.")
    return RouterLoads(record["num_experts"], record["moe_router_topk"],
                       record["tokens_per_rank"], peaks,
                       int(record.get("micro_batches_per_iteration", 0)))


def recommend_capacity_factor(loads: RouterLoads, target_overflow_rate: float):
    """``(factor, capacity, overflow rate)``: the smallest factor, to 2 decimals, whose
    capacity overflows at most ``target_overflow_rate`` of the micro-batches (one overflows
    when its peak load exceeds the capacity), capped at `RouterLoads.max_factor`."""
    if not 0.0 <= target_overflow_rate < 1.0:
        raise ValueError(f"target overflow rate is wrong: {target_overflow_rate}. Set "
                         "--target-overflow-rate in [0, 1), e.g. 0.01.")
    needed, _ = recommend_capacity(loads.peak_loads, target_overflow_rate)
    share = loads.tokens_per_rank * loads.topk / loads.num_experts
    # The capacity is rounded up: any factor above (needed - 1) / share holds ``needed``.
    factor = math.floor(100 * (needed - 1) / share) / 100
    while expert_capacity(loads, factor) < needed:
        factor = round(factor + 0.01, 2)
    factor = max(0.01, min(factor, loads.max_factor))
    capacity = expert_capacity(loads, factor)
    return factor, capacity, fallback_rate(loads.peak_loads, capacity)


def iteration_rerun_rate(loads: RouterLoads, rate: float) -> float:
    """Share of iterations with at least one overflowing micro-batch, micro-batches taken
    as independent; nan when the micro-batches per iteration are unknown."""
    n = loads.micro_batches_per_iteration
    return 1.0 - (1.0 - rate) ** n if n else float("nan")


def format_moe_report(loads: RouterLoads, target_overflow_rate: float) -> str:
    """The printed MoE report: peak-load percentiles, overflow rates at round factors, flags."""
    share = loads.tokens_per_rank * loads.topk / loads.num_experts
    peaks = loads.peak_loads
    lines = [f"{peaks.size} micro-batches; {loads.num_experts} experts, top-{loads.topk}, "
             f"{loads.tokens_per_rank} tokens per rank: an even share is {share:g} per expert",
             "",
             f"{'peak expert load':<18}" + "".join(f"{'P' + str(p):>8}" for p in PERCENTILES)
             + f"{'max':>8}"]
    cells = [int(np.percentile(peaks, p, method="higher")) for p in PERCENTILES]
    lines.append(f"{'tokens':<18}" + "".join(f"{c:>8}" for c in cells + [int(peaks.max())]))
    lines.append(f"{'x even share':<18}" + "".join(f"{c / share:>8.2f}"
                                                   for c in cells + [int(peaks.max())]))
    factor, capacity, rate = recommend_capacity_factor(loads, target_overflow_rate)
    lines += ["", f"{'factor':>8}{'capacity':>10}{'overflowing micro-batches':>27}"
                  f"{'iterations':>12}"]
    for f in sorted({x for x in ROUND_FACTORS if x <= loads.max_factor} | {factor}):
        cap = expert_capacity(loads, f)
        r = fallback_rate(peaks, cap)
        marker = "  <- recommended" if f == factor else ""
        lines.append(f"{f:>8g}{cap:>10}{100 * r:>26.2f}%"
                     f"{100 * iteration_rerun_rate(loads, r):>11.2f}%{marker}")
    lines += ["", f"recommended: --moe-expert-capacity-factor {factor:g} "
                  f"--moe-pad-expert-input-to-capacity --moe-capacity-overflow rerun   "
                  f"(predicted overflow {100 * rate:.2f}% of micro-batches, target "
                  f"{100 * target_overflow_rate:.2f}%)"]
    if rate > target_overflow_rate:
        lines.append(f"the target is out of reach: drop-and-pad allows factors up to "
                     f"{loads.max_factor:g} (factor x top-k <= experts)")
    return "\n".join(lines)


DROPLESS_ALIGNMENT = 8
"""Rows each expert's group is padded to under --moe-dropless-graphs (16 bytes of bf16;
packed_model/grouped_gemm.group_alignment)."""


def dropless_graph_rows(loads: RouterLoads, expert_parallel: int = 1) -> tuple[int, int]:
    """``(allocated, computed at most)`` expert rows of one MoE layer, rank and micro-batch
    under --moe-dropless-graphs: the static buffer and its groups at their largest. At
    expert parallel size 1 the buffer holds every slot of the rank's tokens
    (moe_dropless.static_rows); above, each rank receives a fixed block of room for the worst
    case from every rank (moe_dropless.send_capacity) and regroups it."""
    from megatron.packed_model.moe_dropless import buffer_rows, send_capacity

    local = loads.num_experts // expert_parallel
    slots = loads.tokens_per_rank * loads.topk
    if expert_parallel > 1:
        slots = expert_parallel * send_capacity(loads.tokens_per_rank, loads.topk, local)
    return (buffer_rows(slots, local, DROPLESS_ALIGNMENT), slots + local * DROPLESS_ALIGNMENT)


def format_dropless_comparison(loads: RouterLoads, factor: float, expert_parallel: int = 1,
                               hidden_size: int = 0) -> str:
    """Dropless MoE graphs set against drop-and-pad at ``factor``: expert rows per MoE layer,
    rank and micro-batch (the dispatched input, fc1 output and activation, all saved for the
    backward, scale with them; ``hidden_size`` adds the input rows' MiB in bf16), and when
    drop-and-pad is still the better choice."""
    capacity_rows = loads.num_experts * expert_capacity(loads, factor)
    allocated, computed = dropless_graph_rows(loads, expert_parallel)
    mib = (lambda rows: f"{rows * hidden_size * 2 / 2**20:>10.1f}") if hidden_size else (
        lambda rows: "")
    unit = f"{'input MiB':>10}" if hidden_size else ""
    room = (f"room for every slot of {expert_parallel} ranks' blocks" if expert_parallel > 1
            else f"routed slots {loads.tokens_per_rank * loads.topk}")
    lines = ["", "dropless MoE graphs (--moe-dropless-graphs) instead: no capacity, no token "
                 "dropped, nothing rerun",
             f"{'rows per MoE layer':<26}{'allocated':>10}{'computed':>10}{unit}",
             f"{'dropless graphs':<26}{allocated:>10}{computed:>10}{mib(allocated)}"
             f"   (at most: {room} + {DROPLESS_ALIGNMENT} per expert)",
             f"{'drop-and-pad at ' + format(factor, 'g'):<26}{capacity_rows:>10}"
             f"{capacity_rows:>10}{mib(capacity_rows)}   ({loads.num_experts} experts x "
             f"capacity {expert_capacity(loads, factor)})"]
    smaller = "fewer" if allocated < capacity_rows else "more"
    lines.append(f"dropless graphs hold {smaller} rows than drop-and-pad at this factor, "
                 f"whatever the routing; padding tokens take none")
    if expert_parallel > 1:
        from megatron.packed_model.moe_dropless import send_capacity

        exchanged = expert_parallel * send_capacity(
            loads.tokens_per_rank, loads.topk, loads.num_experts // expert_parallel)
        lines.append(f"at expert parallel size {expert_parallel} each rank sends and receives "
                     f"{exchanged} rows each way (drop-and-pad: {capacity_rows}): the "
                     "exchange is sized for the worst case")
    lines += ["drop-and-pad stays the better choice:",
              "  at expert parallel sizes where its factor needs fewer rows than the blocks "
              "above (memory and all-to-all bytes);",
              "  with FP8/FP4 experts (dropless graphs run bf16);",
              "  when the factor is close to 1 (as many rows, hardly a rerun) and TE's grouped "
              "GEMM is faster than torch's on these shapes:",
              "  measure with tools/benchmark.py --moe-modes dropless-graphs drop-and-pad"]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-path", nargs="+", default=None,
                        help="training's --data-path: pre-tokenized JSONL files or folders, "
                             "indexed-dataset prefixes, or a blend (docs/data-format.md)")
    source.add_argument("--mock-data", action="store_true", help="built-in synthetic packed rows")
    source.add_argument("--moe-router-loads", default=None, metavar="JSON",
                        help="MoE: suggest --moe-expert-capacity-factor from these router "
                             "loads (see read_router_loads)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="training's --seq-length (tokens per packed row); needed with "
                             "--data-path and --mock-data")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="training's --vocab-size; needed with --data-path and --mock-data")
    parser.add_argument("--micro-batch-size", type=int, default=1,
                        help="training's --micro-batch-size (rows per micro-batch)")
    parser.add_argument("--target-fallback-rate", type=float, default=0.01,
                        help="largest acceptable share of micro-batches that run eager")
    parser.add_argument("--long-document-policy", choices=LONG_DOCUMENT_POLICIES, default=None,
                        help="as training's flag: a document longer than a row is split into "
                             "row-sized pieces (split, training's default), truncated, or "
                             "refused (reject)")
    parser.add_argument("--reject-long-documents", action="store_true",
                        help="the older spelling of --long-document-policy reject")
    parser.add_argument("--mock-doc-length-median", type=float, default=512,
                        help="with --mock-data: training's --mock-doc-length-median")
    parser.add_argument("--mock-doc-length-sigma", type=float, default=1.0,
                        help="with --mock-data: training's --mock-doc-length-sigma")
    parser.add_argument("--num-samples", type=int, default=2000, help="mock rows to draw")
    parser.add_argument("--packing-algorithm", choices=PACKING_ALGORITHMS,
                        default=DEFAULT_PACKING_ALGORITHM, help="training's packer")
    parser.add_argument("--packing-window", type=int, default=DEFAULT_PACKING_WINDOW,
                        help="training's --packing-window")
    parser.add_argument("--packing-max-documents", type=int,
                        default=DEFAULT_PACKING_MAX_DOCUMENTS,
                        help="training's --packing-max-documents")
    parser.add_argument("--data-cache-path", default=None,
                        help="training's --data-cache-path: where JSONL's token cache lives")
    parser.add_argument("--seed", type=int, default=1234, help="training's --seed")
    parser.add_argument("--target-overflow-rate", type=float, default=0.01,
                        help="with --moe-router-loads: largest acceptable share of "
                             "micro-batches that overflow an expert's capacity")
    parser.add_argument("--expert-model-parallel-size", type=int, default=1,
                        help="with --moe-router-loads: training's expert parallel size (sizes "
                             "the exchange of dropless MoE graphs)")
    parser.add_argument("--hidden-size", type=int, default=0,
                        help="with --moe-router-loads: training's --hidden-size, to show the "
                             "dispatched rows in MiB")
    parser.add_argument("--print-capacity", action="store_true",
                        help="print only the recommended capacity (one integer; with "
                             "--moe-router-loads the capacity factor), for scripts")
    args = parser.parse_args(argv)
    try:
        args.long_document_policy = resolve_long_document_policy(args.long_document_policy,
                                                                 args.reject_long_documents)
    except ValueError as error:
        parser.error(str(error))
    if not args.moe_router_loads:
        for flag in ("--seq-length", "--vocab-size"):
            if getattr(args, flag[2:].replace("-", "_")) is None:
                parser.error(f"{flag} is required with --data-path and --mock-data")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.moe_router_loads:
        loads = read_router_loads(args.moe_router_loads)
        if args.print_capacity:
            print(f"{recommend_capacity_factor(loads, args.target_overflow_rate)[0]:g}")
        else:
            print(args.moe_router_loads)
            print(format_moe_report(loads, args.target_overflow_rate))
            factor = recommend_capacity_factor(loads, args.target_overflow_rate)[0]
            print(format_dropless_comparison(loads, factor, args.expert_model_parallel_size,
                                             args.hidden_size))
        return 0
    recommend_capacity([1], args.target_fallback_rate)  # reject a bad target before packing
    if args.mock_data:
        dataset = MockPackedDataset(
            args.num_samples,
            args.seq_length,
            args.vocab_size,
            args.seed,
            doc_length_median=args.mock_doc_length_median,
            doc_length_sigma=args.mock_doc_length_sigma,
            long_document_policy=args.long_document_policy,
        )
        header = (
            f"mock data: median {args.mock_doc_length_median:g} tokens, "
            f"sigma {args.mock_doc_length_sigma:g}, seed {args.seed}"
        )
    else:
        for path in args.data_path:
            line = chat_line(path) if os.path.isfile(path) else None
            if line is not None:
                raise ValueError(
                    f"{path}:{line}: data is wrong: a chat conversation (\"messages\"), and "
                    f"the advisor reads pre-tokenized JSONL. Pre-tokenize it first: python "
                    f"tools/preprocess_sft.py --input {path} --output train.jsonl "
                    f"--tokenizer-model <tokenizer folder>, then pass --data-path train.jsonl.")
        # The training data path: the token cache (built or reused), the blend, the packer.
        split = pack_data(argparse.Namespace(
            data_path=args.data_path, vocab_size=args.vocab_size, seq_length=args.seq_length,
            seed=args.seed, sft=True, long_document_policy=args.long_document_policy,
            packing_algorithm=args.packing_algorithm, packing_window=args.packing_window,
            packing_max_documents=args.packing_max_documents,
            data_cache_path=args.data_cache_path, tokenizer_type=None, tokenizer_model=None,
            max_truncated_token_fraction=1.0),  # the advisor reports truncation, never stops
            with_valid=False)["train"]
        # One epoch in the order training reads it (the row order is shuffled per epoch).
        rows = sum(len(part) for _, part in split.parts)
        dataset = split_dataset(split, rows, args.seed)
        stats = split.stats
        header = (
            f"{' '.join(args.data_path)}: {stats.documents} documents in {stats.rows} rows, "
            f"{stats.skipped_empty} skipped empty, {stats.truncated} truncated, "
            f"{stats.split} split into {stats.pieces} pieces"
        )
    segments, documents = micro_batch_counts(
        (dataset[i] for i in range(len(dataset))), args.micro_batch_size
    )
    if args.print_capacity:
        print(recommend_capacity(segments, args.target_fallback_rate)[0])
        return 0
    print(header)
    print(format_report(segments, documents, args.micro_batch_size, args.seq_length, args.target_fallback_rate))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as error:  # user-input errors: the message says what to change
        print(f"capacity_advisor: error: {error}", file=sys.stderr)
        sys.exit(2)
