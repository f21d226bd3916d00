"""The fork's command line: megatron/packed_training/arguments.py and extra_args.py.

A full ``parse_args`` runs Megatron-LM's ``validate_args`` (seconds on a small CPU box), so the
rules are tested by calling extra_args' check functions on copies of ONE parsed baseline;
about ten tests parse a whole launch line. Transformer Engine, flash-attn and apex are pinned
absent unless a test says otherwise.
"""

import argparse
import copy
import pathlib
import re
import subprocess
import sys

import pytest

from megatron.core.transformer.enums import AttnBackend, CudaGraphModule
from megatron.packed_training import arguments, extra_args, initialize, models
from megatron.packed_training.arguments import build_parser, parse_args, parse_args_or_exit
from megatron.packed_training.datasets.data_flags import check_data_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 4 "
        "--train-iters 10 --lr 1e-3 --mock-data --attention-backend local").split()
LOCAL = dict(packed_graph_impl="local", cuda_graph_max_packed_seqs=32)
FULL = dict(packed_graph_impl="full_iteration", cuda_graph_max_packed_seqs=32,
            check_for_nan_in_loss_and_grad=False)
TE = dict(packed_graph_impl="transformer_engine", cuda_graph_max_packed_seqs=32)
MOE = dict(num_experts=4, moe_token_dispatcher_type="alltoall")
PADDED = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
# Dynamic CP sizes 1 and 2 on two data-parallel ranks, eager, with what it needs.
DCP = dict(dynamic_cp_sizes=[1, 2], data_parallel_size=2, calculate_per_token_loss=True,
           attention_backend=AttnBackend.auto)
DROP_DCP = ", or drop --dynamic-cp-sizes"


def pin_importable(monkeypatch, *present):
    monkeypatch.setattr(extra_args, "is_importable", lambda package: package in present)


@pytest.fixture(autouse=True)
def no_optional_packages(monkeypatch):
    pin_importable(monkeypatch)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def parsed():
    """The baseline launch line, parsed once: GPT, TE-free attention, graphs off."""
    with pytest.MonkeyPatch.context() as mp:
        pin_importable(mp)
        mp.delenv("WORLD_SIZE", raising=False)
        return parse_args(BASE)


@pytest.fixture
def args(parsed):
    return copy.deepcopy(parsed)


def tweak(args, **values):
    for name, value in values.items():
        setattr(args, name, value)
    return args


CHECKS = {
    "attention": extra_args.check_attention,
    "graphs": lambda a: extra_args.check_graphs(a, "gpt"),
    "hybrid_graphs": lambda a: extra_args.check_graphs(a, "hybrid"),
    "health": extra_args.check_health_check,
    "optimizer": extra_args.check_optimizer_graph,
    "moe": extra_args.check_moe_graphs,
    "long_docs": check_data_args,
    "dynamic_cp": extra_args.check_dynamic_cp,
    "mamba": lambda a: extra_args.check_mamba(a, "hybrid"),
    "gpt_mamba": lambda a: extra_args.check_mamba(a, "gpt"),
    "upstream": lambda a: extra_args.prepare_upstream_args(a, "gpt"),
    "mla": lambda a: extra_args.check_mla(a, "gpt"),
    "hybrid_mla": lambda a: extra_args.check_mla(a, "hybrid"),
}

