"""Where does a graphed step spend more GPU time than eager? GPU time per kernel, two runs.

Reads the Chrome traces of two runs of the same preset, an eager one and a graphed one
(``--profile --profile-trace-dir DIR`` in training; ``tools/benchmark.py --profile
--keep-traces DIR`` keeps them per preset and variant), sums GPU time per kernel and per
kernel family (attention forward / backward, GEMM, RoPE, Mamba scan / conv, norm,
elementwise, NCCL, memcpy / memset, ...), divides by the profiled steps and prints Markdown
tables sorted by how much more time the graphed run spends:

    python tools/kernel_time_diff.py TRACES/gpt-16x1024x4096/eager \
        TRACES/gpt-16x1024x4096/layer-graphs --top 25

Each side is one trace file or a directory of ``trace_iter<N>_rank<R>.json`` files (the
rank's files, ``--rank``). A file from ``--profile-trace-dir`` holds one iteration; a trace
with ``ProfilerStep#<N>`` annotations (torch.profiler's schedule) holds one step per
annotation. Kernel names are matched without template arguments or parameter lists, so the
same kernel matches when its instantiation differs; generic launchers (PyTorch's elementwise
and reduce kernels, multi_tensor_apply, CUTLASS's ``Kernel``) keep their functor or inner
kernel in brackets.

The totals give each run's GPU-busy time per step (union of kernel intervals, as
tools/benchmark.py reports it), its summed GPU time (kernels, copies, memsets; overlapping
work counted twice) and the share of kernel time launched from CUDA graphs (a kernel with a
``graph id`` in its trace arguments, or one whose correlation id is a ``cudaGraphLaunch``'s;
"-" when the trace has neither graph ids nor CUDA runtime events).

A missing, unreadable or cut-off trace, a directory without the rank's traces, or a trace
without GPU kernels is named in one line on stderr, with exit status 1.
"""

import argparse
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_gaps import GPU_CATEGORIES, idle_gaps, read_trace  # noqa: E402

TRACE_FILE = re.compile(r"trace_iter(\d+)_rank(\d+)\.json$")
PROFILER_STEP = re.compile(r"ProfilerStep#\d+$")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")

# Launchers whose own name says little: the functor (elementwise, reduce, multi-tensor) or
# inner kernel (CUTLASS) in their template arguments tells them apart.
GENERIC_LAUNCHERS = {"elementwise_kernel", "vectorized_elementwise_kernel",
                     "unrolled_elementwise_kernel", "elementwise_kernel_with_index",
                     "index_elementwise_kernel", "reduce_kernel", "multi_tensor_apply_kernel",
                     "Kernel", "Kernel2", "device_kernel"}
WRAPPER_FUNCTORS = {"BinaryFunctor", "AUnaryFunctor", "BUnaryFunctor", "UnaryFunctor"}
_FUNCTOR = re.compile(r"\b(\w*(?:Functor|_functor)\w*)")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")

