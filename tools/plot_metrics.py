"""Plot the loss curves (and step time) of training runs, as a PNG to look at.

Reads the JSON-lines metrics files that ``--metrics-file`` writes (megatron/packed_training/metrics.py:
one object per training iteration, one with ``"split": "valid"`` per evaluation) and, if
given, a golden-values file in Megatron's layout
(``{"lm loss": {"start_step": 1, "end_step": N, "step_interval": 1, "values": {"1": 10.5}}}``).

    python tools/plot_metrics.py runs/eager/logs/metrics.jsonl:eager \\
        runs/graphs/logs/metrics.jsonl:graphs --golden golden_values.json --step-time \\
        --out loss.png

Each run is ``PATH[:LABEL]`` (the label defaults to the file name without its extension).
Training loss is a line per run, validation loss markers of the same colour, the golden
values a dashed black line; ``--step-time`` adds a panel of ``iteration_time_ms`` per run with
its median in the legend. Needs matplotlib (``pip install -e ".[plot]"``), not torch.

A missing, unreadable or cut-off input file (a metrics line that is not complete JSON, e.g.
while its run is still writing) is named in one line on stderr, with exit status 1.
"""

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

Curve = Tuple[List[int], List[float]]  # (steps, values), steps ascending

# The golden-values metric drawn as the reference (Megatron's functional-test key).
GOLDEN_METRIC = "lm loss"


class InputFileError(ValueError):
    """An input file is missing, unreadable or not complete JSON; the message names it."""


@dataclass(frozen=True)
class Run:
    """One run's curves, ready to plot."""

    label: str
    loss: Curve
    """Training ``lm_loss`` per iteration."""
    valid_loss: Curve
    """Validation ``lm_loss`` per evaluation (empty without evaluation)."""
    step_time: Curve
    """Training ``iteration_time_ms`` per iteration."""


def _open_text(path: str, what: str):
    try:
        return open(path)
    except FileNotFoundError:
        raise InputFileError(f"{what} is wrong: {path} does not exist. Check the path.") from None
    except OSError as error:
        raise InputFileError(f"{what} is wrong: {path} cannot be read ({error.strerror}). "
                             f"Check the path and its permissions.") from None


def read_records(path: str) -> List[dict]:
    """Every record of a metrics file, in file order (the format of ``metrics.read_metrics``,
    read here without importing torch). Raises InputFileError naming the file and line when
    the file is missing or a line is not a complete JSON object (a truncated file)."""
    records = []
    with _open_text(path, "metrics file") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputFileError(
                    f"metrics file is wrong: {path} line {number} is not complete JSON "
                    f"({error.msg}): the file is truncated or not a --metrics-file. Pass a "
                    f"complete metrics file.") from None
            if not isinstance(record, dict):
                raise InputFileError(f"metrics file is wrong: {path} line {number} is not a JSON "
                                     f"object. Pass a --metrics-file of a training run.")
            records.append(record)
    return records


def read_golden(path: str) -> dict:
    """A golden-values JSON file; InputFileError naming it when missing or not JSON."""
    with _open_text(path, "golden values file") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as error:
            raise InputFileError(
                f"golden values file is wrong: {path} is not complete JSON ({error.msg} at line "
                f"{error.lineno}): the file is truncated or not a golden-values file. Pass a "
                f"complete Megatron golden-values file.") from None


def curve_from_records(records: Sequence[dict], key: str = "lm_loss",
                       split: str = "train") -> Curve:
    """``(steps, values)`` of ``key`` over the records of ``split`` (records without a split
    are training records; records without ``key`` are skipped). A step logged twice (a run
    appended to the same file after a restart) keeps its last value."""
    by_step = {}
    for record in records:
        if record.get("split", "train") == split and key in record:
            by_step[int(record["iteration"])] = float(record[key])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def load_curve(path: str, key: str = "lm_loss", split: str = "train") -> Curve:
    """``(steps, values)`` of ``key`` for ``split`` ("train" or "valid") of a metrics file."""
    return curve_from_records(read_records(path), key, split)


def load_run(path: str, label: Optional[str] = None) -> Run:
    """A metrics file's curves; ``label`` defaults to the file name without its extension."""
    records = read_records(path)
    return Run(
        label=label or os.path.splitext(os.path.basename(path))[0],
        loss=curve_from_records(records, "lm_loss", "train"),
        valid_loss=curve_from_records(records, "lm_loss", "valid"),
        step_time=curve_from_records(records, "iteration_time_ms", "train"),
    )


