"""Sleep and wake: an offloadable policy's GPU memory leaves for pinned host memory and comes
back at the same virtual addresses, so that a rollout engine can use the GPU in between and
every captured CUDA graph replays unchanged afterwards (docs/rl.md, "Sharing the GPU with a
rollout engine").

The mechanism is torch_memory_saver's preload hook (``LD_PRELOAD`` of its
``torch_memory_saver_hook_mode_preload`` library): while a thread is inside one of its
regions, each ``cudaMalloc`` of the caching allocator (ordinary segments and the segments
of CUDA-graph private pools) is a virtual range backed by physical memory it maps itself.
``pause`` copies the contents to pinned host memory and unmaps the physical memory;
``resume`` maps new physical memory at the same virtual addresses and copies the contents
back. Pointers baked into captured graphs stay valid: nothing is recaptured.

What counts as the policy's memory: everything allocated on the calling thread during
`PackedPolicy.build`'s model and optimizer construction and during the policy's calls
(`PolicyMemory.resident`): parameters, gradient buffers, optimizer state, graph pools and
static buffers, the caching allocator's cached blocks of those calls, and the device tensors
the calls return (log-probs, `TrainResult` values, a `WeightStore` on the GPU). Backward runs
on the calling thread inside a call (autograd's worker threads are outside the hook's
thread-local region). What stays on the GPU: the CUDA context, NCCL's buffers, Megatron-LM's
start-up allocations before the model is built, the cuBLAS workspace of the process's stream
(`keep_library_workspaces_outside`), and every allocation made outside the policy's calls.
"""

import functools
import gc
import importlib
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

TAG = "packed_policy"  # the torch_memory_saver region tag of the policy's memory
HOOK_LIBRARY = "torch_memory_saver_hook_mode_preload"  # the preload library's file-name stem
EXTRA = "pip install -e \".[offload]\" (or pip install torch_memory_saver)"
PRELOAD_LINE = ("LD_PRELOAD=$(python -c \"from torch_memory_saver.utils import "
                "get_binary_path_from_package as p; print(p('" + HOOK_LIBRARY + "'))\")")


@dataclass(frozen=True)
class MemoryMove:
    """What one `PackedPolicy.offload` or `PackedPolicy.onload` did, measured with
    ``torch.cuda.mem_get_info`` on the policy's device.

    ``kind``: "offload" or "onload"; ``mib``: MiB the device's free memory grew by (offload)
    or shrank by (onload); ``seconds``: the call's wall time, device synchronised;
    ``free_mib``: the device's free memory after the call; ``reserved_mib``:
    ``torch.cuda.memory_reserved`` before the call (what PyTorch's allocator held, graph
    pools included: the allocator's view does not change when the memory leaves)."""

    kind: str
    mib: float
    seconds: float
    free_mib: float
    reserved_mib: float


def preload_problem(*, installed: bool, ld_preload: str, mapped: Optional[str],
                    alloc_conf: str) -> Optional[str]:
    """Why an offloadable policy cannot run in this process, and the fix; None when it can.

    ``installed``: torch_memory_saver imports; ``ld_preload``: the ``LD_PRELOAD`` variable;
    ``mapped``: the process's ``/proc/self/maps`` (None where there is none: the variable is
    trusted); ``alloc_conf``: ``PYTORCH_CUDA_ALLOC_CONF``. Host only."""
    if "expandable_segments:true" in alloc_conf.replace(" ", "").lower():
        return (f"PYTORCH_CUDA_ALLOC_CONF is wrong for PolicyConfig(offloadable=True): "
                f"{alloc_conf!r}. torch_memory_saver maps the allocator's cudaMalloc segments "
                f"and does not take expandable segments: leave expandable_segments out.")
    if not installed:
        return (f"PolicyConfig(offloadable=True) needs the torch_memory_saver package, which "
                f"is not installed: {EXTRA}, then start the process with {PRELOAD_LINE}.")
    named = [p for p in ld_preload.split(":") if "torch_memory_saver" in p]
    if len(named) != 1:
        return (f"LD_PRELOAD is wrong for PolicyConfig(offloadable=True): {ld_preload!r} names "
                f"{len(named)} torch_memory_saver libraries, 1 expected. Start the process "
                f"with {PRELOAD_LINE} (under torchrun: on torchrun's command line, the ranks "
                f"inherit it; from Python: inside torch_memory_saver.configure_subprocess()).")
    if mapped is not None and HOOK_LIBRARY not in mapped:
        return (f"LD_PRELOAD names {named[0]}, but this process did not start with it loaded "
                f"(the dynamic loader reads LD_PRELOAD once, at the start of a process; "
                f"setting it from Python afterwards does nothing). Start the process with "
                f"{PRELOAD_LINE}.")
    return None


