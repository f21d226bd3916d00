"""Reaches into megatron-core's optimizer, for megatron-core 0.19.2 (`gate.PATCHED_VERSION`).

* `sync_free_multi_tensor_fallbacks`, `clip_gradients_without_host_sync` (patches): gradient
  norm and clipping without host syncs where neither TE >= 2.14 nor apex provides the kernels.
* `keep_loss_scale_on_host`: a bf16 optimizer's loss scale of one as a host scalar, so the
  loss is not multiplied by a tensor read back every iteration.
* `install_optimizer_step`, `run_state_dict_within`: the optimizer graph replaces the
  optimizer's step and runs its state_dict inside the graph's scope.
"""

from typing import Callable, ContextManager
import torch
from megatron.core.optimizer import clip_grads

from megatron.packed_upstream.gate import patch



UPSTREAM_GET_GRAD_NORM = clip_grads.get_grad_norm_fp32


UPSTREAM_CLIP_BY_TOTAL_NORM = clip_grads.clip_grad_by_total_norm_fp32


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm`` contract with torch's foreach kernels: ``([norm], None)``."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    return torch.nn.utils.get_total_norm(tensors, 2.0).float().reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale`` contract: ``dst[i] = src[i] * scale``, foreach kernels."""
    src, dst = tensor_lists
    if src:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


@patch
def sync_free_multi_tensor_fallbacks() -> str:
    """Replace megatron-core's multi-tensor fallbacks used when neither TE >= 2.14 nor apex is there.

    clip_grads.py takes TE's kernels only when TE exports ``multi_tensor_scale_tensor``
    (TE >= 2.14); with TE 2.11 or no TE it falls back to ``local_multi_tensor_l2_norm``,
    which builds a CPU tensor from the per-tensor CUDA norms (one host sync per gradient
    tensor per step), and ``local_multi_tensor_scale``, one kernel per tensor. Torch's
    foreach kernels do both in a few launches and no sync. Only the fallbacks are replaced.
    """
    from megatron.core import utils
    from megatron.core.optimizer import optimizer as mixed_precision

    replaced = []
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
        replaced.append("l2 norm")
    for module in (clip_grads, mixed_precision):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
            replaced.append(f"scale ({module.__name__.rsplit('.', 1)[-1]})")
    return ", ".join(replaced) or "not needed: TE or apex kernels are installed"


def grad_norm_on_device(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """``get_grad_norm_fp32`` without the final ``.item()``: the L2 norm as a 0-dim CUDA tensor.

    Same kernel (clip_grads' ``l2_norm_impl``) and the same all-reduce; other norm types and
    DTensor (FSDP) gradients take upstream's path.
    """
    grads = grads_for_norm if isinstance(grads_for_norm, list) else [grads_for_norm]
    dtensor_group = None
    for grad in grads:
        dtensor_group = clip_grads.get_data_parallel_group_if_dtensor(grad, dtensor_group)
    if float(norm_type) != 2.0 or dtensor_group is not None:
        return UPSTREAM_GET_GRAD_NORM(grads_for_norm, norm_type, grad_stats_parallel_group)
    if grads:
        flag = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, flag, [grads], False)
    else:
        norm = torch.zeros(1, dtype=torch.float, device="cuda")
    squared = norm.float() ** 2
    torch.distributed.all_reduce(squared, op=torch.distributed.ReduceOp.SUM,
                                 group=grad_stats_parallel_group)
    return squared.sqrt().reshape(())


def clip_by_device_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """``clip_grad_by_total_norm_fp32`` for a norm on the device: scale by ``min(1, coeff)``.

    Upstream compares the coefficient with 1 on the host unless TE >= 2.14 gives it a
    tensor-scale kernel; multiplying by a coefficient clamped to 1 gives the same gradients
    (``x * 1.0 == x``) without reading it.
    """
    if not torch.is_tensor(total_norm):
        return UPSTREAM_CLIP_BY_TOTAL_NORM(parameters, max_norm, total_norm, use_decoupled_grad)
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [clip_grads.to_local_if_dtensor(getattr(p, attr)).detach()
             for p in (parameters if isinstance(parameters, list) else [parameters])
             if getattr(p, attr, None) is not None]
    if grads:
        torch._foreach_mul_(grads, (max_norm / (total_norm + 1.0e-6)).clamp(max=1.0))


@patch
def clip_gradients_without_host_sync() -> str:
    """Keep the gradient norm on the GPU where upstream still reads it on the host.

    0.19.2 keeps the norm on the device only when TE exports ``multi_tensor_scale_tensor``
    (TE >= 2.14, clip_grads.py); otherwise ``get_grad_norm_fp32`` ends with ``.item()`` and
    ``clip_grad_by_total_norm_fp32`` decides on the host whether to scale. That sync sits
    between the backward and the optimizer kernels of every step, so the GPU drains while
    Python launches the optimizer (docs/benchmarks.md). Patched where the optimizers look the
    two functions up (optimizer.py); the step then returns the norm as a tensor, which the
    training loop reads only when it logs.
    """
    if clip_grads.multi_tensor_scale_tensor_impl is not None:
        return "not needed: upstream clips on the device with TE's multi_tensor_scale_tensor"
    from megatron.core.optimizer import optimizer as mixed_precision

    mixed_precision.get_grad_norm_fp32 = grad_norm_on_device
    mixed_precision.clip_grad_by_total_norm_fp32 = clip_by_device_norm
    return "applied"


LOSS_SCALE_ONE = torch.tensor(1.0)  # 0-dim on the host: a scalar operand for a CUDA loss


def keep_loss_scale_on_host(optimizer) -> bool:
    """Without a loss scaler (bf16, fp32), make ``optimizer.get_loss_scale()`` return the host
    scalar 1.0 instead of upstream's one-element CUDA tensor, on the optimizer and each chained
    one: train() calls ``.item()`` on it every iteration, a device sync. ``scale_loss`` and
    megatron-core's schedules multiply the loss by it as before (a 0-dim host tensor is a scalar
    operand of a CUDA op; the product is the loss, bitwise). With a loss scaler (fp16) the scale
    lives on the device and changes: nothing is replaced. Returns whether it replaced it."""
    parts = [optimizer, *getattr(optimizer, "chained_optimizers", [])]
    if any(getattr(part, "grad_scaler", None) is not None for part in parts):
        return False
    for part in parts:
        part.get_loss_scale = lambda: LOSS_SCALE_ONE
    return True


def install_optimizer_step(optimizer, step: Callable) -> None:
    """Make ``optimizer.step`` ``step`` (the fork's optimizer graph), as Megatron-LM's own
    optimizer-graph wrapper replaces the step of the optimizer ``train()`` calls."""
    optimizer.step = step


def run_state_dict_within(part, scope: Callable[[], ContextManager]) -> None:
    """Make ``part.state_dict()`` run inside ``scope()``.

    megatron-core's ``ChainedOptimizer`` saves through each part's ``sharded_state_dict``,
    which calls the part's own ``state_dict``: the one place a save reads the live values."""
    upstream = part.state_dict

    def state_dict(*positional, **keywords):
        with scope():
            return upstream(*positional, **keywords)

    part.state_dict = state_dict

