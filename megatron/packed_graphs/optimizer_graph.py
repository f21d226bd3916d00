"""The optimizer step as one CUDA graph (``--optimizer-cuda-graph``), under any model granularity.

What is captured: megatron-core's whole ``optimizer.step()``, i.e. the gradient copy into the
fp32 main gradients, the gradient norm (its all-reduce included), clipping, the Adam kernels
and the copy of the updated main parameters into the model's (with the distributed
optimizer: the parameter all-gather too). Eager steps come first: the process's first
``--cuda-graph-warmup-steps`` steps (at least one, which creates the Adam state); the next step
is captured (the capture only records, so that step is then replayed), and every later step
replays the graph. The graph has a private memory pool; the model's graphs, of any
granularity (or none), are not involved.

What stays live. A replay reads every tensor at the address it had at capture, and every
Python number as it was then. So the values the schedule changes are device tensors written in
place outside the graph, and nothing may rebind them (`StepTensors`):

* the learning rate of each parameter group: a float32 tensor on the group's device, which
  megatron-core's ``OptimizerParamScheduler.step`` fills in place (it ``fill_``s a tensor
  ``lr`` and assigns a float otherwise; Transformer Engine's capturable FusedAdam makes it a
  tensor, torch's Adam is given one here);
* Adam's step count: Transformer Engine's and apex's FusedAdam keep one device tensor per
  group (``group["step"]``), torch's Adam one per parameter (``state[p]["step"]``); both add
  one inside the graph. Bias correction is computed from it on the device.

Baked in at capture: the weight decay (constant in this fork: no weight-decay schedule; a
change after capture raises), betas, epsilon and the clipping threshold (flags). A checkpoint
loaded after capture (``optimizer.load_state_dict`` rebinds fresh tensors) is copied into the
captured tensors before the next replay, and the captured tensors put back in place. A
checkpoint holds them as numbers, as an eager run's does (`StepTensors.as_numbers`).

The step's results: ``(True, grad_norm, 0)``. ``grad_norm`` is graph-owned storage (a 0-dim
or 1-element CUDA tensor) that the next replay overwrites; read it before the next step.
``success`` is frozen at capture, and True is also what megatron-core's eager step returns
in bf16 and fp32: without a loss scaler it never skips an update. A NaN or inf gradient is
stopped before the step by DDP's gradient check (``--check-for-nan-in-loss-and-grad``, on by
default); without that check it reaches the weights, eager or graphed alike.

What cannot be captured (refused at parse time, extra_args.check_optimizer_graph, and
again here with the optimizer at hand): a loss scaler (fp16: its found-inf flag is read on
the host), counting zero gradients (read on the host), more than one chained optimizer (MoE:
megatron-core merges their gradient norms on the host without the distributed optimizer and
their step counts by value at every checkpoint), an optimizer built without
``OptimizerConfig.optimizer_cuda_graph`` (non-capturable kernels), and clipping that reads the
norm on the host (megatron-core before Transformer Engine 2.14 without
``megatron_optimizer.clip_gradients_without_host_sync``).
"""

from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.packed_upstream import megatron_optimizer
from megatron.packed_graphs.graph_memory import capture_in_own_pool
from megatron.packed_graphs.settings import GraphSettings

EAGER_KEY = "eager optimizer steps"  # summed over the log interval, like the runtime's "eager *"


def capture_iteration(warmup_steps: int) -> int:
    """The step of this process (1-based) that is captured: the first after the warm-up, and
    never the first step (it creates the Adam state and the step counters)."""
    return max(warmup_steps, 1) + 1


def inner_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The torch optimizers under a megatron-core optimizer (chained or not), stubs left out."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part.optimizer for part in parts if getattr(part, "optimizer", None) is not None]


