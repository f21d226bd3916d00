"""Long-run check of graphed training beside eager training of the same seed.

Trains a benchmark preset for --steps iterations once eagerly and once per graph variant,
each run on its own GPU at the same time (the eager run on the first GPU, variants on the
next ones, round-robin), then checks every graph run against the eager one:

* no NaN or Inf loss or gradient norm;
* the loss curve stays within --loss-atol of eager, compared as means over windows of
  --window steps (bf16 runs of different kernels drift apart step by step; a graph bug
  moves the mean by far more);
* no memory growth: allocated and reserved bytes at the last step are at most those at
  --memory-from (after capture and warm-up), plus --memory-slack-mib.

    python tools/soak.py --preset hybrid-small --variants chunk-graphs te-layer-graphs \\
        --steps 1000

Prints a Markdown table, headed by the machine, date, software and command, and exits 1
when a check fails.

The runs use tools/benchmark.py's launch flags (Megatron-LM's command line). The loss comes
from each run's metrics file; the gradient norm and memory, which the metrics file no longer
holds, from Megatron-LM's log: its iteration line (``grad norm: x``, every iteration at
``--log-interval 1``) and its memory report, asked for at --memory-from and at the last step
(``--log-memory-interval``, their greatest common divisor).
"""

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.benchmark import (  # noqa: E402
    COMMON,
    PRESETS,
    VARIANTS,
    memory_reports,
    position_limit,
    read_metrics,
    run_header,
)

# Megatron-LM's training log line: `` [date] iteration N/ M | ... | grad norm: 1.234 | ...``.
ITERATION_LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|(.*)$")
GRAD_NORM = re.compile(r"\|\s*grad norm:\s*([^|\s]+)\s*\|")


def log_values(log: str) -> dict:
    """Per iteration, what Megatron-LM's log holds and the metrics file does not:
    ``{N: {"grad_norm": x, "mem_allocated_bytes": ..., "mem_reserved_bytes": ..., ...}}``
    (memory at the iterations it reported, `benchmark.memory_reports`; a later report of the
    same iteration wins)."""
    values: dict = {}
    for line in log.splitlines():
        match = ITERATION_LINE.search(line)
        norm = GRAD_NORM.search("|" + match.group(2)) if match else None
        if norm:
            values.setdefault(int(match.group(1)), {})["grad_norm"] = float(norm.group(1))
    for report in memory_reports(log):
        values.setdefault(report["iteration"], {}).update(
            {k: v for k, v in report.items() if k != "iteration"})
    return values


def with_log_values(records: list, log: str) -> list:
    """Training records of a metrics file with their iterations' `log_values` added."""
    values = log_values(log)
    return [r | values.get(r["iteration"], {}) for r in records
            if r.get("split", "train") == "train"]


def window_means(values: list, window: int) -> list:
    """Means of consecutive ``window``-long slices (a shorter tail slice is dropped)."""
    return [statistics.fmean(values[i:i + window])
            for i in range(0, len(values) - window + 1, window)]


def check_run(graphs: list, eager: list, *, window: int, loss_atol: float, memory_from: int,
              memory_slack_mib: float) -> dict:
    """Compare one graph run's train records with the eager run's. Returns the table row;
    ``row["failures"]`` lists what failed (empty when it passed)."""
    failures = []
    finite = all(math.isfinite(r["lm_loss"]) and math.isfinite(r.get("grad_norm", 0.0))
                 for r in graphs)
    if not finite:
        failures.append("NaN or Inf loss or grad norm")
    no_norm = [r["iteration"] for r in graphs if "grad_norm" not in r]
    if no_norm:
        failures.append(f"no grad norm logged at {len(no_norm)} iterations (first: "
                        f"{no_norm[0]})")
    if len(graphs) != len(eager):
        failures.append(f"{len(graphs)} iterations logged, eager logged {len(eager)}")
    graph_means = window_means([r["lm_loss"] for r in graphs], window)
    eager_means = window_means([r["lm_loss"] for r in eager], window)
    loss_gap = max((abs(g - e) for g, e in zip(graph_means, eager_means)), default=math.nan)
    if not loss_gap <= loss_atol:
        failures.append(f"windowed loss differs from eager by {loss_gap:.2e} > {loss_atol:.1e}")
    step_gap = max(abs(g["lm_loss"] - e["lm_loss"]) for g, e in zip(graphs, eager))
    at = {r["iteration"]: r for r in graphs}
    start, end = at.get(memory_from), graphs[-1]
    growth = {}
    for key in ("mem_allocated_bytes", "mem_reserved_bytes"):
        if start is None or key not in start:
            failures.append(f"no {key} at iteration {memory_from}")
            continue
        if key not in end:
            failures.append(f"no {key} at iteration {end['iteration']}")
            continue
        growth[key] = (end[key] - start[key]) / 2**20
        if growth[key] > memory_slack_mib:
            failures.append(f"{key} grew by {growth[key]:.1f} MiB from iteration "
                            f"{memory_from} to {end['iteration']}")
    return {"steps": len(graphs), "finite": finite, "window_gap": loss_gap, "step_gap": step_gap,
            "allocated_growth_mib": growth.get("mem_allocated_bytes", math.nan),
            "reserved_growth_mib": growth.get("mem_reserved_bytes", math.nan),
            "final_loss": graphs[-1]["lm_loss"] if graphs else math.nan,
            "eager_final_loss": eager[-1]["lm_loss"] if eager else math.nan,
            "failures": failures}


