"""MLA flags: accepted values reach megatron-core's MLATransformerConfig; one test per rejection.

CPU only; Transformer Engine and triton count as importable only where a test patches
``argument_checks.is_importable``.
"""

import pytest

from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.packed_training import argument_checks
from megatron.packed_training.arguments import build_parser, validate_args
from megatron.packed_training.config import PackedMLATransformerConfig, transformer_config_from_args

BASE = {
    "gpt": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "256", "--train-iters", "10", "--lr", "1e-3", "--mock-data"],
    "hybrid": ["--hybrid-override-pattern", "M+-+", "--hidden-size", "64",
               "--num-attention-heads", "4", "--mamba-head-dim", "16", "--seq-length", "256",
               "--train-iters", "10", "--lr", "1e-3", "--mock-data"],
}
MLA = ["--multi-latent-attention"]


def validate(*extra, model="gpt", world_size=1):
    args = build_parser(model).parse_args(BASE[model] + [str(x) for x in extra])
    return validate_args(args, model, world_size=world_size)


@pytest.fixture(autouse=True)
def te_and_triton(monkeypatch):
    monkeypatch.setattr(argument_checks, "is_importable",
                        lambda package: package in ("transformer_engine", "triton"))


# ------------------------------------------------------------------------- accepted values

def test_without_mla_the_config_is_the_dense_one():
    args = validate()
    assert args.multi_latent_attention is False
    config = transformer_config_from_args(args)
    assert not isinstance(config, MLATransformerConfig) and not config.multi_latent_attention


def test_qk_layernorm_also_serves_standard_attention():
    # Per-head query and key norms (Qwen3, OLMo 2); MLA reads the same flag as latent norms.
    config = transformer_config_from_args(validate("--qk-layernorm"))
    assert config.qk_layernorm and not config.multi_latent_attention


def test_flags_map_onto_the_mla_config():
    args = validate(*MLA, "--q-lora-rank", 48, "--kv-lora-rank", 32, "--qk-head-dim", 16,
                    "--qk-pos-emb-head-dim", 8, "--v-head-dim", 24, "--qk-layernorm",
                    "--rope-type", "yarn", "--rotary-base", 50000,
                    "--rotary-scaling-factor", 40, "--original-max-position-embeddings", 4096,
                    "--beta-fast", 32, "--beta-slow", 1, "--mscale", 0.707,
                    "--mscale-all-dim", 0.707)
    config = transformer_config_from_args(args)
    assert isinstance(config, PackedMLATransformerConfig)
    assert config.multi_latent_attention and config.rope_type == "yarn"
    assert (config.q_lora_rank, config.kv_lora_rank) == (48, 32)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (16, 8, 24)
    assert config.qk_layernorm and config.rotary_base == 50000
    assert (config.rotary_scaling_factor, config.original_max_position_embeddings) == (40, 4096)
    assert (config.beta_fast, config.beta_slow) == (32, 1)
    assert (config.mscale, config.mscale_all_dim) == (0.707, 0.707)
    assert config.cuda_graph_granularity == "layer"  # the fork's own field survives


def test_megatron_defaults():
    config = transformer_config_from_args(validate(*MLA))
    assert config.q_lora_rank is None and config.kv_lora_rank == 32
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (128, 64, 128)
    assert config.rotary_scaling_factor == 1.0 and not config.qk_layernorm


def test_hybrid_mla_layers():
    args = validate(*MLA, model="hybrid")
    assert args.num_layers == 4 and transformer_config_from_args(args).multi_latent_attention


def test_mla_under_graphs_and_dynamic_cp():
    """0.19.2 refuses MLA under dynamic CP; here the micro-batch's CP group reaches the RoPE."""
    args = validate(*MLA, "--cuda-graph-impl", "transformer_engine",
                    "--cuda-graph-max-packed-seqs", 16, "--dynamic-cp-sizes", 1, 2, 4,
                    world_size=4)
    assert args.dynamic_cp_sizes == [1, 2, 4] and args.multi_latent_attention


def test_mla_with_static_context_parallelism():
    assert validate(*MLA, "--context-parallel-size", 2, world_size=2).multi_latent_attention


MOE = ["--num-experts", 8, "--moe-router-topk", 2, "--moe-token-dispatcher-type", "alltoall",
       "--moe-expert-capacity-factor", 1.25, "--moe-pad-expert-input-to-capacity"]
CHUNK_GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-granularity", "chunk",
                "--cuda-graph-max-packed-seqs", 16]


@pytest.mark.parametrize("model,extra", [
    ("gpt", []), ("gpt", MOE), ("hybrid", []),
    ("gpt", ["--virtual-pipeline-model-parallel-size", 2, "--num-layers", 4])],
    ids=["gpt", "gpt-moe", "hybrid", "gpt-vpp2"])
def test_mla_with_pipeline_parallel_chunk_graphs(model, extra):
    """PP = 2 chunk graphs take MLA (and MLA + MoE): nothing in the checks refuses them."""
    args = validate(*MLA, "--pipeline-model-parallel-size", 2, *CHUNK_GRAPHS, *extra,
                    model=model, world_size=2)
    assert (args.pipeline_model_parallel_size, args.cuda_graph_granularity) == (2, "chunk")
    config = transformer_config_from_args(args)
    assert config.multi_latent_attention and config.pipeline_model_parallel_size == 2
    assert config.num_moe_experts == (8 if extra == MOE else None)


