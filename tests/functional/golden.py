"""Golden values: a run's training records in Megatron's golden layout, and the comparison.

Pure functions, no GPU and no training: ``tests/unit/test_functional_runner.py`` tests them.

Golden layout (``golden_values_h200.json``), as Megatron-LM's functional tests write it::

    {"lm loss": {"start_step": 1, "end_step": 50, "step_interval": 1,
                 "values": {"1": 6.93, "2": 6.91, ...}},
     "num-zeros": {...}, "iteration-time": {...}}

A training record is one line of the run's ``--metrics-file`` (``iteration``, ``lm_loss``,
``iteration_time_ms``, ...) with the values of that iteration's Megatron-LM log line added by
``tests/gpu/launch.run_training`` (``num_zeros`` with ``--log-num-zeros-in-grad``, the MoE
losses ``load_balancing_loss`` and ``z_loss``). ``iteration-time`` is in seconds, as Megatron
writes it (the metrics file has milliseconds). A golden file holds ``num-zeros`` and the MoE
losses only when the run reported them.

Golden files recorded on the fork's own loop may also hold ``mem-max-allocated-bytes`` and
``moe_dropped_token_fraction``: Megatron-LM's loop reports neither per iteration, so they are
no longer recorded or compared (the keys stay in old files until they are re-recorded).
"""

import json
import math
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path

# Golden metric name -> (training-record key, scale into the golden unit).
METRICS = {
    "lm loss": ("lm_loss", 1.0),
    "num-zeros": ("num_zeros", 1),
    "iteration-time": ("iteration_time_ms", 1e-3),
    "load_balancing_loss": ("load_balancing_loss", 1.0),
    "z_loss": ("z_loss", 1.0),
}
# Metrics a run reports only in some configurations (--log-num-zeros-in-grad, MoE): recorded
# when a record has them.
OPTIONAL = frozenset({"num-zeros", "load_balancing_loss", "z_loss"})

DEFAULT_COMPARED = ("lm loss", "num-zeros")
REDUCTIONS = ("step", "median")


@dataclass(frozen=True)
class Tolerance:
    """How one metric is compared: ``|now - golden| <= atol + rtol * |golden|``."""

    atol: float = 0.0
    """Absolute tolerance; 0 with rtol 0 means exact equality."""
    rtol: float = 0.0
    """Relative tolerance, a fraction of the golden value."""
    reduce: str = "step"
    """'step': every step must pass. 'median': only the medians over all steps are compared
    (iteration time: a few slow steps -- compilation, capture -- must not fail the case)."""

    @classmethod
    def from_dict(cls, metric: str, spec: dict, base: "Tolerance | None" = None) -> "Tolerance":
        """``{"atol": 2e-3}`` on top of ``base`` (the metric's default); rejects unknown keys."""
        known = {f.name for f in fields(cls)}
        if not isinstance(spec, dict) or set(spec) - known:
            raise ValueError(f"TOLERANCE[{metric!r}] is wrong: {spec!r}. Use a mapping with keys "
                             f"from {sorted(known)}.")
        values = dict(vars(base or cls()))
        for key, value in spec.items():
            values[key] = value if key == "reduce" else _number(f"TOLERANCE[{metric!r}].{key}",
                                                                 value)
        tol = cls(**values)
        if tol.reduce not in REDUCTIONS:
            raise ValueError(f"TOLERANCE[{metric!r}].reduce is wrong: {tol.reduce!r}. Use one of "
                             f"{', '.join(REDUCTIONS)}.")
        if tol.atol < 0 or tol.rtol < 0:
            raise ValueError(f"TOLERANCE[{metric!r}] is wrong: {spec!r}. atol and rtol must be "
                             ">= 0.")
        return tol

    def allows(self, golden: float, now: float) -> bool:
        if math.isnan(golden) or math.isnan(now):
            return math.isnan(golden) and math.isnan(now)
        return abs(now - golden) <= self.atol + self.rtol * abs(golden)

    def describe(self) -> str:
        if self.atol == 0 and self.rtol == 0:
            return "exact"
        parts = [f"{name} {getattr(self, name):g}" for name in ("atol", "rtol")
                 if getattr(self, name)]
        return " + ".join(parts) + (" on the median" if self.reduce == "median" else "")