# (check, attribute values, te importable, flag named, value named, the fix the message gives)
REJECTED = {
    "te_flash_without_te": ("attention", dict(attention_backend=AttnBackend.flash), False,
                            "--attention-backend", "flash", "or use local"),
    "te_fused_without_te": ("attention", dict(attention_backend=AttnBackend.fused), False,
                            "--attention-backend", "fused", "install it (`pip install .[te]`)"),
    "mla_without_te": ("attention", dict(multi_latent_attention=True), False,
                       "--attention-backend", "local", "install TE and use auto, flash or fused"),
    "sequence_parallel_without_te": ("attention", dict(sequence_parallel=True), False,
                                     "--sequence-parallel", "True",
                                     "use Transformer Engine (--attention-backend auto)"),
    "te_unfused_without_te": ("attention", dict(attention_backend=AttnBackend.unfused), False,
                              "--attention-backend", "unfused", "or use local"),
    "negative_capacity": ("graphs", dict(cuda_graph_max_packed_seqs=-1), False,
                          "--cuda-graph-max-packed-seqs", "-1", "Use 0 (graphs off) or a positive"),
    "capacity_without_graphs": ("graphs", dict(cuda_graph_max_packed_seqs=32), False,
                                "--cuda-graph-max-packed-seqs", "32",
                                "add --cuda-graph-impl local"),
    "ladder_without_graphs": ("graphs", dict(cuda_graph_capacity_ladder=[8]), False,
                              "--cuda-graph-capacity-ladder", "8", "add --cuda-graph-impl local"),
    "graphs_without_capacity": ("graphs", dict(packed_graph_impl="local"), False,
                                "--cuda-graph-max-packed-seqs", "0",
                                "e.g. --cuda-graph-max-packed-seqs 64"),
    "ladder_descending": ("graphs", dict(LOCAL, cuda_graph_capacity_ladder=[16, 8]), False,
                          "--cuda-graph-capacity-ladder", "16 8", "ascending order"),
    "ladder_repeats": ("graphs", dict(LOCAL, cuda_graph_capacity_ladder=[8, 8]), False,
                       "--cuda-graph-capacity-ladder", "8 8", "ascending order"),
    "ladder_zero": ("graphs", dict(LOCAL, cuda_graph_capacity_ladder=[0, 8]), False,
                    "--cuda-graph-capacity-ladder", "0 8", "Give positive capacities"),
    "ladder_reaches_capacity": ("graphs", dict(LOCAL, cuda_graph_capacity_ladder=[8, 32]),
                                False, "--cuda-graph-capacity-ladder", "8 32",
                                "all below --cuda-graph-max-packed-seqs (32)"),
    "ladder_te_impl": ("graphs", dict(TE, cuda_graph_capacity_ladder=[8]), True,
                       "--cuda-graph-capacity-ladder", "8", "needs local layer graphs"),
    "ladder_pipeline": ("graphs", dict(LOCAL, cuda_graph_capacity_ladder=[8],
                                       pipeline_model_parallel_size=2), False,
                        "--cuda-graph-capacity-ladder", "8", "PP = 1"),
    "ladder_chunk": ("graphs", dict(LOCAL, cuda_graph_capacity_ladder=[8],
                                    cuda_graph_granularity="chunk"), False,
                     "--cuda-graph-capacity-ladder", "8", "a chunk has one slot"),
    "chunk_te_impl": ("graphs", dict(TE, cuda_graph_granularity="chunk"), True,
                      "--cuda-graph-granularity", "chunk", "add --cuda-graph-impl local"),
    "chunk_with_modules": ("graphs", dict(LOCAL, cuda_graph_granularity="chunk",
                                          cuda_graph_modules=[CudaGraphModule.attn]), False,
                           "--cuda-graph-modules", "attn", "drop --cuda-graph-modules"),
    "gpt_mamba_module": ("graphs", dict(LOCAL, cuda_graph_modules=[CudaGraphModule.mamba]),
                         False, "--cuda-graph-modules", "mamba", "has no Mamba layers"),
    "te_impl_without_te": ("graphs", TE, False, "--cuda-graph-impl", "transformer_engine",
                           "install it or use --cuda-graph-impl local"),
    "te_impl_pipeline": ("graphs", dict(TE, pipeline_model_parallel_size=2), True,
                         "--pipeline-model-parallel-size", "2", "use --cuda-graph-impl local"),
    "hybrid_rope_te_graphs": ("hybrid_graphs", dict(TE, position_embedding_type="rope"), True,
                              "--position-embedding-type", "rope",
                              "use --cuda-graph-impl local, or --position-embedding-type none"),
    "full_no_warmup": ("graphs", dict(FULL, cuda_graph_warmup_steps=0), False,
                       "--cuda-graph-warmup-steps", "0", "use 1 or more"),
    "full_pipeline": ("graphs", dict(FULL, pipeline_model_parallel_size=2), False,
                      "--pipeline-model-parallel-size", "2", "use --cuda-graph-impl local"),
    "full_context_parallel": ("graphs", dict(FULL, context_parallel_size=2), False,
                              "--context-parallel-size", "2",
                              "use --cuda-graph-impl local or transformer_engine"),
    "mamba_head_dim": ("mamba", dict(hidden_size=64, mamba_head_dim=48, mamba_num_heads=None),
                       False, "--mamba-head-dim", "48", "or set --mamba-num-heads"),
    "mamba_groups": ("mamba", dict(hidden_size=64, mamba_head_dim=16, mamba_num_heads=None,
                                   mamba_num_groups=3), False, "--mamba-num-groups", "3",
                     "must divide the Mamba head count (8)"),
    "dcp_capacities_alone": ("dynamic_cp", dict(dynamic_cp_max_packed_seqs=[8, 8]), False,
                             "--dynamic-cp-max-packed-seqs", "8 8",
                             "add --dynamic-cp-sizes or drop it"),
    "dcp_static_cp": ("dynamic_cp", dict(DCP, context_parallel_size=2), True,
                      "--context-parallel-size", "2", "from the data-parallel ranks; use 1"
                      + DROP_DCP),
    "dcp_pipeline": ("dynamic_cp", dict(DCP, pipeline_model_parallel_size=2), True,
                     "--pipeline-model-parallel-size", "2", "which pipeline stages cannot; use 1"
                     + DROP_DCP),
    "dcp_expert_parallel": ("dynamic_cp", dict(DCP, expert_model_parallel_size=2), True,
                            "--expert-model-parallel-size", "2",
                            "within one expert-parallel all-to-all; use 1" + DROP_DCP),
    "dcp_micro_batch": ("dynamic_cp", dict(DCP, micro_batch_size=2), True, "--micro-batch-size",
                        "2", "one packed stream; use 1" + DROP_DCP),
    "dcp_rampup": ("dynamic_cp", dict(DCP, rampup_batch_size=["2", "1", "16"],
                                      step_batch_size_schedule="0:2 1024:3 2048:4"), True,
                   "--rampup-batch-size", "2 1 16", "whole global batches of one size; drop it"),
    "dcp_step_schedule": ("dynamic_cp", dict(DCP, step_batch_size_schedule="0:2 1024:4"), True,
                          "--step-batch-size-schedule", "0:2 1024:4", "drop it" + DROP_DCP),
    "dcp_decreased_batch": ("dynamic_cp", dict(DCP, decrease_batch_size_if_needed=True), True,
                            "--decrease-batch-size-if-needed", "True", "drop it" + DROP_DCP),
    "dcp_mean_loss": ("dynamic_cp", dict(DCP, calculate_per_token_loss=False), True,
                      "--calculate-per-token-loss", "not given",
                      "only the per-token loss weighs them right; add it" + DROP_DCP),
    "dcp_delayed_fp8": ("dynamic_cp", dict(DCP, fp8="e4m3", fp8_recipe="delayed"), True,
                        "--fp8-recipe", "delayed", "all-reduces amaxes over them after every "
                        "micro-batch; use tensorwise or blockwise" + DROP_DCP),
    "dcp_local_graphs": ("dynamic_cp", dict(DCP, **LOCAL), True, "--cuda-graph-impl", "local",
                         "use transformer_engine, or none" + DROP_DCP),
    "dcp_full_iteration": ("dynamic_cp", dict(DCP, **FULL), True, "--cuda-graph-impl",
                           "full_iteration", "banks of TE layer graphs, one per CP size"),
    "dcp_health_check": ("dynamic_cp", dict(DCP, **TE, cuda_graph_check_interval=10), True,
                         "--cuda-graph-check-interval", "10", "need not pick the same one"),
    "dcp_moe_preprocess": ("dynamic_cp", dict(DCP, **TE, cuda_graph_modules=[
        CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess]), True,
        "--cuda-graph-modules", "moe_router moe_preprocess", "drop moe_preprocess" + DROP_DCP),
    "dcp_not_powers_of_two": ("dynamic_cp", dict(DCP, dynamic_cp_sizes=[1, 3]), True,
                              "--dynamic-cp-sizes", "1 3", "Give powers of two in ascending"),
    "dcp_descending": ("dynamic_cp", dict(DCP, dynamic_cp_sizes=[2, 1]), True,
                       "--dynamic-cp-sizes", "2 1", "Give powers of two in ascending"),
    "dcp_above_the_ranks": ("dynamic_cp", dict(DCP, dynamic_cp_sizes=[1, 4]), True,
                            "--dynamic-cp-sizes", "1 4", "4 exceeds the 2 ranks"),
    "dcp_rank_count": ("dynamic_cp", dict(DCP, data_parallel_size=6), True, "--dynamic-cp-sizes",
                       "1 2", "of the 6 data-parallel ranks; use a power-of-two rank count"),
    "dcp_without_te_attention": ("dynamic_cp", dict(DCP, attention_backend=AttnBackend.local),
                                 True, "--attention-backend", "local",
                                 "install TE and use auto, flash, fused or unfused"),
    "dcp_te_missing": ("dynamic_cp", DCP, False, "--attention-backend", "auto",
                       "run Transformer Engine's context-parallel attention"),
    "dcp_mamba_heads": ("dynamic_cp", dict(DCP, model="hybrid", dynamic_cp_sizes=[1, 2, 4],
                                           data_parallel_size=4, hidden_size=48,
                                           mamba_head_dim=16, mamba_num_heads=None,
                                           mamba_num_groups=2), True, "--dynamic-cp-sizes",
                        "1 2 4", "divide the 6 Mamba heads per TP rank"),
    "dcp_mamba_groups": ("dynamic_cp", dict(DCP, model="hybrid", hidden_size=48,
                                            mamba_head_dim=16, mamba_num_heads=None,
                                            mamba_num_groups=3), True, "--dynamic-cp-sizes",
                         "1 2", "the 3 groups per TP rank (--mamba-num-groups / TP); 2 does not"),
    "dcp_seq_length": ("dynamic_cp", dict(DCP, seq_length=100), True, "--seq-length", "100",
                       "every rank holds --seq-length / 2 positions, a multiple of 2 x 2: use a "
                       "multiple of 8"),
    "dcp_capacities_without_graphs": ("dynamic_cp", dict(DCP, dynamic_cp_max_packed_seqs=[8, 4]),
                                      True, "--dynamic-cp-max-packed-seqs", "8 4",
                                      "add --cuda-graph-impl transformer_engine"),
    "dcp_capacity_count": ("dynamic_cp", dict(DCP, **TE, dynamic_cp_max_packed_seqs=[8]), True,
                           "--dynamic-cp-max-packed-seqs", "8",
                           "one positive capacity per --dynamic-cp-sizes entry (2)"),
    "dcp_capacity_zero": ("dynamic_cp", dict(DCP, **TE, dynamic_cp_max_packed_seqs=[8, 0]), True,
                          "--dynamic-cp-max-packed-seqs", "8 0", "one positive capacity"),
    "full_moe": ("graphs", dict(FULL, **MOE), False, "--num-experts", "4",
                 "use --cuda-graph-impl local"),
    "full_health_check": ("graphs", dict(FULL, cuda_graph_check_interval=10), False,
                          "--cuda-graph-check-interval", "10",
                          "drop it or use --cuda-graph-impl local"),
    "full_modules": ("graphs", dict(FULL, cuda_graph_modules=[CudaGraphModule.attn]), False,
                     "--cuda-graph-modules", "attn", "drop --cuda-graph-modules"),
    "full_nan_check": ("graphs", dict(FULL, check_for_nan_in_loss_and_grad=True), False,
                       "--no-check-for-nan-in-loss-and-grad", "not given",
                       "add --no-check-for-nan-in-loss-and-grad"),
    "health_negative": ("health", dict(cuda_graph_check_interval=-1), False,
                        "--cuda-graph-check-interval", "-1", "Use 0 (off) or N > 0"),
    "health_without_graphs": ("health", dict(cuda_graph_check_interval=10), False,
                              "--cuda-graph-check-interval", "10", "add --cuda-graph-impl local"),
    "health_tolerance_zero": ("health", dict(cuda_graph_check_tolerance=0.0), False,
                              "--cuda-graph-check-tolerance", "0.0", "in (0, 1)"),
    "health_tolerance_one": ("health", dict(cuda_graph_check_tolerance=1.0), False,
                             "--cuda-graph-check-tolerance", "1.0", "in (0, 1)"),
    "optimizer_fp16": ("optimizer", dict(packed_optimizer_graph=True, fp16=True), False,
                       "--optimizer-cuda-graph", "True", "use --bf16"),
    "optimizer_zeros": ("optimizer", dict(packed_optimizer_graph=True,
                                          log_num_zeros_in_grad=True), False,
                        "--log-num-zeros-in-grad", "True", "drop it with --optimizer-cuda-graph"),
    "optimizer_moe": ("optimizer", dict(packed_optimizer_graph=True, **MOE), False,
                      "--optimizer-cuda-graph", "True", "--use-distributed-optimizer; add it"),
    "overflow_without_moe": ("moe", dict(moe_capacity_overflow="rerun"), False,
                             "--moe-capacity-overflow", "rerun", "add --num-experts or drop"),
    "load_file_without_moe": ("moe", dict(moe_router_load_file="loads.json"), False,
                              "--moe-router-load-file", "loads.json", "add --num-experts or drop"),
    "rerun_without_factor": ("moe", dict(LOCAL, moe_capacity_overflow="rerun", **MOE), False,
                             "--moe-capacity-overflow", "rerun",
                             "add --moe-expert-capacity-factor"),
    "load_file_without_rerun": ("moe", dict(MOE, moe_router_load_file="loads.json"), False,
                                "--moe-router-load-file", "loads.json",
                                "--moe-capacity-overflow rerun; add it"),
    "dropless_layer_graphs": ("moe", dict(LOCAL, **MOE), False, "--moe-expert-capacity-factor",
                              "None", "--moe-pad-expert-input-to-capacity"),
    "dropless_chunk_graphs": ("moe", dict(LOCAL, cuda_graph_granularity="chunk", **MOE), False,
                              "--moe-expert-capacity-factor", "None", "--moe-dropless-graphs"),
    "unpadded_layer_graphs": ("moe", dict(LOCAL, moe_expert_capacity_factor=1.0, **MOE), False,
                              "--moe-expert-capacity-factor", "1.0",
                              "(--cuda-graph-modules moe_router)"),
    "rerun_without_graphs": ("moe", dict(MOE, moe_capacity_overflow="rerun", **PADDED), False,
                             "--moe-capacity-overflow", "rerun", "or add --cuda-graph-impl"),
    "rerun_with_partial_graphs": ("moe", dict(LOCAL, packed_cuda_graph_modules=["moe_router"],
                                              moe_capacity_overflow="rerun", **MOE, **PADDED),
                                  False, "--moe-capacity-overflow", "rerun", "dropless already"),
    "allgather_under_graphs": ("moe", dict(LOCAL, **dict(MOE, moe_token_dispatcher_type=
                                                         "allgather"), **PADDED), False,
                               "--moe-token-dispatcher-type", "allgather", "use alltoall"),
    "capacity_above_experts": ("moe", dict(MOE, moe_expert_capacity_factor=4.0,
                                           moe_pad_expert_input_to_capacity=True,
                                           moe_router_topk=2), False,
                               "--moe-expert-capacity-factor", "4.0", "use a factor <= 2"),
    "mlp_graphs_of_moe": ("moe", dict(LOCAL, packed_cuda_graph_modules=["mlp"], **MOE,
                                      **PADDED), False, "--cuda-graph-modules", "mlp",
                          "drop mlp"),
    "unpadded_preprocess_graph": ("moe", dict(LOCAL, packed_cuda_graph_modules=[
        "moe_router", "moe_preprocess"], moe_expert_capacity_factor=1.0, **MOE), False,
        "--moe-expert-capacity-factor", "1.0", "add --moe-pad-expert-input-to-capacity"),
    "mamba_conv_width_in_gpt": ("gpt_mamba", dict(mamba_conv_kernel_size=3), False,
                                "--mamba-conv-kernel-size", "3", "A GPT model has no Mamba "
                                "layers; drop the flag"),
    "mla_pad_v_without_mla": ("mla", dict(mla_pad_v="never"), False, "--mla-pad-v", "never",
                              "add --multi-latent-attention"),
    "mla_layers_without_mla": ("hybrid_mla", dict(hybrid_layer_pattern="M+M-"), False,
                               "--hybrid-layer-pattern", "'M+M-'",
                               "add --multi-latent-attention"),
    "mla_unfused_rope_under_graphs": ("mla", dict(LOCAL, multi_latent_attention=True,
                                                  rope_type="rope"), False, "--rope-type",
                                      "rope", "use yarn"),
    "mla_odd_rope_head": ("mla", dict(multi_latent_attention=True, rope_type="yarn",
                                      qk_pos_emb_head_dim=30), False,
                          "--qk-pos-emb-head-dim", "30", "head sizes only; use e.g. 16"),
    # megatron-core's fused MLA RoPE kernels compile power-of-two widths only (Triton).
    "mla_rope_head_48": ("mla", dict(multi_latent_attention=True, rope_type="yarn",
                                     qk_pos_emb_head_dim=48), False,
                         "--qk-pos-emb-head-dim", "48", "use e.g. 32"),
    "mla_rope_head_2": ("mla", dict(multi_latent_attention=True, rope_type="yarn",
                                    qk_pos_emb_head_dim=2), False,
                        "--qk-pos-emb-head-dim", "2", "use e.g. 4"),
    "mla_qk_head_96": ("mla", dict(multi_latent_attention=True, rope_type="yarn",
                                   qk_head_dim=96, qk_pos_emb_head_dim=64, v_head_dim=128), False,
                       "--qk-head-dim", "96", "use e.g. 64"),
    "mla_v_head_192": ("mla", dict(multi_latent_attention=True, rope_type="yarn",
                                   qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=192),
                       False, "--v-head-dim", "192", "use e.g. 128"),
    "mla_nothing_to_pad": ("mla", dict(multi_latent_attention=True, rope_type="yarn",
                                       qk_head_dim=64, qk_pos_emb_head_dim=64, v_head_dim=128,
                                       mla_pad_v="never"), False, "--mla-pad-v", "never",
                           "drop the flag"),
    "truncated_fraction_range": ("long_docs", dict(max_truncated_token_fraction=1.5,
                                                   long_document_policy="truncate"), False,
                                 "--max-truncated-token-fraction", "1.5", "in [0, 1]"),
    "truncated_fraction_no_truncate": ("long_docs", dict(max_truncated_token_fraction=0.1),
                                       False, "--max-truncated-token-fraction", "0.1",
                                       "add --long-document-policy truncate"),
}