def _home(group: dict, name: str) -> torch.device:
    """Where a group's live value belongs: on its parameters' device. In a group without
    parameters the learning rate stays where it is (no kernel reads it) and a step count goes
    to the GPU (Transformer Engine counts the steps of empty groups there too)."""
    value = group[name]
    if group["params"]:
        return group["params"][0].device
    if name == "lr" and torch.is_tensor(value):
        return value.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_live(value, like: Optional[torch.Tensor], device: torch.device,
             dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    """``value`` (a number or tensor) in the bound tensor ``like``, or a new tensor when there
    is none yet (before capture only)."""
    if like is not None:
        if torch.is_tensor(value):
            like.copy_(value.reshape(like.shape))
        else:
            like.fill_(value)
        return like
    if torch.is_tensor(value) and value.device == device and value.dtype == dtype:
        return value
    if torch.is_tensor(value):
        return value.detach().to(device=device, dtype=dtype).reshape(shape)
    return torch.full(shape, value, dtype=dtype, device=device)


class StepTensors:
    """The tensors of the torch optimizers that a captured step reads by address, kept bound.

    Before capture `make_live` turns each group's ``lr`` and ``step`` (where present) into
    device tensors, once, and puts them back whenever something rebound them (a checkpoint
    load: its values are copied in). At capture `record` also notes each parameter's state
    tensors and the weight decays; `restore`, before every replay, checks the bindings (host
    only, a few identity tests per group) and copies any rebound value into the captured
    tensor, which is put back.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        self._live: Dict[Tuple[int, int, str], torch.Tensor] = {}  # (optimizer, group, key)
        self._state: Dict[Tuple[int, torch.Tensor, str], torch.Tensor] = {}  # per parameter
        self._containers: List[Tuple[object, object]] = []  # (param_groups, state) objects
        self._weight_decay: Dict[Tuple[int, int], float] = {}

    def make_live(self) -> None:
        """Each group's ``lr`` (float32) and ``step`` (if the optimizer keeps one per group)
        as the device tensor bound to it; a rebound value is copied in. No host sync, except
        to copy a value from host memory (a checkpoint's)."""
        for i, optimizer in enumerate(self.optimizers):
            for g, group in enumerate(optimizer.param_groups):
                self._bind(group, (i, g, "lr"), _home(group, "lr"), torch.float32, ())
                if "step" in group:
                    step = group["step"]
                    dtype = step.dtype if torch.is_tensor(step) else torch.int32
                    self._bind(group, (i, g, "step"), _home(group, "step"), dtype, (1,))

    def _bind(self, group: dict, key, device, dtype, shape) -> None:
        bound = self._live.get(key)
        value = group[key[2]]
        if value is bound:
            return
        live = _as_live(value, bound, device, dtype, shape)
        self._live[key] = live
        group[key[2]] = live

    def record(self) -> None:
        """Note what the captured step reads: the bound tensors, each parameter's state
        tensors (Adam moments, torch's per-parameter step), the weight decays."""
        self.make_live()
        self._containers = [(opt.param_groups, opt.state) for opt in self.optimizers]
        for i, optimizer in enumerate(self.optimizers):
            for g, group in enumerate(optimizer.param_groups):
                self._weight_decay[(i, g)] = group["weight_decay"]
                for param in group["params"]:
                    for name, value in optimizer.state.get(param, {}).items():
                        if torch.is_tensor(value):
                            self._state[(i, param, name)] = value

    def restore(self) -> bool:
        """Before a replay: put the captured tensors back where something rebound them, with
        the new values copied in. Returns whether anything was rebound. Raises if a weight
        decay changed since capture (the graph holds the old one). No host sync, except to copy
        a value from host memory (a checkpoint's)."""
        rebound = False
        for i, optimizer in enumerate(self.optimizers):
            groups, state = self._containers[i]
            if optimizer.param_groups is not groups or optimizer.state is not state:
                self._restore_state(i, optimizer)
                self._containers[i] = (optimizer.param_groups, optimizer.state)
                rebound = True
            for g, group in enumerate(optimizer.param_groups):
                for name in ("lr", "step"):
                    live = self._live.get((i, g, name))
                    if live is not None and group.get(name) is not live:
                        self._bind(group, (i, g, name), None, None, None)
                        rebound = True
                if group["weight_decay"] != self._weight_decay[(i, g)]:
                    raise RuntimeError(
                        f"The weight decay of parameter group {g} changed after the optimizer "
                        f"step was captured ({self._weight_decay[(i, g)]} -> "
                        f"{group['weight_decay']}); the graph holds the old value. A "
                        "weight-decay schedule is not supported with --optimizer-cuda-graph.")
        return rebound

    @contextmanager
    def as_numbers(self) -> Iterator[None]:
        """Within this block each group's ``lr`` and ``step`` tensor is a Python number (one
        host read each); the same tensors are put back on exit. For a checkpoint's state dict:
        megatron-core's distributed optimizer merges Transformer Engine's per-group step
        counts in a set (``DistributedOptimizer.state_dict``) and asserts one value, which one
        tensor object per group never is; numbers also load into a run without the graph."""
        swapped = []
        try:
            for optimizer in self.optimizers:
                for group in optimizer.param_groups:
                    for name in ("lr", "step"):
                        value = group.get(name)
                        if torch.is_tensor(value) and value.numel() == 1:
                            swapped.append((group, name, value))
                            group[name] = value.item()
            yield
        finally:
            for group, name, value in swapped:
                group[name] = value

    def _restore_state(self, i: int, optimizer: torch.optim.Optimizer) -> None:
        for (j, param, name), captured in self._state.items():
            if j != i:
                continue
            current = optimizer.state.get(param, {}).get(name)
            if current is None:
                raise RuntimeError(
                    f"The optimizer state lost {name!r} of a parameter after the step was "
                    "captured (a checkpoint without it?); the captured step reads it.")
            if current is not captured:
                captured.copy_(current)
                optimizer.state[param][name] = captured


def check_capturable(optimizer) -> None:
    """Raise ``ValueError`` unless megatron-core's ``optimizer.step()`` can be captured as is
    (see the module doc). Host only."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    what = "--optimizer-cuda-graph is wrong: "
    if len(parts) > 1:
        raise ValueError(what + f"{len(parts)} chained optimizers (MoE expert parameters). "
                         "megatron-core merges their gradient norms and step counts on the "
                         "host; drop --optimizer-cuda-graph for this model.")
    for part in parts:
        if getattr(part, "grad_scaler", None) is not None:
            raise ValueError(what + "a loss scaler. Its found-inf flag is read on the host "
                             "every step; train in bf16 (--bf16) or fp32.")
        config = getattr(part, "config", None)
        if config is not None and config.log_num_zeros_in_grad:
            raise ValueError(what + "counting zero gradients. The count is read on the host "
                             "inside the step; drop --log-num-zeros-in-grad.")
        inner = getattr(part, "optimizer", None)
        if inner is not None and not _capturable(inner):
            raise ValueError(what + f"{type(inner).__name__} was built without capturable "
                             "kernels. Build it from OptimizerConfig(optimizer_cuda_graph=True).")
        if config is not None and config.clip_grad > 0 and not _clipping_on_device():
            raise ValueError(what + "gradient clipping reads the norm on the host. Apply "
                             "megatron.packed_upstream.patches.apply_core_patches() first, "
                             "or install Transformer Engine >= 2.14.")


def _capturable(inner: torch.optim.Optimizer) -> bool:
    if hasattr(inner, "capturable"):  # Transformer Engine's and apex's FusedAdam
        return bool(inner.capturable)
    return all(group.get("capturable", False) for group in inner.param_groups)


def _clipping_on_device() -> bool:
    """megatron-core clips on the device with TE >= 2.14's tensor-scale kernel, or under the
    fork's patch (megatron_optimizer.clip_gradients_without_host_sync)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mixed_precision

    return (clip_grads.multi_tensor_scale_tensor_impl is not None
            or mixed_precision.get_grad_norm_fp32 is megatron_optimizer.grad_norm_on_device)


class OptimizerGraph:
    """Stands in for megatron-core's ``optimizer.step``: eager up to ``capture_at``, captured
    at step ``capture_at`` (1-based, counted by this object), replayed after; ``capture_at``
    None: always eager, with the same live tensors (a reference for tests).

    ``step``: the original ``optimizer.step``; ``optimizers``: the torch optimizers under it
    (`inner_optimizers`). Calls return what ``step()`` returns (see the module doc for the
    graph-owned ``grad_norm``).
    """

    def __init__(self, step: Callable, optimizers: Sequence[torch.optim.Optimizer],
                 capture_at: Optional[int]):
        if capture_at is not None and capture_at < 2:
            raise ValueError(f"The optimizer graph's capture step is wrong: {capture_at}. "
                             "Capture at step 2 or later: the first step creates the state.")
        self.step_fn = step
        self.tensors = StepTensors(optimizers)
        self.tensors.make_live()  # before the scheduler's next write: it fills them from then on
        self.capture_at = capture_at
        self.steps = 0  # steps taken through this object
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.result = None  # the captured step's return value (graph-owned tensors)
        self._stats: dict = {}

    @classmethod
    def for_optimizer(cls, optimizer, capture_at: Optional[int]) -> "OptimizerGraph":
        """Checked (`check_capturable`) graph for a megatron-core optimizer; not installed."""
        check_capturable(optimizer)
        return cls(optimizer.step, inner_optimizers(optimizer), capture_at)

    @classmethod
    def install(cls, settings: GraphSettings, optimizer, runtime) -> Optional["OptimizerGraph"]:
        """With ``--optimizer-cuda-graph`` (``settings.optimizer_graph``; settings.py): make
        ``optimizer.step`` this graph (as megatron-core's training loop wraps it), captured
        after ``settings.warmup_steps``; have the ``state_dict`` of each part of ``optimizer``
        hold the live values as numbers (`StepTensors.as_numbers`), and add the graph's
        statistics to ``runtime``'s (a `GraphRuntime`). Returns it; None without the flag.

        The parts' ``state_dict``, not the optimizer's: megatron-core's ChainedOptimizer (what
        get_megatron_optimizer returns, here around one part) hands a save to its part's
        ``sharded_state_dict``, which calls that part's own ``state_dict``."""
        if not settings.optimizer_graph:
            return None
        graph = cls.for_optimizer(optimizer, capture_iteration(settings.warmup_steps))
        megatron_optimizer.install_optimizer_step(optimizer, graph)
        for part in getattr(optimizer, "chained_optimizers", [optimizer]):
            megatron_optimizer.run_state_dict_within(part, graph.tensors.as_numbers)
        runtime.add_statistics(graph.statistics)
        return graph

    def describe(self) -> str:
        """One start-up log line."""
        return (f"optimizer graph: optimizer.step captured at step {self.capture_at} of this "
                f"process ({self.capture_at - 1} eager), then replayed; learning rate and Adam "
                "step count are device tensors")

    def statistics(self) -> dict:
        """This object's counters since the last call (the runtime adds them to the iteration's
        statistics): eager steps, and at the capture its time and graph memory."""
        stats, self._stats = self._stats, {}
        return stats

    def __call__(self):
        self.steps += 1
        if self.graph is not None:
            self.tensors.restore()
            self.graph.replay()
            return self.result
        self.tensors.make_live()  # a checkpoint load may have rebound them
        if self.capture_at is None or self.steps < self.capture_at:
            self._stats[EAGER_KEY] = self._stats.get(EAGER_KEY, 0) + 1
            return self.step_fn()
        return self._capture()

    def _capture(self):
        """Capture the step (syncs the device; with torch.distributed, a barrier: every rank
        captures the step's collectives at the same step), then replay it: capture only
        records."""
        try:
            graph, result, seconds, graph_bytes = capture_in_own_pool(self.step_fn)
        except RuntimeError as err:
            raise RuntimeError(
                "Capturing the optimizer step failed; most likely something in it reads a "
                "device value on the host (tools/find_host_syncs.py shows where). Run without "
                "--optimizer-cuda-graph meanwhile.") from err
        self.tensors.record()
        self.graph, self.result = graph, result
        self._stats |= {"optimizer graph capture (s)": round(seconds, 3),
                        "optimizer graph memory (MiB)": round(graph_bytes / 2**20, 1)}
        graph.replay()
        return result