# Megatron's defaults: losses and num-zeros exact; time within 5 % (median).
DEFAULT_TOLERANCES = {
    "lm loss": Tolerance(),
    "num-zeros": Tolerance(),
    "iteration-time": Tolerance(rtol=0.05, reduce="median"),
    "load_balancing_loss": Tolerance(),
    "z_loss": Tolerance(),
}


def _number(what: str, value) -> float:
    # PyYAML reads "2e-3" (no dot) as a string; accept it as the number it is meant to be.
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} is wrong: {value!r}. Use a number.") from None


def resolve_tolerances(overrides: dict | None) -> dict:
    """Default tolerance of every metric, with a case's ``TOLERANCE`` entries applied."""
    overrides = overrides or {}
    unknown = set(overrides) - set(METRICS)
    if unknown:
        raise ValueError(f"TOLERANCE is wrong: unknown metric {sorted(unknown)}. Use "
                         f"{', '.join(METRICS)}.")
    return {name: Tolerance.from_dict(name, overrides[name], DEFAULT_TOLERANCES[name])
            if name in overrides else DEFAULT_TOLERANCES[name] for name in METRICS}


# ------------------------------------------------------------------ metrics file -> golden

def concat_runs(runs: list) -> list:
    """Records of consecutive runs (a checkpoint-resume case) as one run.

    Each run must have written records, and iterations must increase strictly across them
    (a resumed run that repeats or skips back is an error, not something to paper over).
    """
    merged = []
    for index, records in enumerate(runs, 1):
        if not records:
            raise ValueError(f"run {index} is wrong: it wrote no training records. Read its log.")
        if merged and records[0]["iteration"] <= merged[-1]["iteration"]:
            raise ValueError(f"run {index} is wrong: it starts at iteration "
                             f"{records[0]['iteration']}, not after iteration "
                             f"{merged[-1]['iteration']} where run {index - 1} stopped. Check "
                             "--load and the checkpoint.")
        merged.extend(records)
    return merged


def metrics_to_golden(records: list) -> dict:
    """Training records -> the golden layout: every metric of ``METRICS`` (NaN where a record
    lacks it), except an ``OPTIONAL`` one that no record has."""
    if not records:
        raise ValueError("metrics is wrong: no training records. Read the run's log.")
    steps = [int(r["iteration"]) for r in records]
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"metrics is wrong: iterations are not strictly increasing: {steps}. "
                         "Delete a stale metrics file (the logger appends).")
    intervals = {b - a for a, b in zip(steps, steps[1:])} or {1}
    if len(intervals) > 1:
        raise ValueError(f"metrics is wrong: uneven steps {steps}. Log every --log-interval "
                         "steps with --train-iters a multiple of it.")
    interval = intervals.pop()
    golden = {}
    for name, (key, scale) in METRICS.items():
        if name in OPTIONAL and not any(key in record for record in records):
            continue
        values = {}
        for step, record in zip(steps, records):
            value = record.get(key)
            values[str(step)] = float("nan") if value is None else _scaled(value, scale)
        golden[name] = {"start_step": steps[0], "end_step": steps[-1],
                        "step_interval": interval, "values": values}
    return golden


def _scaled(value, scale):
    return value * scale if isinstance(scale, float) else int(value)


def read_golden(path) -> dict:
    with open(path) as f:
        return json.load(f)