# (family, pattern on the lower-cased raw name); the first match wins, so the specific
# families (attention, whose kernels carry CUTLASS and softmax in their template
# arguments) come before the generic ones (GEMM, elementwise).
FAMILIES: List[Tuple[str, re.Pattern]] = [(name, re.compile(pattern)) for name, pattern in [
    ("NCCL", r"nccl"),
    ("attention bwd", r"flash_bwd|fmha.*(bwd|bprop)|bprop|dot_do_o|convert_dq|attn_bwd"
                      r"|sdpa.*backward"),
    ("attention fwd", r"flash_fwd|fmha|fprop|sdpa|attn_fwd|flash_attn|fused_attn"),
    ("RoPE", r"(^|[^a-z])rope|rotary"),  # not "property"
    ("Mamba scan", r"chunk_scan|chunk_state|state_passing|chunk_cumsum|bmm_chunk|ssd_|"
                   r"selective_scan|mamba"),
    ("Mamba conv", r"causal_conv1d|conv1d"),
    ("norm", r"layer_?norm|rms_?norm|_norm_fwd|_norm_bwd|ln_fwd|ln_bwd|normalization"),
    ("optimizer", r"adam|multi_tensor|l2norm"),
    ("loss / softmax", r"cross_entropy|nll_loss|softmax|logsumexp"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|wgmma|s16816|s1688|matmul"),
    ("index / gather / scatter", r"index|gather|scatter|embedding"),
    ("copy / cat", r"copy|catarray|cat_"),
    ("elementwise", r"elementwise|triton_poi|fill"),
    ("reduction", r"reduce|triton_red|triton_per"),
]]


def split_name(name: str) -> Tuple[str, str]:
    """A demangled kernel name -> (qualified name without template arguments or parameter
    list, the outermost template arguments' text). ``void ns::k<4, F<float>>(int, F)`` ->
    ``("ns::k", "4, F<float>")``."""
    name = name.replace("(anonymous namespace)::", "").strip()
    if name.startswith("void "):
        name = name[len("void "):]
    head, template, depth = [], [], 0
    for char in name:
        if depth == 0 and char == "(":
            break  # the parameter list
        if char == "<":
            depth += 1
            if depth == 1:
                continue
        elif char == ">" and depth:
            depth -= 1
            if depth == 0:
                template.append("\x00")  # separates several template lists
                continue
        (template if depth else head).append(char)
    first = "".join(template).split("\x00")[0]
    return "".join(head).strip(), first.strip()


def kernel_key(name: str) -> str:
    """The name that matches a kernel across runs (see the module docstring)."""
    base, template = split_name(name)
    if base.split("::")[-1] not in GENERIC_LAUNCHERS or not template:
        return base
    functors = [f for f in _FUNCTOR.findall(template) if f not in WRAPPER_FUNCTORS]
    if functors:
        detail = functors[-1]
    elif "(" in template:  # a lambda: name the function that defines it
        detail = template[:template.index("(")].split("::")[-1]
    else:
        words = [w for w in _IDENTIFIER.findall(template)
                 if w not in ("at", "native", "std", "c10", "cutlass", "unsigned", "int")]
        detail = words[0] if words else ""
    return f"{base}[{detail}]" if detail else base


def kernel_family(name: str, category: str = "kernel") -> str:
    """The family of a GPU event: its trace category for copies and memsets, else the first
    FAMILIES pattern its raw name matches ("other" when none does)."""
    if category == "gpu_memcpy":
        return "memcpy"
    if category == "gpu_memset":
        return "memset"
    lower = name.lower()
    return next((family for family, pattern in FAMILIES if pattern.search(lower)), "other")


@dataclass
class KernelTimes:
    """GPU time of one run, summed over its traces. Times in microseconds, not per step."""

    steps: int = 0
    time_us: Dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    family: Dict[str, str] = field(default_factory=dict)
    busy_us: float = 0.0  # union of kernel intervals, per trace, summed
    kernel_us: float = 0.0  # category "kernel" only
    graphed_us: Optional[float] = 0.0  # None: the traces cannot tell

    def per_step(self, us: float) -> float:
        """``us`` in milliseconds per profiled step."""
        return us / self.steps / 1000.0


def trace_steps(events: List[dict]) -> int:
    """Steps a trace holds: its distinct ProfilerStep#N annotations, else one."""
    return len({e["name"] for e in events if PROFILER_STEP.match(str(e.get("name", "")))}) or 1


def _graph_correlations(events: List[dict]) -> Optional[set]:
    """Correlation ids of the trace's graph launches; None when it has no CUDA runtime or
    driver events (recorded without CPU activity) to tell."""
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    if not host:
        return None
    return {e.get("args", {}).get("correlation") for e in host
            if str(e.get("name", "")).startswith(GRAPH_LAUNCHES)}


def _graph_id(event: dict) -> bool:
    args = event.get("args", {})
    return bool(args.get("graph id") or args.get("graph node id"))


def add_trace(times: KernelTimes, trace: dict, path: str = "trace") -> None:
    """Add one trace's GPU events to ``times``; ValueError when it has no GPU kernels."""
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    gpu = [e for e in events if e.get("ph") == "X" and "dur" in e
           and e.get("cat") in GPU_CATEGORIES]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    if not kernels:
        raise ValueError(f"trace is wrong: {path} holds no GPU kernels. Record it with CUDA "
                         f"activity (--profile --profile-trace-dir on a GPU run).")
    times.steps += trace_steps(events)
    for e in gpu:
        key = kernel_key(e["name"]) if e["cat"] == "kernel" else e["name"]
        times.time_us[key] += e["dur"]
        times.calls[key] += 1
        times.family.setdefault(key, kernel_family(e["name"], e["cat"]))
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    span = max(b for _, b in intervals) - min(a for a, _ in intervals)
    times.busy_us += span - sum(b - a for a, b in idle_gaps(intervals, 0.0))
    times.kernel_us += sum(e["dur"] for e in kernels)
    launches = _graph_correlations(events)
    with_ids = any(_graph_id(e) for e in kernels)
    if launches is None and not with_ids:
        times.graphed_us = None
    elif times.graphed_us is not None:
        times.graphed_us += sum(e["dur"] for e in kernels if _graph_id(e) or (
            launches and e.get("args", {}).get("correlation") in launches))


def trace_files(path: str, rank: int) -> List[str]:
    """``path`` itself, or the rank's ``trace_iter<N>_rank<R>.json`` files in directory
    ``path``, by iteration; ValueError when the directory holds none."""
    if not os.path.isdir(path):
        return [path]
    found = sorted((int(m.group(1)), os.path.join(path, name)) for name in os.listdir(path)
                   if (m := TRACE_FILE.match(name)) and int(m.group(2)) == rank)
    if not found:
        raise ValueError(f"trace directory is wrong: {path} holds no trace_iter<N>_rank{rank}"
                         f".json. Pass a --profile-trace-dir (or --keep-traces) directory, or "
                         f"another --rank.")
    return [file for _, file in found]


def load(path: str, rank: int = 0) -> KernelTimes:
    """Kernel times of a trace file or a directory of one rank's traces."""
    times = KernelTimes()
    for file in trace_files(path, rank):
        add_trace(times, read_trace(file), file)
    return times


def _share(delta: float, total: float) -> str:
    return f"{delta / total:.0%}" if abs(total) > 1e-9 else "-"


def _totals(eager: KernelTimes, graph: KernelTimes) -> str:
    def row(label, a, b):
        relative = f" ({(b - a) / a:+.1%})" if a else ""
        return f"| {label} | {a:.2f} | {b:.2f} | {b - a:+.2f}{relative} |"

    def graphed(t):
        return "-" if t.graphed_us is None else f"{t.graphed_us / t.kernel_us:.0%}"

    summed = lambda t: sum(t.time_us.values())
    return "\n".join([
        "| per step | eager | graph | delta |", "| --- | ---: | ---: | ---: |",
        row("GPU busy (ms, union of kernels)", eager.per_step(eager.busy_us),
            graph.per_step(graph.busy_us)),
        row("GPU time (ms, summed)", eager.per_step(summed(eager)), graph.per_step(summed(graph))),
        f"| kernel time launched from CUDA graphs | {graphed(eager)} | {graphed(graph)} | |",
        f"| profiled steps | {eager.steps} | {graph.steps} | |"])


def _rows(eager: Dict[str, float], graph: Dict[str, float]) -> List[Tuple[str, float, float]]:
    """(name, eager, graph) for every name of either side, largest growth first."""
    names = set(eager) | set(graph)
    rows = [(n, eager.get(n, 0.0), graph.get(n, 0.0)) for n in names]
    return sorted(rows, key=lambda r: (-(r[2] - r[1]), r[0]))


def report(eager: KernelTimes, graph: KernelTimes, top: int = 25) -> str:
    """The three Markdown tables: totals, families, and the ``top`` kernels that changed most
    (by absolute delta), largest growth first. Times in ms per step; the share is of the
    summed GPU-time delta."""
    def per_step(t: KernelTimes, values: Dict[str, float]) -> Dict[str, float]:
        return {k: t.per_step(v) for k, v in values.items()}

    def by_family(t: KernelTimes) -> Dict[str, float]:
        out = defaultdict(float)
        for key, us in t.time_us.items():
            out[t.family[key]] += t.per_step(us)
        return out

    kernels_a, kernels_b = per_step(eager, eager.time_us), per_step(graph, graph.time_us)
    total = sum(kernels_b.values()) - sum(kernels_a.values())
    lines = [_totals(eager, graph), "",
             "| family | eager (ms/step) | graph (ms/step) | delta (ms/step) | share of delta |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, a, b in _rows(by_family(eager), by_family(graph)):
        lines.append(f"| {name} | {a:.3f} | {b:.3f} | {b - a:+.3f} | {_share(b - a, total)} |")
    kernels = _rows(kernels_a, kernels_b)
    shown = {r[0] for r in sorted(kernels, key=lambda r: -abs(r[2] - r[1]))[:top]}
    lines += ["", "| family / kernel | eager (ms/step) | graph (ms/step) | delta (ms/step) | "
                  "share of delta | calls/step (eager, graph) |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    family = {**eager.family, **graph.family}
    for name, a, b in (r for r in kernels if r[0] in shown):
        calls = (f"{eager.calls.get(name, 0) / eager.steps:g}, "
                 f"{graph.calls.get(name, 0) / graph.steps:g}")
        lines.append(f"| {family[name]} / `{name[:100]}` | {a:.3f} | {b:.3f} | {b - a:+.3f} | "
                     f"{_share(b - a, total)} | {calls} |")
    if len(kernels) > len(shown):
        lines.append(f"\n{len(kernels) - len(shown)} more kernels changed less (--top).")
    return "\n".join(lines)


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is wrong: it must be at least 1")
    return number


def _rank(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value} is wrong: ranks start at 0")
    return number


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("eager", help="trace file or trace directory of the eager run")
    parser.add_argument("graph", help="trace file or trace directory of the graphed run")
    parser.add_argument("--rank", type=_rank, default=0, help="rank whose traces a directory gives")
    parser.add_argument("--top", type=_positive, default=25,
                        help="kernels listed (those whose time changed most)")
    args = parser.parse_args(argv)
    try:
        eager, graph = load(args.eager, args.rank), load(args.graph, args.rank)
    except ValueError as error:
        print(f"kernel_time_diff: {error}", file=sys.stderr)
        return 1
    print(report(eager, graph, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