@pytest.mark.parametrize("check, values, te, flag, value, fix", REJECTED.values(),
                         ids=REJECTED.keys())
def test_rule_refuses_naming_value_and_fix(args, monkeypatch, check, values, te, flag, value,
                                           fix):
    if te:
        pin_importable(monkeypatch, "transformer_engine")
    with pytest.raises(ValueError, match=re.escape(f"{flag} is wrong: {value}. ")) as err:
        CHECKS[check](tweak(args, **values))
    assert fix in str(err.value) and str(err.value).endswith(".")


ACCEPTED = {
    "local_layer_graphs": ("graphs", LOCAL),
    "local_chunk_graphs": ("graphs", dict(LOCAL, cuda_graph_granularity="chunk")),
    "ladder_below_capacity": ("graphs", dict(LOCAL, cuda_graph_capacity_ladder=[8, 16])),
    "full_iteration": ("graphs", FULL),
    "hybrid_mamba_module": ("hybrid_graphs",
                            dict(LOCAL, cuda_graph_modules=[CudaGraphModule.mamba])),
    "health_check_with_graphs": ("health", dict(LOCAL, cuda_graph_check_interval=10)),
    "optimizer_graph_bf16": ("optimizer", dict(packed_optimizer_graph=True, bf16=True)),
    "optimizer_graph_moe_distopt": ("optimizer", dict(packed_optimizer_graph=True,
                                                      use_distributed_optimizer=True, **MOE)),
    "dropless_moe_without_graphs": ("moe", MOE),
    "padded_moe_layer_graphs": ("moe", dict(LOCAL, moe_expert_capacity_factor=1.0,
                                            moe_pad_expert_input_to_capacity=True, **MOE)),
    "partial_moe_graphs": ("moe", dict(LOCAL, packed_cuda_graph_modules=["moe_router"], **MOE)),
    "moe_rerun_with_load_file": ("moe", dict(LOCAL, moe_capacity_overflow="rerun",
                                             moe_router_load_file="loads.json", **MOE,
                                             **PADDED)),
    "dropless_allgather_eager": ("moe", dict(MOE, moe_token_dispatcher_type="allgather")),
    "mla_under_graphs": ("mla", dict(LOCAL, multi_latent_attention=True, rope_type="yarn",
                                     qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                                     mla_pad_v="never")),
    "truncate_fraction": ("long_docs", dict(max_truncated_token_fraction=0.05,
                                            long_document_policy="truncate")),
    "hybrid_conv_width_3": ("mamba", dict(mamba_conv_kernel_size=3, mamba_head_dim=16)),
    "gpt_default_conv_width": ("gpt_mamba", {}),
}


