"""Per-iteration reporting: Megatron's log line, a JSON-lines metrics file, TensorBoard and
Weights & Biases.

The JSON-lines file (``--metrics-file``) has one object per training iteration (and one per
evaluation, with ``"split": "valid"``); tests, the functional-test runner and the plotting
tool read it. Only the last rank writes (it holds the loss when pipelining).
"""

import json
import math
import os
import time
from typing import Optional

import torch

METRIC_KEYS = (
    "iteration",
    "consumed_samples",
    "lm_loss",
    "grad_norm",
    "num_zeros",
    "learning_rate",
    "iteration_time_ms",
    "tokens_per_sec",
    "mem_allocated_bytes",
    "mem_max_allocated_bytes",
    "mem_reserved_bytes",
)


# MoE losses (metrics.MoELosses): log-line names, metrics keys and TensorBoard tags, Megatron's.
MOE_LOSS_KEYS = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss",
                 "moe_dropped_token_fraction")  # the last: with a capacity factor

# TensorBoard tag -> metrics key; the tags are Megatron's.
TENSORBOARD_TAGS = {
    "lm loss": "lm_loss",
    "grad-norm": "grad_norm",
    "learning-rate": "learning_rate",
    "iteration-time": "iteration_time_ms",
    "throughput/tokens-per-sec": "tokens_per_sec",
    "mem-max-allocated-bytes": "mem_max_allocated_bytes",
}


def moe_loss_names(args) -> list:
    """Megatron's names of the MoE losses this run records (its log-line and metrics keys)."""
    if getattr(args, "num_experts", None) is None:
        return []
    names = []
    if args.moe_aux_loss_coeff > 0:
        names.append({"aux_loss": "load_balancing_loss",
                      "seq_aux_loss": "seq_load_balancing_loss"}.get(
            args.moe_router_load_balancing_type))
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return [name for name in names if name]


class MoELosses:
    """The MoE aux losses of each iteration, as Megatron's training loop reports them.

    megatron-core's routers add every MoE layer's unscaled aux loss (and z-loss) into
    `get_moe_metrics_tracker()` on the device. After each iteration `after_step` lets the
    tracker reduce them (pipeline, TP x CP, data-parallel average; collectives, no host read),
    average over micro-batches and MoE layers and zero them, accumulating the step's values
    on the device; `read` (at log points only, where the loop waits for the GPU anyway)
    returns the mean per iteration since the last read. Every rank calls both.
    """

    def __init__(self, args, model_chunks=()):
        self.names = moe_loss_names(args)
        # With a capacity factor: the fraction of routed token slots it dropped (moe.py).
        self.count_drops = getattr(args, "moe_expert_capacity_factor", None) is not None
        self.model_chunks = model_chunks
        pattern = getattr(args, "hybrid_override_pattern", None)
        self.num_layers = args.num_layers
        # gpt: --moe-layer-freq (every layer by default); hybrid: the 'E' layers.
        self.moe_layer_freq = ([int(c == "E") for c in pattern] if pattern
                               else getattr(args, "moe_layer_freq", 1))
        self._totals: dict = {}
        self._iterations = 0

    def after_step(self, num_microbatches: int, iteration: int) -> None:
        if not self.names:
            return
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().report(
            loss_scale=1.0 / num_microbatches, iteration=iteration, track_names=self.names,
            force_initialize=True, num_layers=self.num_layers,
            moe_layer_freq=self.moe_layer_freq, total_loss_dict=self._totals)
        self._iterations += 1

    def read(self) -> dict:
        """{name: mean per iteration} since the last read, and the dropped-slot fraction with a
        capacity factor (reads the device; every rank calls it); {} without MoE."""
        values = {name: float(self._totals[name]) / max(self._iterations, 1)
                  for name in self.names if name in self._totals}
        self._totals, self._iterations = {}, 0
        if self.count_drops:
            from megatron.packed_graphs.moe import read_dropped_token_fraction

            values["moe_dropped_token_fraction"] = read_dropped_token_fraction(self.model_chunks)
        return values


