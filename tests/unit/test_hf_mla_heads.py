"""Converting DeepSeek-V3 / Moonlight (multi-latent attention): YaRN's constants travel as
Megatron-LM's --yarn-* flags and reach the model's RoPE, and head sizes megatron-core's fused
MLA RoPE kernel does not compile are refused with the field and the flag."""

import pytest
import torch

from megatron.packed_training.hf import ConversionError
from megatron.packed_training.hf.config import HFConfig
from megatron.packed_training.hf.convert import flag_tokens
from megatron.packed_training.hf.families import describe
from tests.unit.hf_tiny import DEEPSEEK_V3, parse_fork_args

# YaRN constants other than megatron-core's MLA defaults (4096, 32, 1).
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
        "original_max_position_embeddings": 64, "beta_fast": 16.0, "beta_slow": 2.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def _config(**change) -> dict:
    return {"model_type": "deepseek_v3", **DEEPSEEK_V3, **change}


def test_yarn_constants_become_megatron_flags():
    flags = describe(HFConfig(_config(rope_parameters=YARN))).flags
    assert flags["--yarn-original-max-position-embeddings"] == 64
    assert flags["--yarn-beta-fast"] == 16.0 and flags["--yarn-beta-slow"] == 2.0


def test_yarn_defaults_are_megatron_cores():
    """A rope_scaling without them: megatron-core's (and DeepSeek's) defaults."""
    scaling = {key: value for key, value in YARN.items()
               if key not in ("original_max_position_embeddings", "beta_fast", "beta_slow")}
    flags = describe(HFConfig(_config(rope_parameters=scaling))).flags
    assert (flags["--yarn-original-max-position-embeddings"], flags["--yarn-beta-fast"],
            flags["--yarn-beta-slow"]) == (4096, 32.0, 1.0)


@pytest.fixture
def mla_parse(monkeypatch):
    """The launch line's parse on CPU: MLA's check for Transformer Engine attention passes."""
    from megatron.packed_training import extra_args

    monkeypatch.setattr(extra_args, "is_importable", lambda name: name == "transformer_engine")
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_the_yarn_constants_reach_the_models_rope_as_hugging_face_computes_it(mla_parse):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from megatron.packed_model.mla import graph_safe_rotary
    from megatron.packed_model.mla_rope import yarn_cos_sin
    from megatron.packed_training.config import transformer_config_from_args

    raw = _config(rope_parameters=YARN)
    args = parse_fork_args(flag_tokens(describe(HFConfig(raw)).flags))
    config = transformer_config_from_args(args)
    assert (config.original_max_position_embeddings, config.beta_fast,
            config.beta_slow) == (64, 16.0, 2.0)
    rows = 256
    cos, sin = yarn_cos_sin(graph_safe_rotary(config, None), rows, torch.float32,
                            torch.device("cpu"))
    hf_config = DeepseekV3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(hf_config)(
        torch.zeros(1, rows, 1), torch.arange(rows)[None])
    torch.testing.assert_close(cos[:, 0, 0], hf_cos[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(sin[:, 0, 0], hf_sin[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("field, size, flag, least", [
    ("qk_rope_head_dim", 12, "--qk-pos-emb-head-dim", 4),
    ("qk_rope_head_dim", 2, "--qk-pos-emb-head-dim", 4),
    ("qk_nope_head_dim", 24, "--qk-head-dim", 1),
    ("v_head_dim", 48, "--v-head-dim", 1),
])
def test_mla_head_sizes_the_fused_rope_cannot_compile_are_refused(field, size, flag, least):
    with pytest.raises(ConversionError) as refused:
        describe(HFConfig(_config(**{field: size})))
    assert str(refused.value) == (
        f"config.json field {field} is {size}: {flag} must be a power of two (at least "
        f"{least}) for megatron-core's fused MLA RoPE kernel (Triton), which packed MLA needs; "
        f"this checkpoint's attention cannot be trained here.")


def test_the_refused_head_sizes_are_the_ones_the_launch_line_refuses(mla_parse):
    """The command line refuses the same sizes, naming the flag."""
    flags = flag_tokens(describe(HFConfig(_config())).flags)
    for flag, bad in (("--qk-pos-emb-head-dim", 12), ("--qk-head-dim", 24),
                      ("--v-head-dim", 48)):
        line = [f"{flag}={bad}" if token.startswith(flag + "=") else token for token in flags]
        with pytest.raises(ValueError, match=f"^{flag} is wrong: {bad}. megatron-core's fused "
                                             f"MLA RoPE kernel"):
            parse_fork_args(line)
