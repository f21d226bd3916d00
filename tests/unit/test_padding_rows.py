"""Padding rows held at zero under FP8 (megatron/packed_model/padding_rows.py), on the fork's
GPT layers (graph-safe TransformerLayer, packed self-attention with the TE-free varlen
attention) on CPU.

The FP8 kernels are GPU-only (tests/gpu/test_fp8_padding.py checks their amax and scales);
what makes them see only document tokens is checked here on the same layers: with
``zero_padding_rows`` every linear reads exactly zero padding rows and gets exactly zero
output gradients there, whatever a buffer held in them (NaN, 1e30), and the document rows'
outputs and gradients are bit for bit those of clean padding. The row has both kinds of
padding: positions after a document's last token inside its segment (as context
parallelism pads, which attend to the document) and a padding-only tail segment.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_graphs.specs import gpt_layer_spec
from megatron.packed_model.padding_rows import (ZeroedPaddingRowsInput, layer_padding_mask,
                                                zero_padding_rows)
from megatron.packed_training.config import PackedTransformerConfig

# Segments [0, 8) and [8, 12): a document of 5 tokens padded to 8 (CP-style), then a padding
# tail of 4; the second document [12, 16).
CU_SEQLENS = [0, 8, 12, 16]
PADDING = [False] * 5 + [True] * 7 + [False] * 4
HIDDEN = 32


def layers(zero_padding_rows: bool, count: int = 2):
    from megatron.core.transformer.spec_utils import build_module

    config = PackedTransformerConfig(
        num_layers=count, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=True, bias_dropout_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, zero_padding_rows=zero_padding_rows)
    torch.manual_seed(0)
    stack = torch.nn.ModuleList(build_module(gpt_layer_spec("torch"), config=config,
                                             layer_number=i + 1) for i in range(count))
    with torch.no_grad():  # a QKV bias that reaches the padding rows through V
        for layer in stack:
            layer.self_attention.linear_qkv.bias.normal_()
    return stack


def params():
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(CU_SEQLENS, CU_SEQLENS[1:])])
    packed = build_packed_batch_params(cu, positions, 8, with_seq_idx=False)
    packed.padding_mask = torch.tensor(PADDING)
    return packed


def run(stack, padding_value: float):
    """The stack on a row whose padding rows hold ``padding_value``: every linear's input and
    output gradient, the output and the input gradient. The loss weighs document rows only,
    as the loss mask does."""
    seen = {"inputs": [], "output_grads": []}

    def record_input(module, args):
        seen["inputs"].append(args[0].detach().clone())

    def record_grad(module, grad_input, grad_output):
        seen["output_grads"].append(grad_output[0].detach().clone())

    def record_gemm_input(gemm_input):
        def recorded(input_):
            out = gemm_input(input_)
            seen["inputs"].append(out.detach().clone())
            return out
        return recorded

    handles = []
    for module in stack.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if isinstance(module, ZeroedPaddingRowsInput):  # zeroes its input in forward
                module.gemm_input = record_gemm_input(module.gemm_input)
            else:
                handles.append(module.register_forward_pre_hook(record_input))
            handles.append(module.register_full_backward_hook(record_grad))
    torch.manual_seed(1)
    hidden = torch.randn(len(PADDING), 1, HIDDEN)
    hidden[torch.tensor(PADDING)] = padding_value
    hidden.requires_grad_(True)
    out = hidden
    packed = params()
    for layer in stack:
        out, _ = layer(out, attention_mask=None, packed_seq_params=packed)
    weights = (~torch.tensor(PADDING)).float().view(-1, 1, 1) * torch.randn_like(out)
    (torch.nan_to_num(out) * weights).sum().backward()
    for handle in handles:
        handle.remove()
    for module in stack.modules():
        module.__dict__.pop("gemm_input", None)
    return seen, out.detach(), hidden.grad


@pytest.mark.parametrize("padding_value", [float("nan"), 1e30, 3.0])
def test_every_linear_reads_and_gets_zero_padding_rows(cpu_dist, padding_value):
    stack = layers(zero_padding_rows=True)
    seen, out, grad = run(stack, padding_value)
    pad = torch.tensor(PADDING)
    assert len(seen["inputs"]) == 8 and len(seen["output_grads"]) == 8  # 4 linears x 2 layers
    for tensor in seen["inputs"] + seen["output_grads"]:
        assert torch.equal(tensor[pad], torch.zeros_like(tensor[pad]))
        assert torch.isfinite(tensor).all() and tensor[~pad].abs().sum() > 0
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    # The document rows: bit for bit those of clean (zero) padding.
    _, clean_out, clean_grad = run(layers(zero_padding_rows=True), 0.0)
    assert torch.equal(out[~pad], clean_out[~pad]) and torch.equal(grad[~pad], clean_grad[~pad])


def test_without_the_flag_padding_rows_reach_the_linears(cpu_dist):
    """The control: the same layers without ``zero_padding_rows`` hand the linears non-zero
    padding rows (the QKV bias through V, CP-style padding attending to its document), and
    the document rows' outputs are those of the flag (it moves only padding rows)."""
    seen, out, _ = run(layers(zero_padding_rows=False), 0.0)
    pad = torch.tensor(PADDING)
    proj_inputs = seen["inputs"][1::4]  # per layer: qkv, proj, fc1, fc2
    assert all(t[pad].abs().sum() > 0 for t in proj_inputs)
    _, zeroed_out, _ = run(layers(zero_padding_rows=True), 0.0)
    assert torch.allclose(out[~pad], zeroed_out[~pad], rtol=0, atol=1e-6)


def test_zeroing_leaves_no_hook_and_the_checkpoint_keys_alone(cpu_dist):
    """megatron-core's layer graphs refuse a module with a pre-forward hook other than DDP's,
    and a checkpoint must load with or without FP8: the projections keep their names."""
    zeroed, plain = layers(zero_padding_rows=True), layers(zero_padding_rows=False)
    assert not any(module._forward_pre_hooks for module in zeroed.modules())
    assert zeroed.state_dict().keys() == plain.state_dict().keys()
    assert isinstance(zeroed[0].self_attention.linear_proj, ZeroedPaddingRowsInput)
    assert not isinstance(plain[0].self_attention.linear_proj, ZeroedPaddingRowsInput)


def test_the_mask_of_a_sequence_parallel_rank_is_its_share():
    class Group:
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    packed = params()
    assert layer_padding_mask(packed, 16).view(-1).tolist() == PADDING
    assert layer_padding_mask(packed, 16, Group(1, 0), True).view(-1).tolist() == PADDING
    assert layer_padding_mask(packed, 8, Group(2, 1), True).view(-1).tolist() == PADDING[8:]
    with pytest.raises(ValueError, match="padding_mask has 16 entries for 8 tokens"):
        layer_padding_mask(packed, 8, Group(1, 0), False)
    with pytest.raises(ValueError, match="3 entries for 2 rows"):
        zero_padding_rows(torch.ones(2, 4), torch.tensor([True, False, True]))
    packed.padding_mask = None
    assert layer_padding_mask(packed, 16) is None


def test_fp8_layers_refuse_a_micro_batch_without_its_padding_mask(cpu_dist):
    stack = layers(zero_padding_rows=True, count=1)
    packed = params()
    packed.padding_mask = None
    with pytest.raises(ValueError, match="padding_mask is None under FP8"):
        stack[0](torch.zeros(len(PADDING), 1, HIDDEN), attention_mask=None,
                 packed_seq_params=packed)