class IntervalTimer:
    """Iteration time, throughput and forward-step counters over one log interval.

    The loop does not wait for the GPU every iteration, so one iteration's host time says
    little; the mean over the interval, read once the GPU has finished it, is the step time
    (Megatron's "elapsed time per iteration"). Call `timing` after that wait.
    """

    # Counters added up over the interval (the graph runtime's "eager <reason>" too); others:
    # the latest value.
    SUMMED = ("graph fallbacks", "iteration graphs", "iteration graph misses")

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self._start = time.perf_counter()
        self.iterations = self.samples = self.positions = 0
        self.stats: dict = {}

    def add(self, samples: int, positions: int, stats: dict) -> None:
        """One iteration of ``samples`` samples holding ``positions`` token positions, and its
        counters (forward step, profiler)."""
        self.iterations += 1
        self.samples += samples
        self.positions += positions
        summed = {k: self.stats.get(k, 0) + v for k, v in stats.items()
                  if k in self.SUMMED or k.startswith(("eager ", "iteration graph miss "))}
        self.stats = self.stats | stats | summed

    def timing(self) -> dict:
        elapsed = time.perf_counter() - self._start
        return {"iteration_time_ms": elapsed * 1000.0 / max(self.iterations, 1),
                "tokens_per_sec": self.positions / elapsed}


def is_reporting_rank() -> bool:
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def wandb_run_settings(args) -> Optional[dict]:
    """``wandb.init`` keywords of ``--wandb-project`` (None when it is empty): the run's name,
    its local directory (``--wandb-save-dir``, else ``<--save>/wandb``, else ``./wandb``) and
    the parsed arguments as its config, as Megatron-LM sets them."""
    if not args.wandb_project:
        return None
    directory = args.wandb_save_dir or os.path.join(args.save or ".", "wandb")
    return {"project": args.wandb_project, "name": args.wandb_exp_name, "dir": directory,
            "config": vars(args)}