def launch_command(preset: str, variant: str, args, metrics: str) -> list:
    """One run's torchrun command: the preset, the variant, every iteration logged and the
    memory reported at --memory-from and at the last step."""
    script, model_flags = PRESETS[preset]
    flags = [*model_flags, *COMMON, *VARIANTS[variant], "--train-iters", str(args.steps),
             "--global-batch-size", str(args.global_batch_size), "--log-interval", "1",
             "--log-memory-interval", str(math.gcd(args.memory_from, args.steps)),
             "--mock-doc-length-median", str(args.doc_length_median),
             "--metrics-file", metrics, *args.extra_args.split()]
    # --standalone: torchrun's rendezvous binds a free port itself (runs start side by side).
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "1", os.path.join(REPO, script), *flags, *position_limit(flags)]


def _launch(preset: str, variant: str, args, gpu: int, metrics: str, log) -> subprocess.Popen:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    return subprocess.Popen(launch_command(preset, variant, args, metrics), cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def run_records(out: str, variant: str) -> list:
    """A finished run's training records, with the grad norm and memory of its log."""
    with open(os.path.join(out, f"{variant}.log"), errors="replace") as f:
        log = f.read()
    return with_log_values(read_metrics(os.path.join(out, f"{variant}.jsonl")), log)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="hybrid-small", choices=sorted(PRESETS))
    parser.add_argument("--variants", nargs="+", default=["chunk-graphs", "te-layer-graphs"],
                        choices=sorted(v for v in VARIANTS if v != "eager"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--doc-length-median", type=int, default=512)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--loss-atol", type=float, default=5e-3,
                        help="the functional tests' lm-loss tolerance")
    parser.add_argument("--memory-from", type=int, default=100)
    parser.add_argument("--memory-slack-mib", type=float, default=0.0)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to spread runs over")
    parser.add_argument("--log-dir", default=None, help="keep each run's log and metrics here")
    parser.add_argument("--extra-args", default="", help="more training flags for every run")
    args = parser.parse_args(argv)
    if args.steps <= args.memory_from:
        parser.error(f"--steps is wrong: {args.steps}. It must exceed --memory-from "
                     f"({args.memory_from}).")

    import torch

    gpus = args.gpus or max(torch.cuda.device_count(), 1)
    out = args.log_dir or tempfile.mkdtemp(prefix="soak-")
    os.makedirs(out, exist_ok=True)
    runs = ["eager", *args.variants]
    procs = {}
    for i, variant in enumerate(runs):
        log = open(os.path.join(out, f"{variant}.log"), "w")
        procs[variant] = (_launch(args.preset, variant, args, i % gpus,
                                  os.path.join(out, f"{variant}.jsonl"), log), log)
    failed_runs = []
    for variant, (proc, log) in procs.items():
        if proc.wait() != 0:
            failed_runs.append(variant)
        log.close()
    if failed_runs:
        for variant in failed_runs:
            with open(os.path.join(out, f"{variant}.log")) as f:
                print(f"--- {variant} failed ---\n{f.read()[-4000:]}")
        return 1
    eager = run_records(out, "eager")
    print(run_header(sys.argv[1:] if argv is None else argv, "tools/soak.py"))
    print(f"| {args.preset}, {args.steps} steps | loss gap, {args.window}-step means | "
          "max step gap | final loss (eager) | allocated growth (MiB) | reserved growth (MiB) "
          "| verdict |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    ok = True
    for variant in args.variants:
        row = check_run(run_records(out, variant), eager,
                        window=args.window, loss_atol=args.loss_atol,
                        memory_from=args.memory_from, memory_slack_mib=args.memory_slack_mib)
        ok &= not row["failures"]
        print(f"| {variant} | {row['window_gap']:.2e} | {row['step_gap']:.2e} | "
              f"{row['final_loss']:.4f} ({row['eager_final_loss']:.4f}) | "
              f"{row['allocated_growth_mib']:.1f} | {row['reserved_growth_mib']:.1f} | "
              f"{'; '.join(row['failures']) or 'pass'} |")
    print(f"logs and metrics: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
