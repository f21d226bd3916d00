"""A functional-test case: one folder under ``cases/<model>/<case>/`` with ``model_config.yaml``.

MODEL_ARGS is a Megatron-LM command line (pretrain_gpt.py / pretrain_mamba.py run Megatron-LM's
parser and pretrain(), with the fork's flags on top); tests/unit/test_functional_runner.py
parses every planned run with the real parser.

Keys of ``model_config.yaml`` (Megatron-LM's, plus METRICS, TOLERANCE and GOLDEN):

=============  ============================================================================
ENV_VARS       environment added to the run (values may use ``${VARIABLE}``)
MODEL_ARGS     flag -> value; ``true`` is a bare flag, ``false``/null leaves it out, a list
               gives several values; values may use ``${CHECKPOINT_SAVE_PATH}``,
               ``${TENSORBOARD_PATH}``, ``${DATA_PATH}``
MODEL_ARGS_2   ckpt-resume only: the second run's flags (default: MODEL_ARGS)
TEST_TYPE      ``regular`` | ``ckpt-resume``
SCRIPT         ``pretrain_gpt.py`` | ``pretrain_mamba.py``
NPROC          GPUs (torchrun processes), default 1
METRICS        golden metrics compared, default ``["lm loss", "num-zeros"]``
TOLERANCE      per metric, e.g. ``{"lm loss": {"atol": 2.0e-3}}`` (golden.DEFAULT_TOLERANCES)
GOLDEN         another case's golden file to compare against, relative to ``cases/``
=============  ============================================================================

Pure: loading, expanding and planning the runs need no GPU.
"""

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.functional.golden import DEFAULT_COMPARED, METRICS, resolve_tolerances

CASES_ROOT = Path(__file__).resolve().parent / "cases"
REPO = CASES_ROOT.parents[2]
CONFIG_NAME = "model_config.yaml"
GOLDEN_NAME = "golden_values_h200.json"
SCRIPTS = {"pretrain_gpt.py": "gpt", "pretrain_mamba.py": "hybrid"}
TEST_TYPES = ("regular", "ckpt-resume")
KEYS = {"ENV_VARS", "MODEL_ARGS", "MODEL_ARGS_2", "TEST_TYPE", "SCRIPT", "NPROC", "METRICS",
        "TOLERANCE", "GOLDEN"}
# Flags the ckpt-resume runner sets itself (the split point and the checkpoint hand-over).
RESUME_FLAGS = ("--load", "--exit-interval")

_VARIABLE = re.compile(r"\$\{(\w+)\}")


@dataclass(frozen=True)
class Case:
    name: str
    """'<model>/<case>', the folder relative to ``cases/``."""
    folder: Path
    script: str
    nproc: int
    test_type: str
    env_vars: dict
    model_args: dict
    model_args_2: dict | None
    metrics: tuple
    tolerances: dict
    """Metric name -> golden.Tolerance, for every metric."""
    golden: Path
    """The golden file compared against: this case's own, or GOLDEN's."""

    @property
    def model(self) -> str:
        return SCRIPTS[self.script]

    @property
    def shares_golden(self) -> bool:
        return self.golden != self.folder / GOLDEN_NAME

    @property
    def train_iters(self) -> int:
        return int(self.model_args["--train-iters"])


def list_cases(root: Path = CASES_ROOT) -> list:
    """'<model>/<case>' of every folder holding a model_config.yaml, sorted."""
    return sorted(p.parent.relative_to(root).as_posix() for p in root.rglob(CONFIG_NAME))


def resolve_case(name: str, root: Path = CASES_ROOT) -> Path:
    """'<model>/<case>', a path under ``cases/`` or to the folder/yaml itself -> the folder."""
    for candidate in (Path(name), root / name):
        folder = candidate.parent if candidate.name == CONFIG_NAME else candidate
        if (folder / CONFIG_NAME).is_file():
            return folder.resolve()
    raise ValueError(f"CASE is wrong: {name!r}. Use one of: {', '.join(list_cases(root))} "
                     "(python -m tests.functional.run --list).")