class MetricsLogger:
    """Writes log lines, the metrics file, TensorBoard scalars and a W&B run (``wandb_run``:
    `wandb_run_settings`) on the reporting rank. TensorBoard and W&B get the same values
    under Megatron's tags."""

    def __init__(self, metrics_file: Optional[str], tensorboard_dir: Optional[str],
                 train_iters: int, wandb_run: Optional[dict] = None, *,
                 tensorboard_queue_size: Optional[int] = None, validation_ppl: bool = False):
        self.train_iters = train_iters
        self.validation_ppl = validation_ppl
        self.enabled = is_reporting_rank()
        self._file = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a", buffering=1)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir,
                                     max_queue=tensorboard_queue_size or 1000)
        if wandb_run:
            import wandb

            os.makedirs(wandb_run["dir"], exist_ok=True)
            self._wandb = wandb.init(**wandb_run)

    def log_train(self, record: dict) -> None:
        """Record one training iteration; prints Megatron's log line."""
        if not self.enabled:
            return
        parts = [
            f"iteration {record['iteration']:8d}/{self.train_iters:8d}",
            f"consumed samples: {record['consumed_samples']:12d}",
            f"elapsed time per iteration (ms): {record['iteration_time_ms']:.1f}",
            f"learning rate: {record['learning_rate']:.6E}",
            f"global batch size: {record['global_batch_size']:5d}",
            f"lm loss: {record['lm_loss']:.6E}",
            *(f"{name}: {record[name]:.6E}" for name in MOE_LOSS_KEYS if name in record),
            f"grad norm: {record['grad_norm']:.3f}",
            f"num zeros: {record['num_zeros']}",
            f"tokens/s: {record['tokens_per_sec']:.0f}",
        ]
        parts += [f"{name}: {value}" for name, value in record.get("extra_log", {}).items()]
        print(" " + " | ".join(parts) + " |", flush=True)
        self._write({k: v for k, v in record.items() if k != "extra_log"} | record.get("extra_log", {}))
        self._scalars({tag: record[key] for tag, key in TENSORBOARD_TAGS.items()}
                      | {key: record[key] for key in MOE_LOSS_KEYS if key in record},
                      record["iteration"])

    def log_valid(self, iteration: int, lm_loss: float, stats: Optional[dict] = None) -> None:
        """Record a validation pass; ``stats``: its counters (eager micro-batches by reason)."""
        if not self.enabled:
            return
        stats = stats or {}
        extra = "".join(f" {name}: {value} |" for name, value in stats.items())
        print(f" validation loss at iteration {iteration} | lm loss value: {lm_loss:.6E} |"
              f"{extra}", flush=True)
        self._write({"split": "valid", "iteration": iteration, "lm_loss": lm_loss} | stats)
        values = {"lm loss validation": lm_loss}
        if self.validation_ppl:
            # Megatron caps the exponent at 20 so an early, huge loss stays a finite number.
            values["lm loss validation ppl"] = math.exp(min(20.0, lm_loss))
        self._scalars(values, iteration)

    def _scalars(self, values: dict, iteration: int) -> None:
        """TensorBoard scalars and a W&B history row at ``iteration`` (W&B commits a row when a
        later iteration is logged, so a validation loss joins its iteration's training row)."""
        if self._tb is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, iteration)
        if self._wandb is not None:
            self._wandb.log(values, step=iteration)

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str, split: str = "train") -> list:
    """Records of one split from a metrics file, in file order."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("split", "train") == split]


def reduced_lm_loss(losses_reduced: list) -> Optional[torch.Tensor]:
    """Token-weighted mean ``lm loss`` of an iteration's micro-batches over the data-parallel
    (and context-parallel) ranks, as a 0-dim device tensor; None off the last pipeline stage
    (no losses there). One all-reduce, no host read."""
    from megatron.core import parallel_state

    if not losses_reduced:
        return None
    total = torch.stack([x["lm loss"].view(-1)[:2] for x in losses_reduced]).sum(dim=0)
    torch.distributed.all_reduce(
        total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return total[0] / total[1].clamp(min=1)


class RuntimeLog:
    """The graph runtime's part of the log, beside Megatron-LM's own log line: a listener of
    `GraphRuntimeSchedule` (``log(split, stats, losses)``).

    Every ``--log-interval`` iterations (and at the last) the reporting rank prints one line,
    `` packed graphs | iteration N | <counters over the interval> |`` (eager micro-batches by
    reason, graph fallbacks, documents per micro-batch, captures), writes the counters to
    TensorBoard / W&B (Megatron-LM's writers) and a record to ``--metrics-file`` with the
    iteration's lm loss, time and throughput. Evaluation passes are reported once they end,
    with their own counters. Reads the device only at log points (the loss)."""

    def __init__(self, args, model=()):
        self.args = args
        self.iteration = args.iteration  # a loaded checkpoint's
        self.interval = IntervalTimer()
        self.enabled = is_reporting_rank()
        self._file = None
        if self.enabled and args.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)
            self._file = open(args.metrics_file, "a", buffering=1)
        self._valid_stats: dict = {}
        self._valid_losses: list = []
        from megatron.packed_training.profiling import StepProfiler

        # --profile: GPU-busy time of iterations [--profile-step-start, --profile-step-end)
        # of this process, 1-based (profiling.py); Megatron-LM's own nsys range is separate.
        self.profiler = StepProfiler(args.profile, args.profile_step_start,
                                     args.profile_step_end, args.profile_trace_dir)

    def begin_iteration(self) -> None:
        """`GraphRuntimeSchedule.before_iteration` hook: the profiler's start."""
        self.profiler.begin(self.iteration + 1)

    def __call__(self, split: str, stats: dict, losses) -> None:
        if split == "valid":
            for key, value in stats.items():
                self._valid_stats[key] = self._valid_stats.get(key, 0) + value
            self._valid_losses += list(losses or [])
            return
        self._flush_valid()
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size

        self.iteration += 1
        batch = get_current_global_batch_size()
        stats = stats | self.profiler.finish(self.iteration)
        self.interval.add(batch, batch * self.args.seq_length, stats)
        if self.iteration % self.args.log_interval and self.iteration != self.args.train_iters:
            return
        loss = reduced_lm_loss(losses)
        if not self.enabled:
            self.interval.restart()
            return
        record = {"iteration": self.iteration,
                  "consumed_samples": self.args.consumed_train_samples + batch,
                  "lm_loss": float("nan") if loss is None else float(loss),  # waits for the GPU
                  **self.interval.timing(), **self.interval.stats}
        shown = " | ".join(f"{k}: {v}" for k, v in self.interval.stats.items())
        print(f" packed graphs | iteration {self.iteration:8d} | {shown} |", flush=True)
        self._write(record)
        self._scalars(self.interval.stats)
        self.interval.restart()

    def _flush_valid(self) -> None:
        """Report the evaluation that ended before this training iteration."""
        if not self._valid_stats and not self._valid_losses:
            return
        stats, losses = self._valid_stats, self._valid_losses
        self._valid_stats, self._valid_losses = {}, []
        loss = reduced_lm_loss(losses)
        if not self.enabled:
            return
        value = float("nan") if loss is None else float(loss)
        shown = "".join(f" {k}: {v} |" for k, v in stats.items())
        print(f" packed graphs | validation at iteration {self.iteration} |{shown}", flush=True)
        self._write({"split": "valid", "iteration": self.iteration, "lm_loss": value} | stats)

    def _scalars(self, stats: dict) -> None:
        """The numeric counters under ``packed-graphs/<name>`` in Megatron-LM's writers."""
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        numbers = {f"packed-graphs/{k}": v for k, v in stats.items()
                   if isinstance(v, (int, float))}
        if (writer := get_tensorboard_writer()) is not None:
            for tag, value in numbers.items():
                writer.add_scalar(tag, value, self.iteration)
        if (wandb := get_wandb_writer()) is not None and numbers:
            wandb.log(numbers, step=self.iteration)

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
