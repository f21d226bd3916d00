"""Grouped GEMM whose group boundaries are a device tensor: the experts' matmul of dropless MoE.

``grouped_linear(x, weight, offsets)`` computes, for every group ``g``, ``x[s_g:e_g] @
weight[g].T`` into the same rows of the output, where ``e_g = offsets[g]`` and ``s_g`` the
previous end (0 for the first group). The group sizes are never read on the host, so the call
is capturable in a CUDA graph and replays correctly after new offsets were written into the
same tensor.

* **CUDA**: ``torch.nn.functional.grouped_mm`` (torch 2.11's public name of
  ``torch._grouped_mm``: CUTLASS kernels inside torch, sm_90 for bf16, differentiable). Its
  output rows past ``offsets[-1]`` are left uninitialised (pytorch#154557) and so are its
  input gradients there: callers must never read those rows (moe_dropless.py sends
  them nowhere). Inputs must be bf16 and row strides multiples of 16 bytes.
* **CPU** (tests): `_ReferenceGroupedLinear`, a loop over the groups that reads the offsets on
  the host (free on CPU) and computes each group exactly as megatron-core's local linear
  layers compute an expert (``matmul(x, w.t())``; backward ``grad.matmul(w)`` and
  ``grad.t().matmul(x)``), so a layer built on it can be compared bit for bit with
  megatron-core's SequentialMLP. Rows past ``offsets[-1]`` are zero.

Why every group holds at least one alignment unit (`group_alignment`): the weight gradient is
a grouped GEMM over the token dimension, whose per-group slices must start on 16 bytes; and
groups of zero rows have hung torch's grouped GEMM (torchtitan#1166) and get a non-zero weight
gradient on Blackwell (pytorch#172439). A group padded with zero rows computes a zero
gradient on every architecture.
"""

import torch
from torch import Tensor

GROUP_ALIGNMENT_BYTES = 16


def group_alignment(dtype: torch.dtype) -> int:
    """Rows each group is padded to (and its smallest size): 16 bytes of ``dtype`` elements,
    8 rows in bf16."""
    return max(1, GROUP_ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size())


def grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """``[M, N]``: group ``g`` of ``x`` (rows ``offsets[g-1]:offsets[g]``) times
    ``weight[g].T``.

    ``x``: ``[M, K]``; ``weight``: ``[G, N, K]`` (each group's weight in Linear layout, out x
    in); ``offsets``: int32 ``[G]``, the group ends, non-decreasing, ``offsets[-1] <= M``
    (unchecked: a check would read the device; a decreasing offset trips a device assert).
    Differentiable in ``x`` and ``weight``. No host sync on CUDA.
    """
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped GEMM operands are wrong: x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}. Pass x [rows, in] and weight [groups, out, in].")
    if offsets.dtype != torch.int32 or offsets.shape != (weight.shape[0],):
        raise ValueError(f"grouped GEMM offsets are wrong: {offsets.dtype} "
                         f"{tuple(offsets.shape)}. Pass one int32 group end per weight "
                         f"({weight.shape[0]}).")
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            raise ValueError(f"grouped GEMM dtype is wrong: x {x.dtype}, weight {weight.dtype}. "
                             "torch's grouped_mm takes bf16 on the GPU: train with --bf16.")
        return torch.nn.functional.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    return _ReferenceGroupedLinear.apply(x, weight, offsets)


class _ReferenceGroupedLinear(torch.autograd.Function):
    """The pure-torch grouped GEMM of CPU runs (module doc): one matmul per group, on the
    host's group boundaries, computed like megatron-core's local linear layers."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
        bounds = _group_bounds(offsets)
        ctx.save_for_backward(x, weight)
        ctx.bounds = bounds
        out = x.new_zeros(x.shape[0], weight.shape[1])
        for g, (start, end) in enumerate(bounds):
            out[start:end] = torch.matmul(x[start:end], weight[g].t())
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight)
        for g, (start, end) in enumerate(ctx.bounds):
            grad_x[start:end] = grad[start:end].matmul(weight[g])
            grad_weight[g] = grad[start:end].t().matmul(x[start:end])
        return grad_x, grad_weight, None


def _group_bounds(offsets: Tensor) -> list:
    """``[(start, end)]`` per group from the group ends (a host read: CPU only)."""
    ends = offsets.tolist()
    return list(zip([0] + ends[:-1], ends))