def require_memory_saver():
    """torch_memory_saver's process-wide saver, or RuntimeError naming what is missing and
    the fix (`preload_problem`). Host only: call it before any GPU work."""
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError:
        torch_memory_saver = None
    try:
        with open("/proc/self/maps") as f:
            mapped = f.read()
    except OSError:
        mapped = None
    problem = preload_problem(installed=torch_memory_saver is not None,
                              ld_preload=os.environ.get("LD_PRELOAD", ""), mapped=mapped,
                              alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if problem is not None:
        raise RuntimeError(problem)
    return in_preload_mode(torch_memory_saver)


def in_preload_mode(saver):
    """``saver`` set to the preload hook. Megatron-LM 0.19's megatron/training/training.py
    sets the process-wide saver to its ``torch`` hook when it is imported (a pluggable
    allocator for its own offloading, which leaves CUDA-graph pools outside the region);
    the policy needs the preload hook, which maps every cudaMalloc in the region, graph pools
    included. Set before the saver's first use, after that import has run."""
    importlib.import_module("megatron.training.training")  # its setting, overridden below
    try:
        saver.hook_mode = "preload"  # torch_memory_saver takes it until its first use
    except (AssertionError, AttributeError):
        raise RuntimeError("torch_memory_saver is in use already in this process, so its hook "
                           "can no longer be set; an offloadable policy needs its preload "
                           "hook. Build the policy before anything else uses "
                           "torch_memory_saver.") from None
    return saver


def _mib(count: int) -> float:
    return round(count / 2**20, 1)


class PolicyMemory:
    """The GPU memory of an offloadable policy: one torch_memory_saver region (`TAG`), with
    its contents backed up to pinned host memory while offloaded (module doc).

    ``saver``: torch_memory_saver's process-wide saver (`require_memory_saver`)."""

    def __init__(self, saver):
        self.saver = saver
        self.offloaded = False
        self._depth = 0          # nested `resident` scopes: the region is entered once
        self._paused_bytes = 0   # what the last offload unmapped, for onload's check

    @property
    def paused_bytes(self) -> int:
        """Bytes the last offload unmapped: the free memory `onload` needs."""
        return self._paused_bytes

    @classmethod
    def open(cls) -> "PolicyMemory":
        """Checks the process (`require_memory_saver`; host only) and returns the memory."""
        return cls(require_memory_saver())

    @contextmanager
    def resident(self, what: str):
        """Scope of a policy call ``what``: its allocations on this thread are the policy's
        (region ``TAG``, CPU backup on), and backward runs on this thread. RuntimeError while
        offloaded, before anything runs. Nested scopes enter the region once."""
        if self.offloaded:
            raise RuntimeError(f"{what} is refused: the policy is offloaded (its parameters, "
                               f"optimizer state and graphs are not on the GPU). Call "
                               f"policy.onload() first.")
        if self._depth:
            yield
            return
        self._depth += 1
        try:
            with self.saver.region(TAG, enable_cpu_backup=True), \
                    torch.autograd.set_multithreading_enabled(False):
                yield
        finally:
            self._depth -= 1

    def iterate(self, iterator, what: str) -> Iterator:
        """``iterator``'s items, each produced inside `resident` (the caller's code between
        items runs outside it)."""
        iterator = iter(iterator)
        while True:
            with self.resident(what):
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item

    def keep_library_workspaces_outside(self) -> None:
        """Allocate cuBLAS and cuBLASLt's workspaces for this thread and the current stream
        now, outside the region: they are cached per stream and shared with any other code
        on it (an engine in this process), which must not find them offloaded."""
        a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        torch.addmm(a[0], a, a)  # cuBLASLt (bias epilogue)
        torch.mm(a.float(), a.float())  # cuBLAS
        torch.cuda.synchronize()

    def offload(self) -> MemoryMove:
        """Move the policy's memory to pinned host memory (module doc). Syncs the device
        first (every kernel reading it has finished), releases the allocator's unused cache,
        then unmaps. RuntimeError when offloaded already."""
        if self.offloaded:
            raise RuntimeError("offload is refused: the policy is offloaded already. Call "
                               "policy.onload() to bring it back.")
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        start = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info()
        # Free blocks outside the region go back to the driver too; the region's own cached
        # blocks leave with it (the allocator still counts them: no address changes).
        gc.collect()
        torch.cuda.empty_cache()
        free_cached, _ = torch.cuda.mem_get_info()
        self.saver.pause(TAG)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        free_after, _ = torch.cuda.mem_get_info()
        self._paused_bytes = free_after - free_cached
        self.offloaded = True
        return MemoryMove("offload", _mib(free_after - free_before), round(seconds, 3),
                          _mib(free_after), _mib(reserved))

    def onload(self) -> MemoryMove:
        """Map the policy's memory back at its addresses and copy its contents in; graphs
        replay as before. RuntimeError, with nothing changed, when not offloaded or when the
        device has less free memory than the policy needs (the rollout engine still holds
        it)."""
        if not self.offloaded:
            raise RuntimeError("onload is refused: the policy is on the GPU (onload follows "
                               "an offload).")
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        if free_before < self._paused_bytes:
            raise RuntimeError(
                f"onload needs {_mib(self._paused_bytes)} MiB free on "
                f"cuda:{torch.cuda.current_device()}, {_mib(free_before)} MiB are. Release the "
                f"rollout engine's memory first (vLLM: LLM.sleep(); SGLang: "
                f"release_memory_occupation()), then call onload again.")
        start = time.perf_counter()
        self.saver.resume(TAG)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        free_after, _ = torch.cuda.mem_get_info()
        self.offloaded = False
        return MemoryMove("onload", _mib(free_before - free_after), round(seconds, 3),
                          _mib(free_after), _mib(torch.cuda.memory_reserved()))


def on_the_gpu(method: Callable) -> Callable:
    """`PackedPolicy` method decorator: the call runs in the policy's memory
    (`PolicyMemory.resident`) where the policy is offloadable, and is refused while it is
    offloaded; unchanged for other policies."""

    @functools.wraps(method)
    def call(policy, *args, **kwargs):
        memory = getattr(policy, "memory", None)
        if memory is None:
            return method(policy, *args, **kwargs)
        with memory.resident(f"PackedPolicy.{method.__name__}"):
            return method(policy, *args, **kwargs)

    return call


def on_the_gpu_scope(method: Callable) -> Callable:
    """As `on_the_gpu`, for a method returning a context manager: its entry and its exit each
    run in the policy's memory (and are refused while offloaded); the body of the caller's
    ``with`` runs outside it, as any code between policy calls."""

    @functools.wraps(method)
    @contextmanager
    def call(policy, *args, **kwargs):
        memory = getattr(policy, "memory", None)
        what = f"PackedPolicy.{method.__name__}"
        scope = method(policy, *args, **kwargs)
        # Entered and left by hand: only those two steps belong in the region.
        with memory.resident(what) if memory is not None else nullcontext():
            scope.__enter__()
        try:
            yield
        finally:
            with memory.resident(what) if memory is not None else nullcontext():
                scope.__exit__(None, None, None)

    return call


def on_the_gpu_iterating(method: Callable) -> Callable:
    """As `on_the_gpu`, for a method returning an iterator: the call and each item run in the
    policy's memory (`PolicyMemory.iterate`)."""

    @functools.wraps(method)
    def call(policy, *args, **kwargs):
        memory = getattr(policy, "memory", None)
        if memory is None:
            return method(policy, *args, **kwargs)
        what = f"PackedPolicy.{method.__name__}"
        with memory.resident(what):
            items = method(policy, *args, **kwargs)
        return memory.iterate(items, what)

    return call
