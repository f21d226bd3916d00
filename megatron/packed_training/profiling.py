"""Profile a range of training iterations: nsys capture range and GPU-busy time.

With ``--profile``, iterations ``[--profile-step-start, --profile-step-end)`` run between
``cudaProfilerStart`` / ``cudaProfilerStop`` (so ``nsys profile --capture-range=cudaProfilerApi``
records just them) and under ``torch.profiler``, from which each iteration's **GPU-busy time**
is computed: the union of its kernel intervals, overlapping kernels counted once. The ratio
step time / GPU-busy time is how close a step is to the GPU's own limit (1.0).

With a trace directory (``--profile-trace-dir``) host activity is recorded too, with Python
stacks, and each iteration's Chrome trace is kept: ``tools/step_gaps.py`` names the host code
that runs while the GPU waits.
"""

import json
import os
import tempfile
from typing import List, Optional, Tuple

import torch


def merged_busy_us(intervals: List[Tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (any unit)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def kernel_intervals_from_trace(trace: dict) -> List[Tuple[float, float]]:
    """``(start_us, end_us)`` of every GPU kernel in a Chrome trace exported by torch.profiler."""
    return [(e["ts"], e["ts"] + e["dur"]) for e in trace.get("traceEvents", [])
            if e.get("cat") == "kernel" and "dur" in e]


class StepProfiler:
    """Profiles iterations ``[start, end)`` of this process (1-based iteration numbers)."""

    def __init__(self, enabled: bool, start: int, end: int, trace_dir: Optional[str] = None):
        self.enabled, self.start, self.end, self.trace_dir = enabled, start, end, trace_dir
        self._prof: Optional[torch.profiler.profile] = None

    def begin(self, iteration: int) -> None:
        """Call before running ``iteration``."""
        if not self.enabled or not self.start <= iteration < self.end:
            return
        if iteration == self.start:
            torch.cuda.profiler.start()
        torch.cuda.synchronize()  # deliberate: profile exactly this iteration's kernels
        activities = [torch.profiler.ProfilerActivity.CUDA]
        if self.trace_dir:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        self._prof = torch.profiler.profile(activities=activities, with_stack=bool(self.trace_dir))
        self._prof.__enter__()

    def finish(self, iteration: int) -> dict:
        """Call after ``iteration`` (synchronised); returns ``{"gpu busy (ms)": x}`` or {}."""
        if self._prof is None:
            return {}
        torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            if self.trace_dir:
                os.makedirs(self.trace_dir, exist_ok=True)
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                path = os.path.join(self.trace_dir, f"trace_iter{iteration}_rank{rank}.json")
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                busy_us = merged_busy_us(kernel_intervals_from_trace(json.load(f)))
        self._prof = None
        if iteration == self.end - 1:
            torch.cuda.profiler.stop()
        return {"gpu busy (ms)": round(busy_us / 1000.0, 3)}