def golden_curve(golden: dict, metric: str = GOLDEN_METRIC) -> Curve:
    """``(steps, values)`` of ``metric`` in a Megatron golden-values dict. ``values`` is a
    ``{"step": value}`` dict, or (older files) a list over ``range(start_step, end_step + 1,
    step_interval)``; ``"nan"`` entries are kept as NaN (a gap in the line)."""
    if metric not in golden:
        raise ValueError(f"golden values is wrong: no {metric!r} key (keys: "
                         f"{sorted(golden)}). Pass a Megatron golden-values file.")
    entry = golden[metric]
    values = entry["values"]
    if isinstance(values, dict):
        steps = sorted(int(s) for s in values)
        return steps, [float(values[str(s)]) for s in steps]
    steps = list(range(entry["start_step"], entry["end_step"] + 1, entry.get("step_interval", 1)))
    return steps[:len(values)], [float(v) for v in values[:len(steps)]]


def parse_run_spec(spec: str) -> Tuple[str, Optional[str]]:
    """``PATH[:LABEL]`` -> ``(path, label or None)``; a path that exists is never split."""
    if ":" in spec and not os.path.exists(spec):
        path, label = spec.rsplit(":", 1)
        return path, label or None
    return spec, None


def _step_time_top(runs: Sequence[Run]) -> Optional[float]:
    """Upper y limit of the step-time panel: 1.5 x the largest P95, so that the warm-up and
    capture iterations (often 10-100x slower) do not flatten every other step."""
    p95 = []
    for run in runs:
        values = sorted(v for v in run.step_time[1] if math.isfinite(v))
        if values:
            p95.append(values[min(len(values) - 1, int(0.95 * len(values)))])
    return 1.5 * max(p95) if p95 else None


def plot(runs: Sequence[Run], out: str, golden: Optional[Curve] = None,
         step_time: bool = False) -> None:
    """Write a PNG to ``out``: loss per run (validation as markers, ``golden`` dashed) and,
    with ``step_time``, a second panel of step time per run. Uses the Agg canvas directly
    (no pyplot, no display, no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 8 if step_time else 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 if step_time else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        ax.plot(*run.loss, color=color, linewidth=1.2, label=run.label)
        if run.valid_loss[0]:
            ax.plot(*run.valid_loss, linestyle="none", marker="o", markersize=5, color=color,
                    markeredgecolor="black", label=f"{run.label} (valid)")
    if golden is not None:
        ax.plot(*golden, color="black", linestyle="--", linewidth=1.2, label="golden")
    ax.set_ylabel("lm loss")
    ax.set_title("Loss")
    ax.grid(True, alpha=0.3)
    ax.legend()

    if step_time:
        ax = axes[1]
        for i, run in enumerate(runs):
            steps, values = run.step_time
            finite = [v for v in values if math.isfinite(v)]
            median = f" (median {statistics.median(finite):.1f} ms)" if finite else ""
            ax.plot(steps, values, color=f"C{i % 10}", linewidth=1.0,
                    label=f"{run.label}{median}")
        top = _step_time_top(runs)
        if top is not None:
            ax.set_ylim(0, top)
            if any(v > top for run in runs for v in run.step_time[1]):
                ax.set_title("Step time (warm-up / capture steps above the axis are cut off)")
            else:
                ax.set_title("Step time")
        ax.set_ylabel("iteration time (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[-1].set_xlabel("iteration")
    fig.savefig(out, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN.jsonl[:LABEL]",
                        help="metrics files (--metrics-file), each with an optional label")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--golden", default=None,
                        help=f"Megatron golden-values JSON; its {GOLDEN_METRIC!r} is drawn dashed")
    parser.add_argument("--step-time", action="store_true",
                        help="add a panel of iteration_time_ms per run")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runs = [load_run(*parse_run_spec(spec)) for spec in args.runs]
        golden = golden_curve(read_golden(args.golden)) if args.golden else None
    except (InputFileError, ValueError) as error:
        print(f"plot_metrics: {error}", file=sys.stderr)
        return 1
    for run in runs:
        if not run.loss[0]:
            print(f"warning: {run.label}: no training records with lm_loss", file=sys.stderr)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    plot(runs, args.out, golden=golden, step_time=args.step_time)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
