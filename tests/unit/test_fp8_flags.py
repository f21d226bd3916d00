"""Megatron-LM's FP8 flags on packed rows (fp8_flags.py): each refusal names the flag, the value
and a valid one; what passes gets the start-up note on what stays BF16. The rules are called on
copies of tests/unit/test_extra_args.py's parsed baseline; one launch line goes through the
whole parser."""

import copy
import re

import pytest

from megatron.packed_training.arguments import parse_args
from megatron.packed_training.fp8_flags import check_fp8
from tests.unit.test_extra_args import BASE, parsed, pin_importable  # noqa: F401  (parsed)

HOPPER, BLACKWELL = (9, 0), (10, 0)


def fp8(parsed, **values):
    args = copy.deepcopy(parsed)
    values = {"fp8": "e4m3", "fp8_recipe": "tensorwise",
              "transformer_impl": "transformer_engine", "packed_notes": []} | values
    for name, value in values.items():
        setattr(args, name, value)
    return args


def check(args, model="gpt", te_attention=True, cuda_version=(13, 0), capability=HOPPER):
    check_fp8(args, model, te_attention=te_attention, cuda_version=cuda_version,
              capability=capability)
    return args


def test_tensorwise_blockwise_and_delayed_pass_on_hopper_with_the_bf16_attention_note(parsed):
    for recipe in ("tensorwise", "blockwise", "delayed"):
        args = check(fp8(parsed, fp8_recipe=recipe))  # seq 128, one micro-batch of 1 row
        assert args.packed_notes == [f"FP8 (e4m3, {recipe} scaling): the linear layers' GEMMs; "
                                     "core attention on packed THD stays BF16 (cuDNN's FP8 "
                                     "attention takes no THD layout)"]
    assert check(fp8(parsed, fp8=None)).packed_notes == []  # no FP8: nothing to say


@pytest.mark.parametrize("values,flag,value,fix", [
    ({"seq_length": 120}, "--seq-length", 120, "use --seq-length 128"),
    ({"seq_length": 120, "fp8_recipe": "blockwise"}, "--seq-length", 120,
     "a multiple of 128 rows per rank"),
    ({"seq_length": 128, "context_parallel_size": 2, "fp8_recipe": "blockwise"}, "--seq-length",
     128, "use --seq-length 256"),
])
def test_positions_per_rank_must_fill_whole_fp8_blocks(parsed, values, flag, value, fix):
    args = fp8(parsed, **values)
    with pytest.raises(ValueError, match=re.escape(f"{flag} is wrong: {value}.")) as error:
        check(args)
    assert fix in str(error.value)


def test_context_parallel_ranks_each_take_whole_blocks(parsed):
    check(fp8(parsed, seq_length=256, context_parallel_size=2, fp8_recipe="blockwise"))


def test_sequence_parallelism_splits_the_rows_over_tensor_parallel_ranks_too(parsed):
    args = fp8(parsed, seq_length=128, tensor_model_parallel_size=2, sequence_parallel=True,
               fp8_recipe="blockwise")
    with pytest.raises(ValueError, match=r"--seq-length is wrong: 128\. .* 128 positions split "
                                         r"over 2 rank\(s\) \(context parallel x tensor "
                                         r"parallel \(sequence parallelism\)\) .* use "
                                         r"--seq-length 256"):
        check(args)
    check(fp8(parsed, seq_length=256, tensor_model_parallel_size=2, sequence_parallel=True,
              fp8_recipe="blockwise"))


def test_recipes_the_gpu_or_cuda_cannot_run_are_refused(parsed):
    with pytest.raises(ValueError, match=r"--fp8-recipe is wrong: mxfp8\. It needs a Blackwell "
                                         r"GPU \(sm100\) and this one is sm90; use --fp8-recipe "
                                         r"tensorwise"):
        check(fp8(parsed, fp8_recipe="mxfp8"))
    check(fp8(parsed, fp8_recipe="mxfp8"), capability=BLACKWELL)
    check(fp8(parsed, fp8_recipe="mxfp8"), capability=None)  # no GPU at parse time: the run's
    with pytest.raises(ValueError, match=r"--fp8-recipe is wrong: blockwise\. It needs CUDA "
                                         r"12\.9 or newer and torch runs CUDA 12\.4"):
        check(fp8(parsed, fp8_recipe="blockwise"), cuda_version=(12, 4))
    nvfp4 = fp8(parsed, fp8=None, fp4="e2m1")
    with pytest.raises(ValueError, match=r"--fp4-format is wrong: e2m1\. NVFP4 needs a "
                                         r"Blackwell GPU \(sm100\) and this one is sm90"):
        check(nvfp4)


def test_fp8_needs_transformer_engines_linears_and_attention(parsed):
    for args, te_attention in ((fp8(parsed, transformer_impl="local"), True),
                               (fp8(parsed), False)):
        with pytest.raises(ValueError, match=r"--fp8-format is wrong: e4m3\. FP8 GEMMs are "
                                             r"Transformer Engine's"):
            check(args, te_attention=te_attention)


def test_the_hybrids_mamba_input_projection_must_be_a_multiple_of_16_wide(parsed):
    # 2 x 8 heads x 64 + 2 x 1 group x 128 + 8 heads = 1288: not a multiple of 16.
    mamba = dict(mamba_num_heads=8, mamba_head_dim=64, mamba_num_groups=1, mamba_state_dim=128)
    with pytest.raises(ValueError, match=r"--mamba-num-heads is wrong: 8\. Mamba's FP8 input "
                                         r"projection is 1288 wide"):
        check(fp8(parsed, **mamba), model="hybrid")
    args = check(fp8(parsed, **(mamba | {"mamba_num_heads": 16})), model="hybrid")  # 2320
    assert args.packed_notes[0].endswith("Mamba's SSD and conv kernels BF16")


def test_a_launch_line_with_fp8_on_the_te_free_path_is_refused_at_parse_time(monkeypatch):
    from megatron.packed_training import extra_args

    pin_importable(monkeypatch)  # no Transformer Engine: the TE-free path
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"--fp8-format is wrong: e4m3\. FP8 GEMMs are "
                                         r"Transformer Engine's"):
        parse_args(BASE + ["--fp8-format", "e4m3"], raise_on_error=True)
    assert extra_args.check_fp8 is check_fp8  # the one rule set the parser runs