def write_golden(path, golden: dict) -> None:
    """Write ``golden`` as JSON; floats round-trip exactly (``json`` writes ``repr``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(golden, f, indent=2)
        f.write("\n")


# ------------------------------------------------------------------------------ comparison

@dataclass(frozen=True)
class Row:
    step: str
    golden: float | None
    now: float | None
    ok: bool
    note: str = ""

    @property
    def diff(self) -> float | None:
        if self.golden is None or self.now is None:
            return None
        return abs(self.now - self.golden)


@dataclass(frozen=True)
class MetricResult:
    metric: str
    tolerance: Tolerance
    rows: list = field(default_factory=list)
    error: str = ""
    """Set when the metric could not be compared at all (absent from golden or run)."""

    @property
    def ok(self) -> bool:
        return not self.error and all(row.ok for row in self.rows)

    def summary(self) -> str:
        if self.error:
            return f"{self.metric}: {self.error}"
        bad = [row for row in self.rows if not row.ok]
        if not bad:
            return f"{self.metric}: ok ({self.tolerance.describe()}, {len(self.rows)} rows)"
        numeric = [row for row in bad if row.diff is not None]
        worst = max(numeric, key=lambda row: row.diff if not math.isnan(row.diff) else math.inf,
                    default=None)
        text = f"{self.metric}: {len(bad)} of {len(self.rows)} rows fail"
        if worst is not None:
            text += f" (worst |diff| {worst.diff:.3g} at step {worst.step}"
            text += f", allowed {self.tolerance.describe()})"
        notes = sorted({row.note for row in bad if row.note})
        return text + (f"; {', '.join(notes)}" if notes else "")


def compare_metric(metric: str, golden: dict, now: dict, tol: Tolerance,
                   steps: int | None = None) -> MetricResult:
    """Compare one metric's golden entry with the run's; ``steps`` keeps only steps <= it.

    A golden step the run lacks is 'missing', a run step the golden file lacks is 'extra';
    both fail.
    """
    expected = _values(golden, steps)
    actual = _values(now, steps)
    if tol.reduce == "median":
        common = sorted(set(expected) & set(actual), key=int)
        rows = []
        if common:
            g = statistics.median(expected[s] for s in common)
            n = statistics.median(actual[s] for s in common)
            rows.append(Row("median", g, n, tol.allows(g, n)))
        rows += _unmatched(expected, actual)
        return MetricResult(metric, tol, rows)
    rows = []
    for step in sorted(set(expected) | set(actual), key=int):
        if step not in actual:
            rows.append(Row(step, expected[step], None, False, "missing steps"))
        elif step not in expected:
            rows.append(Row(step, None, actual[step], False, "extra steps"))
        else:
            rows.append(Row(step, expected[step], actual[step],
                            tol.allows(expected[step], actual[step])))
    return MetricResult(metric, tol, rows)


def _values(entry: dict, steps: int | None) -> dict:
    return {str(s): float(v) for s, v in entry["values"].items()
            if steps is None or int(s) <= steps}


def _unmatched(expected: dict, actual: dict) -> list:
    rows = [Row(s, expected[s], None, False, "missing steps") for s in expected if s not in actual]
    rows += [Row(s, None, actual[s], False, "extra steps") for s in actual if s not in expected]
    return sorted(rows, key=lambda row: int(row.step))


def compare(golden: dict, now: dict, metrics, tolerances: dict,
            steps: int | None = None) -> list:
    """One ``MetricResult`` per name in ``metrics``."""
    results = []
    for metric in metrics:
        tol = tolerances[metric]
        if metric not in golden:
            results.append(MetricResult(metric, tol, error="not in the golden file; re-record "
                                                           "with --record"))
        elif metric not in now:
            results.append(MetricResult(metric, tol, error="not in the run's metrics"))
        else:
            results.append(compare_metric(metric, golden[metric], now[metric], tol, steps))
    return results


def format_report(results: list) -> str:
    """Per-metric table (step, golden, now, |diff|, ok), then a one-line summary per metric."""
    lines = []
    for result in results:
        lines.append(f"== {result.metric} ({result.tolerance.describe()})")
        if result.error:
            lines.append(f"   {result.error}")
            continue
        lines.append(f"{'step':>8} {'golden':>16} {'now':>16} {'|diff|':>10}  ok")
        for row in result.rows:
            lines.append(f"{row.step:>8} {_fmt(row.golden):>16} {_fmt(row.now):>16} "
                         f"{_fmt(row.diff, '.3g'):>10}  {'ok' if row.ok else 'FAIL'}"
                         + (f"  {row.note}" if row.note else ""))
    lines.append("")
    lines += [result.summary() for result in results]
    return "\n".join(lines)


def _fmt(value, spec: str = ".8g") -> str:
    return "-" if value is None else format(value, spec)
