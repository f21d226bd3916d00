"""Wall time and peak host memory of a conversion (``tools/convert_hf.py --measure``).

Peak memory is the process's peak resident set (``getrusage``'s ``ru_maxrss``): it includes
the interpreter and PyTorch (the ``baseline``, resident before the conversion starts) and the
safetensors pages the reader maps. Run one conversion per process for a clean figure.
"""

import os
import resource
import time
from dataclasses import dataclass


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@dataclass
class Measurement:
    seconds: float = 0.0
    peak_bytes: int = 0
    baseline_bytes: int = 0

    def describe(self, converted_bytes: int | None = None) -> str:
        gib = 2 ** 30
        text = (f"{self.seconds:.1f} s, peak host memory {self.peak_bytes / gib:.2f} GiB "
                f"(process baseline {self.baseline_bytes / gib:.2f} GiB")
        if converted_bytes:
            text += f", model {converted_bytes / gib:.2f} GiB"
        return text + ")"


class measured:
    """``with measured() as m: ...`` fills ``m`` (a `Measurement`) on exit."""

    def __enter__(self) -> Measurement:
        self.result = Measurement(baseline_bytes=_resident_bytes())
        self._start = time.perf_counter()
        return self.result

    def __exit__(self, *exc) -> None:
        self.result.seconds = time.perf_counter() - self._start
        self.result.peak_bytes = _peak_bytes()