@pytest.mark.parametrize("check, values", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_rule_accepts(args, check, values):
    CHECKS[check](tweak(args, **values))


def test_baseline_derived_values(parsed):
    assert parsed.model == "gpt"
    assert (parsed.packed_graph_impl, parsed.cuda_graph_impl) == ("none", "none")
    assert parsed.packed_optimizer_graph is False and parsed.optimizer_cuda_graph is False
    assert parsed.packed_cuda_graph_modules == []
    assert parsed.num_microbatches == 4
    assert parsed.te_rng_tracker is False
    assert parsed.spec == ["local"]
    assert (parsed.tokenizer_type, parsed.vocab_size) == ("NullTokenizer", 32000)
    assert parsed.dataloader_type == "external"
    assert parsed.gradient_accumulation_fusion is False
    assert any("gradient accumulation fusion off" in line for line in parsed.packed_notes)


@pytest.mark.parametrize("impl", extra_args.GRAPH_IMPLS)
def test_graph_flags_go_to_the_runtime(impl):
    args = argparse.Namespace(cuda_graph_impl=impl, optimizer_cuda_graph=True)
    for _ in range(2):  # idempotent
        extra_args.hand_graph_flags_to_the_runtime(args)
        assert args.packed_graph_impl == impl and args.packed_optimizer_graph is True
        assert args.cuda_graph_impl == ("none" if impl == "none" else "local")
        assert args.optimizer_cuda_graph is False


def test_graph_modules_become_names(args):
    modules = [CudaGraphModule.attn, CudaGraphModule.moe_router, "mlp"]
    extra_args.check_graphs(tweak(args, cuda_graph_modules=modules, **LOCAL), "gpt")
    assert args.packed_cuda_graph_modules == ["attn", "moe_router", "mlp"]


def test_num_microbatches(args):
    tweak(args, global_batch_size=32, micro_batch_size=2, data_parallel_size=2)
    assert extra_args.validate_packed_args(args, "gpt").num_microbatches == 8


@pytest.mark.parametrize("values, tokens, capacities, groups", [
    (dict(DCP, dynamic_cp_sizes=[1], attention_backend=AttnBackend.local), 128, [0], False),
    (DCP, 64, [0, 0], True),
    (dict(DCP, **TE), 64, [32, 32], True),
    (dict(DCP, **TE, dynamic_cp_max_packed_seqs=[16, 8]), 64, [16, 8], True),
])
def test_dynamic_cp_fills_tokens_per_rank_capacities_and_groups(args, with_te, values, tokens,
                                                                capacities, groups):
    """A size-c micro-batch spans c x --seq-length / max size positions; graph banks default
    to --cuda-graph-max-packed-seqs; hybrid DP x CP groups only for a size above 1."""
    extra_args.check_dynamic_cp(tweak(args, **values))
    assert (args.dynamic_cp_tokens_per_rank, args.dynamic_cp_max_packed_seqs,
            args.dynamic_cp_groups) == (tokens, capacities, groups)


def test_a_dynamic_cp_launch_line_keeps_upstreams_own_hybrid_cp_off(monkeypatch, parsed):
    """Megatron-LM's --hybrid-context-parallel is another scheduler (its own data wrapper and
    schedule): the fork asks only for its groups, at start-up (dynamic_cp_groups, read by
    pretrain.run_pretraining), never through that field."""
    pin_importable(monkeypatch, "transformer_engine")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(BASE[:-2] + [
        "--attention-backend", "auto", "--calculate-per-token-loss", "--dynamic-cp-sizes", "1",
        "2", "--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", "16",
        "--dynamic-cp-max-packed-seqs", "16", "8"])
    assert (args.data_parallel_size, args.num_microbatches) == (2, 2)
    assert (args.dynamic_cp_sizes, args.dynamic_cp_max_packed_seqs,
            args.dynamic_cp_tokens_per_rank) == ([1, 2], [16, 8], 64)
    assert args.dynamic_cp_groups is True and args.hybrid_context_parallel is False
    assert (parsed.dynamic_cp_tokens_per_rank, parsed.dynamic_cp_groups) == (0, False)


@pytest.mark.parametrize("values, backend, present, expected", [
    ({}, "local", (), False),
    (LOCAL, "local", (), False),
    (LOCAL, "auto", (), False),
    (LOCAL, "auto", ("transformer_engine",), True),
    (LOCAL, "flash", ("transformer_engine",), True),
    (TE, "local", ("transformer_engine",), True),
    (FULL, "local", (), True),
])
def test_te_rng_tracker(args, monkeypatch, values, backend, present, expected):
    pin_importable(monkeypatch, *present)
    tweak(args, attention_backend=AttnBackend[backend], te_rng_tracker=False, **values)
    extra_args.check_graphs(args, "gpt")
    assert args.te_rng_tracker is expected


@pytest.mark.parametrize("present,backend,fused,note", [
    (("fused_weight_gradient_mlp_cuda", "transformer_engine"), "auto", True, None),
    (("fused_weight_gradient_mlp_cuda",), "local", True, None),
    # Without apex: TE's linears fuse, megatron-core's own (the output layer) do not.
    (("transformer_engine",), "auto", True, "on in Transformer Engine's linears"),
    (("transformer_engine",), "flash", True, "on in Transformer Engine's linears"),
    # A TE-free model has no linear that fuses without apex.
    (("transformer_engine",), "local", False, "gradient accumulation fusion off"),
    ((), "auto", False, "gradient accumulation fusion off"),
])
def test_gradient_accumulation_fusion_stays_on_where_a_kernel_fuses(
        args, monkeypatch, present, backend, fused, note):
    pin_importable(monkeypatch, *present)
    tweak(args, gradient_accumulation_fusion=True, attention_backend=AttnBackend[backend],
          packed_notes=[])
    extra_args.check_gradient_accumulation_fusion(args)
    assert args.gradient_accumulation_fusion is fused
    notes = [n for n in args.packed_notes if "gradient accumulation fusion" in n]
    assert (notes == []) if note is None else (note in notes[0]), notes


def test_deferred_embedding_wgrad_needs_apex(args):
    tweak(args, gradient_accumulation_fusion=True, defer_embedding_wgrad_compute=True)
    with pytest.raises(ValueError, match="--defer-embedding-wgrad-compute is wrong: on. .*"
                                         "install apex"):
        extra_args.check_gradient_accumulation_fusion(args)


@pytest.mark.parametrize("present", [(), ("apex",), ("transformer_engine",)])
def test_the_start_up_notes_say_when_megatron_core_falls_back_to_torch_kernels(
        args, monkeypatch, present):
    pin_importable(monkeypatch, *present)
    extra_args.validate_packed_args(args, "gpt")
    fallback = [n for n in args.packed_notes if "neither Transformer Engine nor apex" in n]
    assert bool(fallback) is (present == ())


@pytest.mark.parametrize("backend, present, expected", [
    ("flash", (), "te"), ("fused", (), "te"), ("unfused", (), "te"),
    ("local", ("flash_attn",), "flash"), ("local", (), "torch"), ("auto", (), "auto"),
])
def test_packed_attention_backend(args, monkeypatch, backend, present, expected):
    pin_importable(monkeypatch, *present)
    assert models.packed_attention_backend(
        tweak(args, attention_backend=AttnBackend[backend])) == expected


@pytest.mark.parametrize("backend, spec, expected", [
    ("local", None, ["local"]), ("auto", None, None), ("local", ["my.spec"], ["my.spec"]),
])
def test_local_attention_implies_local_spec(args, backend, spec, expected):
    extra_args.prepare_upstream_args(tweak(args, attention_backend=AttnBackend[backend],
                                           spec=spec), "gpt")
    assert args.spec == expected


def test_rampup_becomes_megatron_lms_step_schedule():
    # megatron-core 0.19 ignores --rampup-batch-size; the fork passes it on as the schedule.
    args = parse_args(BASE + ["--rampup-batch-size", "2", "1", "16"])
    # Thresholds in tokens (Megatron-LM gives the calculator --seq-length): 8 and 16 samples.
    assert args.step_batch_size_schedule == "0:2 1024:3 2048:4" and args.global_batch_size == 4


@pytest.mark.parametrize("rampup, gbs", [(["3", "2", "8"], 4), (["8", "2", "8"], 4),
                                         (["2", "0", "8"], 4), (["2", "1", "8"], None)])
def test_bad_rampup_is_refused(args, rampup, gbs):
    with pytest.raises(ValueError, match=r"--rampup-batch-size is wrong: .*\. .*--global-batch-size"):
        extra_args.prepare_upstream_args(tweak(args, rampup_batch_size=rampup,
                                               step_batch_size_schedule=None,
                                               global_batch_size=gbs), "gpt")


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="model is wrong: 'bert'. Use one of gpt, hybrid"):
        parse_args(BASE, model="bert")


