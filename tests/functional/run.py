"""Run one functional-test case: train, collect the metrics file, compare or record.

    python -m tests.functional.run gpt/gpt_eager             # compare with the golden values
    python -m tests.functional.run gpt/gpt_eager --record    # write golden_values_h200.json
    python -m tests.functional.run gpt/gpt_eager --steps 10  # first 10 steps only
    python -m tests.functional.run --list

Exit status: 0 pass (or recorded), 1 mismatch / failed run / no golden values / no GPU,
2 bad command line or case file. See docs/functional-tests.md.
"""

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from tests.functional import golden as gv
from tests.functional.case import (
    CASES_ROOT,
    GOLDEN_NAME,
    case_variables,
    expand_env,
    list_cases,
    load_case,
    plan_runs,
    resolve_case,
)

NO_GOLDEN = "no golden values: run with --record on the H200"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.functional.run",
        description="Run a functional-test case (docs/functional-tests.md).")
    parser.add_argument("case", nargs="?", help="'<model>/<case>' or a path under "
                                                "tests/functional/cases")
    parser.add_argument("--list", action="store_true", help="List the cases and exit.")
    parser.add_argument("--record", action="store_true",
                        help=f"Write the run's values to the case's {GOLDEN_NAME} instead of "
                             "comparing.")
    parser.add_argument("--steps", type=int, default=None,
                        help="Train only the first N iterations (--exit-interval; the LR "
                             "schedule is unchanged) and compare those.")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="Where checkpoints, metrics files and logs go (default: "
                             "$TMPDIR/functional-tests/<model>/<case>).")
    return parser


def describe_cases(root: Path = CASES_ROOT) -> str:
    """One line per case: name, script, GPUs, test type, where its golden values stand."""
    lines = []
    for name in list_cases(root):
        case = load_case(root / name, root)
        state = "recorded" if case.golden.is_file() else "none"
        if case.shares_golden:
            state = f"shares {case.golden.relative_to(root).as_posix()} ({state})"
        lines.append(f"{name:34} {case.script:18} NPROC {case.nproc}  {case.test_type:12} "
                     f"golden: {state}")
    return "\n".join(lines)


def prepare_workdir(workdir: Path, plans: list) -> None:
    """Remove what a previous run of this case left: the logger appends to metrics files and
    a stale checkpoint would be resumed from."""
    workdir.mkdir(parents=True, exist_ok=True)
    for sub in ("checkpoints", "tensorboard"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    for plan in plans:
        for suffix in (".jsonl", ".log"):
            (workdir / f"{plan.name}{suffix}").unlink(missing_ok=True)


def train(case, plans: list, env: dict, workdir: Path) -> list:
    """Run the plans in order with torchrun; the training records of all runs, concatenated.

    A record is a line of the run's --metrics-file (lm_loss, iteration_time_ms, ...) with the
    values of that iteration's Megatron-LM log line (num_zeros, the MoE losses) that
    ``run_training`` adds; golden.METRICS names what is recorded and compared."""
    from tests.gpu.launch import run_training

    runs = []
    for plan in plans:
        metrics = workdir / f"{plan.name}.jsonl"
        print(f"[{case.name}] {plan.name}: python -m torch.distributed.run --nproc-per-node "
              f"{case.nproc} {case.script} {shlex.join(plan.argv)} --metrics-file {metrics}  "
              f"(log: {workdir / plan.name}.log)", flush=True)
        runs.append(run_training(case.script, plan.argv, workdir, nproc=case.nproc,
                                 name=plan.name, env=env))
    return gv.concat_runs(runs)


def main(argv=None, root: Path = CASES_ROOT) -> int:
    """The CLI; ``root`` is the cases folder (tests point it at a copy)."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    root = Path(root).resolve()
    if opts.list:
        try:
            print(describe_cases(root))
        except ValueError as err:
            parser.error(str(err))
        return 0
    if not opts.case:
        parser.error("CASE is wrong: none given. Name one, or use --list.")
    try:
        case = load_case(resolve_case(opts.case, root), root)
        workdir = (opts.workdir or Path(tempfile.gettempdir()) / "functional-tests" / case.name)
        workdir = workdir.resolve()
        variables = case_variables(workdir)
        plans = plan_runs(case, variables, opts.steps)
        env = expand_env(case, variables)
    except ValueError as err:
        parser.error(str(err))
    if opts.record and case.shares_golden:
        parser.error(f"--record is wrong for {case.name}: it compares against "
                     f"{case.golden.relative_to(root)} (GOLDEN). Record that case instead.")
    if not opts.record and not case.golden.is_file():
        print(f"[{case.name}] FAILED: {NO_GOLDEN} ({case.golden} does not exist)",
              file=sys.stderr)
        return 1

    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < case.nproc:
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"[{case.name}] needs a machine with GPUs: {case.nproc} CUDA device(s), {seen} visible "
              "(see docs/functional-tests.md)", file=sys.stderr)
        return 1

    prepare_workdir(workdir, plans)
    try:
        records = train(case, plans, env, workdir)
        now = gv.metrics_to_golden(records)
    except (AssertionError, ValueError) as err:
        print(f"[{case.name}] FAILED: training did not complete:\n{err}", file=sys.stderr)
        return 1

    if opts.record:
        if opts.steps is not None:
            print(f"[{case.name}] note: --steps {opts.steps} records only steps 1-{opts.steps}")
        gv.write_golden(case.golden, now)
        print(f"[{case.name}] recorded steps {now['lm loss']['start_step']}..."
              f"{now['lm loss']['end_step']} to {case.golden}")
        return 0

    results = gv.compare(gv.read_golden(case.golden), now, case.metrics, case.tolerances,
                         opts.steps)
    print(gv.format_report(results))
    failed = [r.metric for r in results if not r.ok]
    if failed:
        print(f"[{case.name}] FAILED: {', '.join(failed)} do not match {case.golden} "
              f"(workdir {workdir})", file=sys.stderr)
        return 1
    print(f"[{case.name}] PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
