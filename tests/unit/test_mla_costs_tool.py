"""tools/mla_costs.py on CPU: the moonlight-small flag set and the tool's own arguments (the
measurement itself needs a GPU with Transformer Engine)."""

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from megatron.packed_model import attention
from megatron.packed_training import extra_args
from megatron.packed_training.arguments import parse_args
from tests.unit.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
mla_costs = load_script("tools", "mla_costs.py")


def _parse(argv):
    """The training scripts' parser (Megatron-LM's with the fork's rules), a world of one."""
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "1", "RANK": "0"}):
        return parse_args(argv, "gpt")


@pytest.fixture(autouse=True)
def gpu_capability(monkeypatch):
    """Megatron-LM's check of --moe-grouped-gemm asks the GPU for its compute capability: an
    H100's here."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.fixture
def te_and_triton(monkeypatch):
    monkeypatch.setattr(extra_args, "is_importable",
                        lambda package: package in ("transformer_engine", "triton"))
    monkeypatch.setattr(attention, "is_te_available", lambda: True)


def test_moonlight_small_has_moonlights_ratios(te_and_triton):
    # The flags megatron-core's config receives (transformer_config_from_args needs TE here).
    config = _parse(mla_costs.MOONLIGHT_SMALL + mla_costs.TRAINING)
    hidden = config.hidden_size
    # Moonlight-16B-A3B: hidden 2048, 16 heads x v 128, kv_lora 512, experts 64 x 1408 wide,
    # top-6, two shared experts, no query compression, RoPE base 50000 without scaling.
    assert config.multi_latent_attention and config.qk_layernorm and config.q_lora_rank is None
    assert config.num_attention_heads * config.v_head_dim == hidden
    assert config.kv_lora_rank * 4 == hidden
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (128, 64, 128)
    assert config.moe_ffn_hidden_size == hidden * 1408 // 2048
    assert config.moe_shared_expert_intermediate_size == 2 * config.moe_ffn_hidden_size
    assert (config.num_experts, config.moe_router_topk) == (64, 6)
    assert config.moe_router_score_function == "sigmoid"
    assert config.moe_pad_expert_input_to_capacity and config.moe_grouped_gemm
    assert (config.rotary_base, config.rotary_scaling_factor) == (50000, 1.0)
    assert config.attention_backend.name == "auto"  # TE attention: TE is importable here
    # The old fork's numerics, which Megatron-LM's defaults would change.
    assert (config.normalization, config.add_bias_linear, config.hidden_dropout) == (
        "RMSNorm", False, 0.0)
    assert config.max_position_embeddings == config.seq_length == 4096


def test_moonlight_small_is_the_benchmark_preset_with_grouped_gemm_experts():
    """One definition: tools/benchmark.py's preset; the costs are measured on TE's grouped
    GEMM experts."""
    import benchmark  # tools/ is on the path: mla_costs imports it from there

    assert mla_costs.MOONLIGHT_SMALL == (benchmark.PRESETS["moonlight-small"][1]
                                         + benchmark.GROUPED_GEMM)


def test_moonlight_small_is_refused_without_transformer_engine(te_and_triton, monkeypatch):
    """Without TE, auto attention is the TE-free path, on which the model refuses MLA layers."""
    import pretrain_gpt
    from megatron.packed_training.config import transformer_config_from_args

    args = _parse(mla_costs.MOONLIGHT_SMALL + mla_costs.TRAINING + ["--num-layers", "1"])
    config = transformer_config_from_args(args)
    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)
    monkeypatch.setattr(attention, "is_te_available", lambda: False)
    with pytest.raises(ValueError, match="Packed multi-latent attention runs only on "
                                         "Transformer Engine attention"):
        pretrain_gpt.model_provider(args, config)


def test_document_lengths_fill_the_micro_batch():
    assert mla_costs.document_lengths(4096, 8) == [512] * 8
    assert mla_costs.document_lengths(10, 3) == [3, 3, 4]
    with pytest.raises(ValueError, match="documents is wrong: 0"):
        mla_costs.document_lengths(10, 0)


def test_capacities_must_hold_the_documents(capsys):
    with pytest.raises(SystemExit):
        mla_costs.parse(["--capacities", "4", "16", "--documents", "8"])
    assert "--capacities must be >= --documents (8)" in capsys.readouterr().err
    assert mla_costs.parse(["--capacities", "8", "64"]).capacities == [8, 64]


def test_table_shows_shares():
    text = mla_costs.table([("whole layer", 2.0, 1.0), ("cost of V padding", 0.05, 0.025)])
    assert "| cost of V padding | 0.050 | 2.5% |" in text


def test_help_runs_without_a_gpu():
    proc = subprocess.run([sys.executable, "tools/mla_costs.py", "--help"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "--capacities" in proc.stdout