def test_megatron_assert_without_message_is_a_value_error():
    with pytest.raises(ValueError, match=r"argument check `assert args.save_interval is not "
                                         r"None` failed \(arguments.py:\d+\)"):
        parse_args(BASE + ["--save", "/tmp/ckpt"])  # Megatron-LM: --save needs --save-interval


def test_megatron_assert_message_is_kept():
    with pytest.raises(ValueError, match="stability issues"):
        parse_args(BASE + ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"])


def test_parse_args_or_exit_prints_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args_or_exit("gpt", "pretrain_gpt.py", BASE + ["--cuda-graph-max-packed-seqs", "32"])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == ["pretrain_gpt.py: error: --cuda-graph-max-packed-seqs is wrong: 32. It "
                      "would be ignored without graphs; add --cuda-graph-impl local."]
    assert "arguments" not in out  # Megatron-LM's argument dump only once every rule passed


def test_a_run_without_a_learning_rate_is_refused_at_parse_time():
    """Megatron-LM's --lr has no default and its schedule fails on None at start-up."""
    argv = list(BASE)
    del argv[argv.index("--lr"):argv.index("--lr") + 2]
    with pytest.raises(ValueError, match=r"^--lr is wrong: not given\. .*add --lr 1e-4\.$"):
        parse_args(argv)


def test_the_argument_dump_follows_a_valid_line(capsys):
    parse_args(BASE)
    assert "end of arguments" in capsys.readouterr().out


def test_an_unknown_enum_name_is_a_bad_value_not_a_traceback():
    with pytest.raises(ValueError, match=r"argument --attention-backend: invalid value 'nope' "
                                         r"\(use one of .*flash.*local"):
        parse_args(BASE + ["--attention-backend", "nope"], raise_on_error=True)
    # Megatron-LM's other converters keep their own name in argparse's message.
    with pytest.raises(ValueError, match="argument --window-size: invalid tuple_type value"):
        parse_args(BASE + ["--window-size", "x,y"], raise_on_error=True)


def test_the_mamba_conv_width_is_one_causal_conv1d_computes(parsed):
    """--mamba-conv-kernel-size (megatron-core's d_conv): 4 unless given; a hybrid line takes
    3; a width causal-conv1d does not compute is argparse's usage error, naming the choices."""
    hybrid = BASE[2:] + ["--hybrid-layer-pattern", "M*", "--mamba-head-dim", "16",
                         "--mamba-num-groups", "2", "--mamba-conv-kernel-size"]
    assert parsed.mamba_conv_kernel_size == 4
    assert parse_args(hybrid + ["3"], "hybrid").mamba_conv_kernel_size == 3
    with pytest.raises(ValueError, match=re.escape(
            "arguments are wrong: argument --mamba-conv-kernel-size: invalid choice: 5 (choose "
            "from 2, 3, 4).")):
        parse_args(hybrid + ["5"], "hybrid", raise_on_error=True)


def test_a_bad_flag_and_help_come_from_rank_zero_only(capsys, monkeypatch):
    for rank, lines in (("0", ["pretrain_gpt.py: error: arguments are wrong: unrecognized "
                               "arguments: --bogus-flag."]), ("3", [])):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            parse_args_or_exit("gpt", "pretrain_gpt.py", BASE + ["--bogus-flag"])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.splitlines() == lines
        with pytest.raises(SystemExit) as exit_:
            parse_args_or_exit("gpt", "pretrain_gpt.py", ["--help"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith("usage: pretrain_gpt.py") == (rank == "0")


# (flags, the fork's graph implementation, Megatron-LM's cuda_graph_impl): the fork keeps
# Megatron-LM's field at "local" for full-iteration graphs, so upstream builds no graphs.
GRAPH_MODES = {"graphs_off": ([], "none", "none"),
               "local_graphs": (["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs",
                                 "32"], "local", "local"),
               "chunk_graphs": (["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs",
                                 "32", "--cuda-graph-granularity", "chunk"], "local", "local"),
               "full_iteration": (["--cuda-graph-impl", "full_iteration",
                                   "--cuda-graph-max-packed-seqs", "32",
                                   "--no-check-for-nan-in-loss-and-grad"], "full_iteration",
                                  "local")}
LAUNCH_LINES = {
    "recompute_overlap_distopt": (
        "--recompute-granularity selective --overlap-grad-reduce --overlap-param-gather "
        "--use-distributed-optimizer",
        dict(recompute_granularity="selective", overlap_grad_reduce=True,
             overlap_param_gather=True, use_distributed_optimizer=True)),
    "rope_scaling_async_save": (
        "--position-embedding-type rope --use-rope-scaling --async-save --save /tmp/ckpt "
        "--save-interval 5",
        dict(use_rope_scaling=True, save="/tmp/ckpt", save_interval=5)),
    "moe_permute_fusion": (
        "--num-experts 4 --moe-permute-fusion --moe-expert-capacity-factor 1.0 "
        "--moe-pad-expert-input-to-capacity --moe-token-dispatcher-type alltoall",
        dict(num_experts=4, moe_permute_fusion=True, moe_expert_capacity_factor=1.0)),
}


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("line", LAUNCH_LINES)
def test_megatron_launch_lines_parse(line, mode):
    flags, expected = LAUNCH_LINES[line]
    graph_flags, impl, megatron_impl = GRAPH_MODES[mode]
    if mode == "full_iteration" and "--num-experts" in flags:
        with pytest.raises(ValueError, match="MoE inside full-iteration graphs"):
            parse_args(BASE + flags.split() + graph_flags)
        return
    args = parse_args(BASE + flags.split() + graph_flags)
    assert {name: getattr(args, name) for name in expected} == expected
    assert args.packed_graph_impl == impl and args.cuda_graph_impl == megatron_impl
    assert args.cuda_graph_max_packed_seqs == (32 if graph_flags else 0)


def test_pretrain_mamba_needs_the_mamba_kernels_before_any_gpu_work(monkeypatch):
    monkeypatch.setattr(extra_args, "is_importable", lambda package: package != "causal_conv1d")
    with pytest.raises(ValueError, match=r"^causal_conv1d is not importable, and the Mamba "
                                         r"layers need .*pip install --no-build-isolation"):
        initialize.require_mamba_kernels()
    monkeypatch.setattr(extra_args, "is_importable", lambda package: True)
    initialize.require_mamba_kernels()


@pytest.mark.skipif(extra_args.is_importable("transformer_engine"),
                    reason="checks a machine without Transformer Engine")
def test_without_te_graphs_keep_megatron_cores_rng_tracker():
    """Megatron-LM turns TE's RNG tracker on for graphs under its default --transformer-impl;
    on a machine without TE the fork keeps megatron-core's graph-safe tracker."""
    parsed = parse_args(BASE + ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs",
                                "32"])
    assert parsed.transformer_impl == "transformer_engine" and parsed.te_rng_tracker is False


def test_use_checkpoint_args_takes_the_model_shape_from_the_checkpoint(tmp_path, monkeypatch):
    """Megatron-LM's --use-checkpoint-args: what the command line leaves unset comes from the
    checkpoint's saved arguments (a torch_dist checkpoint's common state, read on the host)."""
    import json

    import torch

    step = tmp_path / "iter_0000005"
    step.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    (step / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}))
    saved = argparse.Namespace(num_layers=3, hidden_size=96, num_attention_heads=6,
                               seq_length=256, max_position_embeddings=256,
                               ffn_hidden_size=384)
    torch.save({"args": saved, "iteration": 5, "checkpoint_version": 3.0}, step / "common.pt")
    shapeless = BASE[BASE.index("--micro-batch-size"):]  # BASE without the model's shape
    # Arguments are parsed before torch.distributed starts (another test may have started it).
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    args = parse_args(shapeless + ["--use-checkpoint-args", "--load", str(tmp_path)])
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
            args.ffn_hidden_size) == (3, 96, 6, 256, 384)
    with pytest.raises(ValueError, match="--use-checkpoint-args is given without a checkpoint"):
        parse_args(shapeless + ["--use-checkpoint-args"])


