"""Per-iteration reporting: Megatron's log line, a JSON-lines metrics file, TensorBoard and
Weights & Biases.

The JSON-lines file (``--metrics-file``) has one object per training iteration (and one per
evaluation, with ``"split": "valid"``); tests, the functional-test runner and the plotting
tool read it. Only the last rank writes (it holds the loss when pipelining).
"""

import json
import os
import time
from typing import Optional

import torch

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


def _on_host(loss: Optional[torch.Tensor]) -> float:
    """A reduced loss as a number (NaN off the last pipeline stage); reading it waits for the
    GPU."""
    return float("nan") if loss is None else float(loss)


class RuntimeLog:
    """The graph runtime's part of the log, beside Megatron-LM's own log line: a listener of
    `GraphRuntimeSchedule` (``log(split, stats, losses)``).

    Every ``--log-interval`` iterations (and at the last) the reporting rank prints one line,
    `` packed graphs | iteration N | <counters over the interval> |`` (eager micro-batches by
    reason, graph fallbacks, documents per micro-batch, captures; with an expert capacity the
    fraction of token slots it dropped), writes the counters to
    TensorBoard / W&B (Megatron-LM's writers) and a record to ``--metrics-file`` with the
    iteration's lm loss, time and throughput. Each evaluation pass is reported once it has
    ended (`report_evaluation`), with its own counters. Reads the device only at log points
    (the loss)."""

    def __init__(self, args, model=()):
        self.args, self.model = args, list(model)
        # With an expert capacity: the fraction of routed token slots it dropped (moe.py);
        # with --moe-dropless-graphs the routers count routed slots and the fraction is 0.
        self.count_drops = (args.num_experts is not None
                            and (args.moe_expert_capacity_factor is not None
                                 or getattr(args, "moe_dropless_graphs", False)))
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

        # --profile: the nsys range and the GPU-busy time of iterations [--profile-step-start,
        # --profile-step-end) of this process, 1-based (profiling.py), in place of Megatron-LM's
        # own nsys path (extra_args.validate_packed_args).
        self.profiler = StepProfiler(args.packed_profile, args.profile_step_start,
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
        self.report_evaluation()
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size

        from megatron.packed_graphs.runtime import ITERATION_POSITIONS

        self.iteration += 1
        batch = get_current_global_batch_size()
        stats = stats | self.profiler.finish(self.iteration)
        # Dynamic CP samples hold CP size x tokens per rank positions each: the runtime counts.
        positions = stats.pop(ITERATION_POSITIONS, batch * self.args.seq_length)
        self.interval.add(batch, positions, stats)
        if self.iteration % self.args.log_interval and self.iteration != self.args.train_iters:
            return
        loss = reduced_lm_loss(losses)
        if self.count_drops:  # a collective: every rank reads
            from megatron.packed_model.moe import read_dropped_token_fraction

            self.interval.stats["moe_dropped_token_fraction"] = round(
                read_dropped_token_fraction(self.model), 6)
        if not self.enabled:
            self.interval.restart()
            return
        record = {"iteration": self.iteration,
                  "consumed_samples": self.args.consumed_train_samples + batch,
                  "lm_loss": _on_host(loss),
                  **self.interval.timing(), **self.interval.stats}
        shown = " | ".join(f"{k}: {v}" for k, v in self.interval.stats.items())
        print(f" packed graphs | iteration {self.iteration:8d} | {shown} |", flush=True)
        self._write(record)
        self._scalars(self.interval.stats)
        self.interval.restart()

    def report_evaluation(self) -> None:
        """Report the evaluation pass held so far: its line and one ``"split": "valid"``
        record of its counters and loss, summed over its iterations; a no-op without one.
        Called once the pass has ended: at the next training iteration, at `close`, and when
        Megatron-LM starts its next evaluation (pretrain.py): a pass at the last training
        iteration and the final evaluation after training are two passes, two records."""
        if not self._valid_stats and not self._valid_losses:
            return
        stats, losses = self._valid_stats, self._valid_losses
        self._valid_stats, self._valid_losses = {}, []
        loss = reduced_lm_loss(losses)
        if not self.enabled:
            return
        value = _on_host(loss)
        shown = "".join(f" {k}: {v} |" for k, v in stats.items())
        print(f" packed graphs | validation at iteration {self.iteration} |{shown}", flush=True)
        self._write({"split": "valid", "iteration": self.iteration, "lm_loss": value} | stats)
        self._scalars({f"validation {name}": count for name, count in stats.items()})

    def close(self) -> None:
        """After training: report a final evaluation, close the metrics file."""
        self.report_evaluation()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _scalars(self, stats: dict) -> None:
        """The numeric counters under ``packed-graphs/<name>`` in Megatron-LM's writers
        (an evaluation's as ``packed-graphs/validation <name>``)."""
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
