"""Where does a step wait for the host? GPU idle time of a profiled iteration, by host frame.

Reads a Chrome trace written by ``--profile --profile-trace-dir DIR`` (torch.profiler with
CPU activity and Python stacks) and prints:

* the iteration's span, its GPU-busy time and its GPU-idle time (gaps of at least
  ``--min-gap-us`` between kernels, copies and memsets);
* the host frames (Python functions, aten ops, CUDA runtime calls) of the training thread that
  were running during those gaps: **self** idle time (the innermost frame at each instant)
  and **inclusive** idle time (the frame or anything it called).

A step whose GPU-idle time is mostly under one frame is waiting on that code: a host sync
(``cudaStreamSynchronize``, ``aten::item``) or eager work launched too slowly.

    python tools/step_gaps.py /tmp/traces/trace_iter20_rank0.json --top 20

``--census`` looks at the gaps of a step the host no longer limits (a replayed CUDA graph):
how many GPU operations it has and how many a graph launched, the gaps between them by
length, inside a graph or not, and the operation pairs with the most gap time. Short gaps
between a graph's dependent kernels are the GPU's own launch latency.

A missing, unreadable or cut-off trace (not complete JSON), or one without GPU kernels, is
named in one line on stderr, with exit status 1.
"""

import argparse
import json
import sys
from collections import defaultdict
from typing import Dict, List, Tuple

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"python_function", "cpu_op", "cuda_runtime", "cuda_driver", "user_annotation"}

Interval = Tuple[float, float]


def idle_gaps(busy: List[Interval], min_gap: float) -> List[Interval]:
    """Gaps of at least ``min_gap`` between the union of ``busy`` intervals, first to last."""
    gaps, end = [], None
    for start, stop in sorted(busy):
        if end is not None and start - end >= min_gap:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


def overlap(a: Interval, gaps: List[Interval]) -> float:
    """Length of interval ``a`` that lies inside the (sorted, disjoint) ``gaps``."""
    return sum(max(0.0, min(a[1], g[1]) - max(a[0], g[0])) for g in gaps
               if g[0] < a[1] and g[1] > a[0])


def idle_by_frame(frames: List[Tuple[str, float, float]], gaps: List[Interval]
                  ) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Self and inclusive idle time per frame name; ``frames`` are nested (one thread)."""
    inclusive, self_time = defaultdict(float), defaultdict(float)
    stack: List[list] = []  # [name, end, idle inside, idle of children]

    def close(entry):
        name, _, idle, children = entry
        self_time[name] += idle - children
        if stack:
            stack[-1][3] += idle

    for name, start, end in sorted(frames, key=lambda f: (f[1], -f[2])):
        while stack and stack[-1][1] <= start:
            close(stack.pop())
        idle = overlap((start, end), gaps)
        if all(entry[0] != name for entry in stack):  # a recursive frame counts once
            inclusive[name] += idle
        stack.append([name, end, idle, 0.0])
    while stack:
        close(stack.pop())
    return dict(self_time), dict(inclusive)


def timed_events(trace: dict) -> Tuple[List[dict], List[dict]]:
    """``(complete events, GPU operations by start time)`` of ``trace``; ValueError when it
    holds no GPU operation."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    ops = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    if not ops:
        raise ValueError("trace is wrong: it holds no GPU kernels. Record it with CUDA "
                         "activity (--profile --profile-trace-dir on a GPU run).")
    return events, ops


def analyse(trace: dict, min_gap_us: float) -> dict:
    """Busy/idle summary and idle time per host frame of the busiest host thread."""
    events, ops = timed_events(trace)
    busy = [(e["ts"], e["ts"] + e["dur"]) for e in ops]
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    threads = defaultdict(list)
    for e in host:
        threads[(e.get("pid"), e.get("tid"))].append((e["name"], e["ts"], e["ts"] + e["dur"]))
    frames = max(threads.values(), key=len) if threads else []
    span = (min(b[0] for b in busy), max(b[1] for b in busy))
    if frames:  # the step starts when its host thread does, often before the first kernel
        span = (min(span[0], min(f[1] for f in frames)), span[1])
    gaps = idle_gaps(busy + [(span[0], span[0])], min_gap_us)
    self_time, inclusive = idle_by_frame(frames, gaps)
    return {"span_us": span[1] - span[0], "idle_us": sum(g[1] - g[0] for g in gaps),
            "gaps": len(gaps), "self": self_time, "inclusive": inclusive}


GAP_BUCKETS_US = (2.0, 10.0, 50.0, float("inf"))


def _short(name: str) -> str:
    """A kernel's name without template arguments and parameter lists."""
    return name.split("<")[0].split("(")[0].strip()[:60]