@pytest.mark.parametrize("values,message", [
    (dict(moe_router_skew=0.3), "--moe-router-skew is wrong: 0.3. It biases MoE routers"),
    (dict(moe_router_skew=0.9, num_experts=8, moe_router_topk=2), "--moe-router-skew is wrong: 0.9"),
    (dict(moe_router_skew=0.3, num_experts=8, moe_router_topk=2), None),
    (dict(moe_router_skew=0.0), None),
])
def test_router_skew_needs_experts_and_a_reachable_share(args, values, message):
    tweak(args, **values)
    if message is None:
        extra_args.check_moe_router_skew(args)
        return
    with pytest.raises(ValueError, match=message):
        extra_args.check_moe_router_skew(args)


def test_the_forks_argument_code_stays_small():
    """The fork's own argument and validation code (its flags and rules on Megatron-LM's
    parser and checks) is under 940 lines: new rules replace old ones or go upstream. (700
    before the data flags moved into datasets/data_flags.py and gained Megatron-LM's data
    forms: the packer's flags and the blend, split and balance rules; 775 before the rules of
    Megatron-LM's FP8 flags on packed rows, fp8_flags.py; 890 before FP8's MoE and padding-row
    rules and the TE-free path's sequence-parallel refusal; 925 before delayed scaling's rules
    under graphs and dynamic CP.)"""
    repo = pathlib.Path(__file__).resolve().parents[2]
    files = ["megatron/packed_training/arguments.py", "megatron/packed_training/extra_args.py",
             "megatron/packed_model/refusals.py",
             "megatron/packed_training/datasets/data_flags.py",  # the data flags and rules
             "megatron/packed_training/fp8_flags.py"]
    assert sum(len((repo / f).read_text().splitlines()) for f in files) < 940