def load_case(folder: Path, root: Path = CASES_ROOT) -> Case:
    """Read and check ``folder/model_config.yaml``; raises ValueError naming the bad key."""
    folder = Path(folder).resolve()
    root = Path(root).resolve()
    name = folder.relative_to(root).as_posix()
    where = f"{name}/{CONFIG_NAME}"
    try:
        with open(folder / CONFIG_NAME) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{where} is wrong: not valid YAML ({err}). Fix the file.") from None
    unknown = set(raw) - KEYS
    if unknown:
        raise ValueError(f"{where} is wrong: unknown keys {sorted(unknown)}. Use {sorted(KEYS)}.")
    for key in ("MODEL_ARGS", "SCRIPT", "TEST_TYPE"):
        if key not in raw:
            raise ValueError(f"{where} is wrong: no {key}. Add it.")
    if raw["SCRIPT"] not in SCRIPTS:
        raise ValueError(f"{where} SCRIPT is wrong: {raw['SCRIPT']!r}. Use one of {list(SCRIPTS)}.")
    if raw["TEST_TYPE"] not in TEST_TYPES:
        raise ValueError(f"{where} TEST_TYPE is wrong: {raw['TEST_TYPE']!r}. Use one of "
                         f"{list(TEST_TYPES)}.")
    model_args = dict(raw["MODEL_ARGS"])
    if "--train-iters" not in model_args:
        raise ValueError(f"{where} MODEL_ARGS is wrong: no --train-iters. Add it.")
    if raw["TEST_TYPE"] == "ckpt-resume":
        given = [flag for flag in RESUME_FLAGS if flag in model_args]
        if given:
            raise ValueError(f"{where} MODEL_ARGS is wrong: {given}. The ckpt-resume runner "
                             "sets --exit-interval and --load itself; drop them.")
    elif "MODEL_ARGS_2" in raw:
        raise ValueError(f"{where} MODEL_ARGS_2 is wrong: TEST_TYPE is {raw['TEST_TYPE']}. "
                         "Only ckpt-resume cases have a second run.")
    metrics = tuple(raw.get("METRICS", DEFAULT_COMPARED))
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise ValueError(f"{where} METRICS is wrong: {bad}. Use names from {list(METRICS)}.")
    try:
        tolerances = resolve_tolerances(raw.get("TOLERANCE"))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    golden = folder / GOLDEN_NAME
    if raw.get("GOLDEN"):
        golden = (root / raw["GOLDEN"]).resolve()
        if not (golden.parent / CONFIG_NAME).is_file():
            raise ValueError(f"{where} GOLDEN is wrong: {raw['GOLDEN']!r}. Name a golden file "
                             f"inside another case's folder, e.g. gpt/gpt_eager/{GOLDEN_NAME}.")
    nproc = int(raw.get("NPROC", 1))
    if nproc < 1:
        raise ValueError(f"{where} NPROC is wrong: {nproc}. Use a value >= 1.")
    return Case(name=name, folder=folder, script=raw["SCRIPT"], nproc=nproc,
                test_type=raw["TEST_TYPE"], env_vars=dict(raw.get("ENV_VARS") or {}),
                model_args=model_args, model_args_2=raw.get("MODEL_ARGS_2"), metrics=metrics,
                tolerances=tolerances, golden=golden)


# ----------------------------------------------------------------- variables and command lines

def case_variables(workdir) -> dict:
    """Values of the ``${...}`` variables for a run in ``workdir``.

    DATA_PATH comes from the environment (the cases use --mock-data and do not need it).
    """
    workdir = Path(workdir)
    variables = {"CHECKPOINT_SAVE_PATH": str(workdir / "checkpoints"),
                 "TENSORBOARD_PATH": str(workdir / "tensorboard")}
    if os.environ.get("DATA_PATH"):
        variables["DATA_PATH"] = os.environ["DATA_PATH"]
    return variables


def expand(value, variables: dict) -> str:
    """``str(value)`` with every ``${NAME}`` replaced; an unknown NAME is an error."""
    def substitute(match):
        name = match.group(1)
        if name not in variables:
            hint = ("export DATA_PATH" if name == "DATA_PATH"
                    else f"use one of {', '.join(sorted(variables))}")
            raise ValueError(f"${{{name}}} is wrong: not set. {hint[0].upper()}{hint[1:]}.")
        return variables[name]
    return _VARIABLE.sub(substitute, str(value))


def to_argv(model_args: dict, variables: dict) -> list:
    """MODEL_ARGS -> argv: ``true`` a bare flag, ``false``/None omitted, a list several words."""
    argv = []
    for flag, value in model_args.items():
        if value is False or value is None:
            continue
        argv.append(flag)
        if value is True:
            continue
        values = value if isinstance(value, list) else [value]
        argv += [expand(v, variables) for v in values]
    return argv


def expand_env(case: Case, variables: dict) -> dict:
    return {name: expand(value, variables) for name, value in case.env_vars.items()}


@dataclass(frozen=True)
class RunPlan:
    name: str
    """Names the run's metrics file and log in the workdir: '<name>.jsonl', '<name>.log'."""
    argv: list
    """Training flags, without --metrics-file (the launcher adds it)."""


def plan_runs(case: Case, variables: dict, steps: int | None = None) -> list:
    """The training runs of ``case``: one for 'regular', two for 'ckpt-resume'.

    ``steps`` stops training after that many iterations with --exit-interval, so the LR
    schedule (which spans --train-iters) and hence the first ``steps`` golden values are
    unchanged. ckpt-resume: the first run stops at half the iterations and saves to
    ${CHECKPOINT_SAVE_PATH} (Megatron-LM saves at --exit-interval when --save is given; it
    wants a --save-interval with --save, the split point unless the case sets one); the second
    loads it and trains the rest.
    """
    total = case.train_iters
    if steps is not None and not 1 <= steps <= total:
        raise ValueError(f"--steps is wrong: {steps}. Use 1 ... --train-iters ({total}) of "
                         f"{case.name}.")
    end = steps or total
    if case.test_type == "regular":
        args = dict(case.model_args)
        if steps is not None:
            args["--exit-interval"] = steps
        return [RunPlan("run", to_argv(args, variables))]
    if end < 2:
        raise ValueError(f"--steps is wrong: {steps}. A ckpt-resume case needs at least 2.")
    split = end // 2
    first = dict(case.model_args)
    if "--save" not in first:
        first["--save"] = "${CHECKPOINT_SAVE_PATH}"
        first.setdefault("--save-interval", split)
    first["--exit-interval"] = split
    second = dict(case.model_args_2 if case.model_args_2 is not None else case.model_args)
    second.setdefault("--load", first["--save"])
    if steps is not None:
        second["--exit-interval"] = steps
    return [RunPlan("first_half", to_argv(first, variables)),
            RunPlan("second_half", to_argv(second, variables))]
