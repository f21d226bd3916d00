"""Padding never reaches an FP8 scale (megatron/packed_model/padding_rows.py), on the GPU with
Transformer Engine's FP8 linears: the fork's GPT layers (TE attention) and a Mamba layer,
bf16 parameters, inside megatron-core's FP8 context for each Hopper recipe.

A packed row of 128 positions holds documents, CP-style padding after a document's last token
(inside its segment) and a padding-only tail. Its padding rows are filled with NaN, 1e30 or
zeros before the layers run (as a static graph buffer may hold anything there). With
``zero_padding_rows`` (what ``--fp8-format`` sets) the document rows' outputs, the input
gradient and every parameter gradient are bit for bit those of zero padding: a padding
value that reached an amax (tensorwise: one per GEMM input; delayed: the amax history;
blockwise: the weight gradient's 128-token blocks) would move every document token. The
control: without the flag, NaN padding reaches the scales and the document rows change. And
the same documents in a row with 128 more padding positions give the same document outputs
and delayed-scaling state, bit for bit.

Run: ``python -m pytest -q tests/gpu/test_fp8_padding.py`` (one GPU, TE, mamba-ssm).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_training.extra_args import is_importable

ROW = 128
# Segments: a 40-token document padded to 48 (CP-style padding attends to it), a 32-token
# document, a padding-only tail of 48.
CU_SEQLENS = [0, 48, 80, 128]
DOCUMENT_TOKENS = [(0, 40), (48, 80)]
HIDDEN = 128
RECIPES = ["tensorwise", "blockwise", "delayed"]

pytestmark = pytest.mark.skipif(not is_importable("transformer_engine"),
                                reason="FP8 needs Transformer Engine (pip install -e .[te])")


def padding() -> torch.Tensor:
    mask = torch.ones(ROW, dtype=torch.bool)
    for start, end in DOCUMENT_TOKENS:
        mask[start:end] = False
    return mask


def config(recipe: str, zero_padding_rows: bool):
    from megatron.packed_training.config import PackedTransformerConfig

    return PackedTransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=True, params_dtype=torch.bfloat16, fp8="e4m3", fp8_recipe=recipe,
        mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=64,
        zero_padding_rows=zero_padding_rows)


def build(kind: str, recipe: str, zero_padding_rows: bool) -> torch.nn.ModuleList:
    """Two GPT layers (TE attention) or a Mamba layer and a GPT layer."""
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.transformer.spec_utils import build_module

    from megatron.packed_graphs.specs import gpt_layer_spec, hybrid_stack_spec

    cfg = config(recipe, zero_padding_rows)
    torch.manual_seed(0)
    specs = [gpt_layer_spec("te")] * 2
    if kind == "hybrid":
        specs[0] = hybrid_stack_spec("te").submodules.mamba_layer
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups()
    with get_fp8_context(cfg, is_init=True):
        layers = torch.nn.ModuleList(
            build_module(spec, config=cfg, layer_number=i + 1, pg_collection=groups)
            for i, spec in enumerate(specs)).cuda()
    with torch.no_grad():  # a QKV bias that reaches the padding rows through V
        for layer in layers:
            if hasattr(layer, "self_attention"):
                layer.self_attention.linear_qkv.bias.normal_()
    return layers


def run(layers, recipe: str, zero_padding_rows: bool, padding_value: float, tail: int = 0):
    """Two steps' forward and backward (delayed scaling's history moves between them) on the
    row with ``padding_value`` in its padding rows, ``tail`` more padding positions at its
    end: the document rows' output and input gradient, every parameter gradient, and the
    TE modules' delayed-scaling state (amax histories and scales; empty for the other
    recipes), of the second."""
    from megatron.core.fp8_utils import get_fp8_context

    cfg = config(recipe, zero_padding_rows)
    cu_seqlens = CU_SEQLENS[:-1] + [ROW + tail]  # the tail segment grows
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device="cuda")
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu_seqlens, cu_seqlens[1:])])
    params = build_packed_batch_params(cu, positions.cuda(), ROW + tail, with_seq_idx=True)
    pad = torch.cat([padding(), torch.ones(tail, dtype=torch.bool)]).cuda()
    params.padding_mask = pad
    generator = torch.Generator(device="cuda").manual_seed(1)

    def rows(shape):  # the same values at every tail length; zero in the tail
        values = torch.randn(ROW, *shape, device="cuda", dtype=torch.bfloat16,
                             generator=generator)
        return torch.cat([values, values.new_zeros(tail, *shape)])

    for _ in range(2):
        for p in layers.parameters():
            p.grad = None
        hidden = rows((1, HIDDEN))
        hidden[pad] = padding_value
        hidden.requires_grad_(True)
        out = hidden
        with get_fp8_context(cfg):
            for layer in layers:
                out = layer(out, attention_mask=None, packed_seq_params=params)
                out = out[0] if isinstance(out, tuple) else out
        weights = rows(out.shape[1:])
        (torch.nan_to_num(out.float()) * weights.float() * (~pad).view(-1, 1, 1)).sum().backward()
    grads = {name: p.grad.clone() for name, p in layers.named_parameters() if p.grad is not None}
    delayed_state = [getattr(meta, field).clone()
                     for module in layers.modules() if recipe == "delayed"
                     for key, meta in sorted(getattr(module, "fp8_meta", {}).items())
                     if key.startswith("scaling_") for field in ("amax_history", "scale")]
    return out.detach()[~pad], hidden.grad[~pad], grads, delayed_state


def same_weights(kind: str, recipe: str):
    """The first build of ``kind``'s layers, and a function that builds fresh ones with its
    weights: delayed scaling's amax history lives in the modules and starts empty in each (a
    state_dict taken before any FP8 forward holds none, and megatron-core's RNG tracker
    initialises a second build differently)."""
    first = build(kind, recipe, zero_padding_rows=True)
    weights = {k: v.clone() for k, v in first.state_dict().items() if "_extra_state" not in k}

    def fresh():
        layers = build(kind, recipe, zero_padding_rows=True)
        layers.load_state_dict(weights, strict=False)
        return layers

    return first, fresh


def skip_unrunnable(kind: str, recipe: str) -> None:
    if kind == "hybrid" and not (is_importable("mamba_ssm") and is_importable("causal_conv1d")):
        pytest.skip("needs mamba-ssm and causal-conv1d (pip install -e .[mamba])")
    if recipe == "blockwise" and torch.version.cuda and \
            tuple(map(int, torch.version.cuda.split(".")[:2])) < (12, 9):
        pytest.skip("blockwise FP8 needs CUDA 12.9 or newer")


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_padding_rows_move_no_fp8_scale(dist, kind, recipe):
    skip_unrunnable(kind, recipe)
    first, fresh = same_weights(kind, recipe)
    clean = run(first, recipe, True, 0.0)
    for value in (float("nan"), 1e30):
        got = run(fresh(), recipe, True, value)
        assert torch.equal(got[0], clean[0]), (kind, recipe, value, "output")
        assert torch.equal(got[1], clean[1]), (kind, recipe, value, "input gradient")
        assert got[2].keys() == clean[2].keys() and len(clean[2]) > 4
        for name, grad in clean[2].items():
            assert torch.equal(got[2][name], grad), (kind, recipe, value, name)
        assert all(torch.equal(a, b) for a, b in zip(got[3], clean[3], strict=True))
    assert all(torch.isfinite(t).all() for t in (clean[0], clean[1], *clean[2].values()))

    # The control: without the flag, NaN padding reaches the scales and the documents.
    plain = build(kind, recipe, zero_padding_rows=False)
    moved = run(plain, recipe, False, float("nan"))
    assert not (torch.isfinite(moved[0]).all() and torch.isfinite(moved[1]).all()
                and all(torch.isfinite(g).all() for g in moved[2].values()))


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_more_padding_moves_no_fp8_scale(dist, kind, recipe):
    """The same documents in a row of 128 and of 256 positions (128 more padding): the same
    document outputs and input gradients bit for bit, the same delayed-scaling amax history
    and scales; parameter gradients sum zero rows more (a longer reduction)."""
    skip_unrunnable(kind, recipe)
    first, fresh = same_weights(kind, recipe)
    short = run(first, recipe, True, 0.0)
    long = run(fresh(), recipe, True, 0.0, tail=ROW)
    assert torch.equal(long[0], short[0]) and torch.equal(long[1], short[1]), (kind, recipe)
    for name, grad in short[2].items():
        torch.testing.assert_close(long[2][name], grad, msg=lambda m: f"{name}: {m}")
    assert all(torch.equal(a, b) for a, b in zip(long[3], short[3], strict=True)), recipe
    assert bool(short[3]) == (recipe == "delayed")