def census(trace: dict) -> dict:
    """GPU operations of ``trace``, the ones a CUDA graph launched, and every gap between
    consecutive ones: counts and time per length bucket (upper bounds in GAP_BUCKETS_US),
    inside a graph (both neighbours graph-launched) or not, and gap time per operation pair."""
    events, ops = timed_events(trace)
    launched_by = {e["args"]["correlation"]: e["name"] for e in events
                   if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}

    def from_graph(op) -> bool:
        return launched_by.get(op.get("args", {}).get("correlation")) == "cudaGraphLaunch"

    buckets = {(bound, inside): [0, 0.0] for bound in GAP_BUCKETS_US for inside in (True, False)}
    pairs: Dict[Tuple[str, str], List[float]] = defaultdict(lambda: [0, 0.0])
    last, end = None, None
    for op in ops:
        if end is not None and op["ts"] > end:
            gap = op["ts"] - end
            inside = from_graph(last) and from_graph(op)
            bucket = buckets[(next(b for b in GAP_BUCKETS_US if gap < b), inside)]
            bucket[0] += 1
            bucket[1] += gap
            pair = pairs[(_short(last["name"]), _short(op["name"]))]
            pair[0] += 1
            pair[1] += gap
        if end is None or op["ts"] + op["dur"] > end:
            last, end = op, op["ts"] + op["dur"]
    return {"ops": len(ops), "graph_ops": sum(map(from_graph, ops)), "buckets": buckets,
            "pairs": dict(pairs)}


def print_census(result: dict, top: int) -> None:
    print(f"{result['ops']} GPU operations, {result['graph_ops']} launched from CUDA graphs")
    print("| gap | inside a graph | count | time (ms) |")
    print("| --- | --- | ---: | ---: |")
    lower = 0.0
    for bound in GAP_BUCKETS_US:
        label = f">= {lower:g} us" if bound == float("inf") else f"{lower:g}-{bound:g} us"
        for inside in (True, False):
            count, time = result["buckets"][(bound, inside)]
            print(f"| {label} | {'yes' if inside else 'no'} | {count} | {time / 1000:.3f} |")
        lower = bound
    print()
    print("| after | before | gaps | time (ms) |")
    print("| --- | --- | ---: | ---: |")
    for (after, before), (count, time) in sorted(result["pairs"].items(),
                                                 key=lambda kv: -kv[1][1])[:top]:
        print(f"| `{after}` | `{before}` | {count} | {time / 1000:.3f} |")


def _table(title: str, times: Dict[str, float], idle_us: float, top: int) -> str:
    lines = [f"| {title} | idle (ms) | share of idle |", "| --- | ---: | ---: |"]
    for name, us in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        if us > 0:
            lines.append(f"| `{name[:110]}` | {us / 1000:.2f} | {us / idle_us:.0%} |")
    return "\n".join(lines)


def read_trace(path: str) -> dict:
    """The Chrome trace at ``path``; ValueError naming the file when it is missing, unreadable
    or not complete JSON (a trace cut off while it was written)."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"trace is wrong: {path} does not exist. Pass a "
                         f"trace_iter<N>_rank<R>.json from --profile-trace-dir.") from None
    except OSError as error:
        raise ValueError(f"trace is wrong: {path} cannot be read ({error.strerror}). Check the "
                         f"path and its permissions.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        where = f" at line {error.lineno}" if isinstance(error, json.JSONDecodeError) else ""
        raise ValueError(f"trace is wrong: {path} is not complete JSON{where}: the file is "
                         f"truncated or not a Chrome trace. Profile the iteration again.") from None
    if not isinstance(trace, dict):
        raise ValueError(f"trace is wrong: {path} is not a Chrome trace object. Pass a "
                         f"trace_iter<N>_rank<R>.json from --profile-trace-dir.")
    return trace


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("trace", help="trace_iter<N>_rank<R>.json from --profile-trace-dir")
    parser.add_argument("--min-gap-us", type=float, default=20.0,
                        help="shorter gaps between GPU work are launch latency, not waiting")
    parser.add_argument("--top", type=int, default=15, help="frames listed per table")
    parser.add_argument("--census", action="store_true",
                        help="gaps between GPU operations by length and by graph, and the "
                             "operation pairs with the most gap time, instead of host frames")
    args = parser.parse_args(argv)
    try:
        trace = read_trace(args.trace)
        if args.census:
            print_census(census(trace), args.top)
            return 0
        result = analyse(trace, args.min_gap_us)
    except ValueError as error:
        print(f"step_gaps: {error}", file=sys.stderr)
        return 1
    span, idle = result["span_us"], result["idle_us"]
    print(f"iteration span {span / 1000:.2f} ms, GPU busy {(span - idle) / 1000:.2f} ms, "
          f"GPU idle {idle / 1000:.2f} ms in {result['gaps']} gaps >= {args.min_gap_us:g} us")
    if idle:
        print(_table("host frame (self)", result["self"], idle, args.top))
        print()
        print(_table("host frame (inclusive)", result["inclusive"], idle, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