def test_mla_moe_with_pipeline_parallel_layer_graphs():
    args = validate(*MLA, *MOE, "--pipeline-model-parallel-size", 2, "--cuda-graph-impl",
                    "local", "--cuda-graph-max-packed-seqs", 16, world_size=2)
    assert args.cuda_graph_granularity == "layer" and args.multi_latent_attention


@pytest.mark.parametrize("sizes,ranks", [((1,), 2), ((2,), 2), ((4,), 4), ((1, 2, 4), 4)])
def test_mla_moe_under_dynamic_cp_graph_banks(sizes, ranks):
    """MLA + MoE at forced (one size) and mixed CP sizes, with TE layer-graph banks."""
    args = validate(*MLA, *MOE, "--seq-length", 512, "--dynamic-cp-sizes", *sizes,
                    "--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", 8,
                    world_size=ranks)
    assert args.dynamic_cp_sizes == list(sizes) and args.num_experts == 8


# ------------------------------------------------------------------------------- rejections

@pytest.mark.parametrize("flag,value", [
    ("--q-lora-rank", 64), ("--kv-lora-rank", 64), ("--qk-head-dim", 64),
    ("--qk-pos-emb-head-dim", 32), ("--v-head-dim", 64),
    ("--rope-type", "yarn"), ("--rotary-scaling-factor", 40),
    ("--original-max-position-embeddings", 8192), ("--beta-fast", 16), ("--beta-slow", 2),
    ("--mscale", 0.7), ("--mscale-all-dim", 0.7)])
def test_mla_flags_need_mla(flag, value):
    extra = [flag] if value is None else [flag, value]
    with pytest.raises(ValueError, match=f"{flag} is wrong.*add --multi-latent-attention"):
        validate(*extra)


def test_hybrid_plus_layer_needs_mla():
    with pytest.raises(ValueError, match="Its '\\+' layers are multi-latent attention layers"):
        validate(model="hybrid")


def test_hybrid_mla_needs_a_plus_layer():
    with pytest.raises(ValueError, match="has no '\\+' \\(MLA\\) layer"):
        validate(*MLA, "--hybrid-override-pattern", "M*-", model="hybrid")


def test_hybrid_refuses_both_attention_kinds():
    with pytest.raises(ValueError, match="one attention kind per hybrid model"):
        validate(*MLA, "--hybrid-override-pattern", "M*-+", model="hybrid")


def test_mla_needs_transformer_engine(monkeypatch):
    monkeypatch.setattr(argument_checks, "is_importable", lambda package: package == "triton")
    with pytest.raises(ValueError, match="--multi-latent-attention is wrong.*needs "
                                         "transformer_engine"):
        validate(*MLA, "--attention-backend", "torch")


@pytest.mark.parametrize("backend", ["torch", "flash"])
def test_mla_refuses_te_free_backends(backend, monkeypatch):
    monkeypatch.setattr(argument_checks, "is_importable", lambda package: True)
    with pytest.raises(ValueError, match=f"--attention-backend is wrong: {backend}.*only on "
                                         "Transformer Engine attention"):
        validate(*MLA, "--attention-backend", backend)


def test_mla_needs_triton(with_te):
    with pytest.raises(ValueError, match="fused yarn RoPE is a Triton kernel"):
        validate(*MLA)


@pytest.mark.parametrize("flag", ["--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                                  "--qk-pos-emb-head-dim", "--v-head-dim",
                                  "--original-max-position-embeddings"])
def test_sizes_are_positive(flag):
    with pytest.raises(ValueError, match=f"{flag} is wrong: 0. Use a value >= 1"):
        validate(*MLA, flag, 0)


def test_rope_width_is_a_multiple_of_four():
    with pytest.raises(ValueError, match="--qk-pos-emb-head-dim is wrong: 6.*multiple of 4"):
        validate(*MLA, "--qk-pos-emb-head-dim", 6)


def test_unfused_rope_is_refused():
    with pytest.raises(ValueError, match="--rope-type is wrong: rope.*reads no cu_seqlens"):
        validate(*MLA, "--rope-type", "rope")


def test_rotary_percent_is_refused():
    with pytest.raises(ValueError, match="--rotary-percent is wrong: 0.5.*ignores it"):
        validate(*MLA, "--rotary-percent", 0.5)


def test_query_groups_are_refused():
    with pytest.raises(ValueError, match="--num-query-groups is wrong: 2.*no key/value groups"):
        validate(*MLA, "--num-query-groups", 2)


@pytest.mark.parametrize("flag", ["--rotary-scaling-factor", "--beta-fast", "--beta-slow"])
def test_yarn_factors_are_positive(flag):
    with pytest.raises(ValueError, match=f"{flag} is wrong: 0.0. Use a positive value"):
        validate(*MLA, flag, 0)


@pytest.mark.parametrize("flag", ["--mscale", "--mscale-all-dim"])
def test_yarn_mscales_are_not_negative(flag):
    with pytest.raises(ValueError, match=f"{flag} is wrong: -1.0. Use a value >= 0.0"):
        validate(*MLA, flag, -1)


def test_library_config_takes_the_mla_keys():
    from megatron.packed_training.config import load_training_config

    args = load_training_config({
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 256,
        "train_iters": 10, "lr": 1e-3, "mock_data": True, "multi_latent_attention": True,
        "kv_lora_rank": 16, "qk_layernorm": True})
    assert args.multi_latent_attention and args.kv_lora_rank == 16 and args.qk_layernorm