def test_the_stored_flag_names_are_the_parsers():
    """The scripts stop on an unknown flag before importing the parser, from this list."""
    names = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    stored = set(arguments.MEGATRON_FLAGS.read_text().split())
    assert stored == names, (
        "regenerate megatron/packed_training/megatron_flags.txt: one long option of "
        "arguments.build_parser() per line, sorted; missing: "
        f"{sorted(names - stored)}, extra: {sorted(stored - names)}")


def test_the_stored_help_is_the_parsers(capsys, monkeypatch):
    """The scripts print --help from this file, written by the real parser for prog PROG at
    100 columns (megatron/packed_training/megatron_help.txt)."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "argv", ["PROG"])
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == arguments.MEGATRON_HELP.read_text(), (
        "regenerate megatron/packed_training/megatron_help.txt: COLUMNS=100 python -c "
        "\"import sys; sys.argv = ['PROG']; from megatron.packed_training.arguments import "
        "parse_args; parse_args(['--help'])\" > megatron/packed_training/megatron_help.txt")


@pytest.mark.parametrize("argv, code, out, err", [
    (["--num-layers", "2", "--bogus=1"], 2, "",
     "pretrain_gpt.py: error: arguments are wrong: unrecognized arguments: --bogus=1.\n"),
    (["--num-layers", "2", "--help"], 0, "usage: pretrain_gpt.py [-h] [--tensor-model", ""),
    (["--sft", "--data-path", "missing.jsonl", "--lr", "-1"], 2, "",
     "pretrain_gpt.py: error: --data-path is wrong: 'missing.jsonl' does not exist. Pass a "
     ".jsonl file, a folder of .jsonl files, or a Megatron-LM indexed-dataset prefix (PREFIX "
     "for PREFIX.bin + PREFIX.idx).\n"),
    (["--valid-data-path=missing.jsonl"], 2, "",
     "pretrain_gpt.py: error: --valid-data-path is wrong: 'missing.jsonl' does not exist. "
     "Pass a .jsonl file, a folder of .jsonl files, or a Megatron-LM indexed-dataset prefix "
     "(PREFIX for PREFIX.bin + PREFIX.idx).\n"),
])
def test_help_typos_and_missing_data_answer_before_megatron_is_imported(tmp_path, argv, code,
                                                                         out, err):
    probe = ("import sys\n"
             "from megatron.packed_training.arguments import parse_args_or_exit\n"
             "try:\n"
             f"    parse_args_or_exit('gpt', 'pretrain_gpt.py', {argv!r})\n"
             "except SystemExit as exit:\n"
             "    print(exit.code, 'megatron.core' in sys.modules, 'torch' in sys.modules,\n"
             "          file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.stderr == err + f"{code} False False\n", done.stdout + done.stderr
    assert done.stdout.startswith(out) and (out or not done.stdout)
