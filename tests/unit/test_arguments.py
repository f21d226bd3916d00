"""CLI of megatron/packed_training/arguments.py: one test per rejection, derived values, frozen flags.

CPU only; Transformer Engine and flash-attn are assumed absent unless a test patches
``argument_checks.is_importable``.
"""

import json
import warnings
from pathlib import Path

import pytest

from megatron.core.transformer.enums import CudaGraphModule, CudaGraphScope
from megatron.packed_training import argument_checks
from megatron.packed_training.arguments import (
    args_to_dict,
    build_parser,
    format_args,
    parse_args,
    validate_args,
)

BASE = {
    "gpt": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "256", "--train-iters", "10", "--lr", "1e-3", "--mock-data"],
    "hybrid": ["--hybrid-override-pattern", "M*M-", "--hidden-size", "64",
               "--num-attention-heads", "4", "--mamba-head-dim", "16", "--seq-length", "256",
               "--train-iters", "10", "--lr", "1e-3", "--mock-data"],
}


def parse(*extra, model="gpt"):
    """Base argv plus ``extra``, parsed but not validated."""
    return build_parser(model).parse_args(BASE[model] + [str(x) for x in extra])


def validate(*extra, model="gpt", world_size=1):
    return validate_args(parse(*extra, model=model), model, world_size=world_size)


@pytest.fixture(autouse=True)
def no_optional_packages(monkeypatch):
    """Pin "not installed" so the tests do not depend on the machine."""
    monkeypatch.setattr(argument_checks, "is_importable", lambda package: False)


# ---------------------------------------------------------------- valid base and derived values

@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_base_argv_is_valid(model):
    args = validate(model=model)
    assert args.model == model
    assert args.cuda_graph_modules == []
    assert not hasattr(args, "cuda_graph_scope")


def test_model_defaults_are_derived():
    args = validate()
    assert args.ffn_hidden_size == 256
    assert args.num_query_groups == 4
    assert args.kv_channels == 16
    assert args.max_position_embeddings == 256
    assert args.lr_decay_iters == 10
    assert args.position_embedding_type == "rope"
    assert args.calculate_per_token_loss is True


def test_hybrid_defaults_to_no_position_embedding():
    assert validate(model="hybrid").position_embedding_type == "none"


def test_no_calculate_per_token_loss():
    assert validate("--no-calculate-per-token-loss").calculate_per_token_loss is False


def test_data_parallel_size_is_derived():
    args = validate("--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                    world_size=8)
    assert args.data_parallel_size == 2


def test_world_size_defaults_to_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert validate_args(parse(), "gpt").data_parallel_size == 4


def test_num_microbatches_is_derived():
    args = validate("--micro-batch-size", 2, "--global-batch-size", 16, world_size=2)
    assert args.num_microbatches == 4


def test_global_batch_defaults_to_one_microbatch_per_rank():
    args = validate("--micro-batch-size", 2, world_size=4)
    assert (args.global_batch_size, args.num_microbatches) == (8, 1)


def test_padded_vocab_size():
    args = validate("--vocab-size", 50257, "--tensor-model-parallel-size", 2, world_size=2)
    assert args.padded_vocab_size == 50432  # next multiple of 128 * 2


def test_num_layers_inferred_from_pattern():
    assert validate(model="hybrid").num_layers == 4


def test_vpp_from_layers_per_virtual_stage():
    args = validate("--num-layers", 8, "--pipeline-model-parallel-size", 2,
                    "--num-layers-per-virtual-pipeline-stage", 2, world_size=2)
    assert args.virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize("modules", [["attn,mlp"], ["attn", "mlp"], ["attn,", "mlp", "attn"]])
def test_cuda_graph_modules_are_normalised(modules):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = validate("--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", 64,
                        "--cuda-graph-modules", *modules)
    assert args.cuda_graph_modules == ["attn", "mlp"]


def test_mamba_module_on_hybrid():
    args = validate("--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs",
                    "--cuda-graph-modules", "mamba,attn", model="hybrid")
    assert args.cuda_graph_modules == ["mamba", "attn"]


def test_cuda_graph_scope_is_a_deprecated_alias_that_warns_once(recwarn):
    args = validate("--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", 64,
                    "--cuda-graph-scope", "attn", "mlp")
    alias = [w for w in recwarn if issubclass(w.category, FutureWarning)]
    assert len(alias) == 1
    assert str(alias[0].message) == ("--cuda-graph-scope is deprecated; use --cuda-graph-modules "
                                     "(same names) instead.")
    assert args.cuda_graph_modules == ["attn", "mlp"]
    assert not hasattr(args, "cuda_graph_scope")
    validate_args(args, "gpt", world_size=1)  # validating again does not warn again
    assert len([w for w in recwarn if issubclass(w.category, FutureWarning)]) == 1


def test_cuda_graph_modules_and_scope_together_are_refused():
    with pytest.raises(ValueError, match="--cuda-graph-modules / --cuda-graph-scope is wrong: "
                                         "both given. --cuda-graph-scope is the deprecated "
                                         "spelling of --cuda-graph-modules; give only "
                                         "--cuda-graph-modules"):
        validate("--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", 64,
                 "--cuda-graph-modules", "attn", "--cuda-graph-scope", "attn")


def test_alias_errors_name_the_alias():
    with pytest.warns(FutureWarning), pytest.raises(
            ValueError, match="--cuda-graph-scope is wrong: attn. .*add --cuda-graph-impl"):
        validate("--cuda-graph-scope", "attn")


def test_transformer_config_gets_cuda_graph_modules():
    from megatron.packed_training.config import transformer_config_from_args

    config = transformer_config_from_args(
        validate("--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", 64,
                 "--cuda-graph-modules", "mlp,attn"))
    assert config.cuda_graph_modules == [CudaGraphModule.mlp, CudaGraphModule.attn]
    assert config.cuda_graph_scope is None
    assert transformer_config_from_args(validate()).cuda_graph_modules == []


def test_bare_max_packed_seqs_is_50():
    assert parse("--cuda-graph-max-packed-seqs").cuda_graph_max_packed_seqs == 50
    assert parse().cuda_graph_max_packed_seqs == 0


def test_chunk_granularity_rules():
    chunk = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", 64,
             "--cuda-graph-granularity", "chunk"]
    assert validate(*chunk).cuda_graph_granularity == "chunk"
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: attn. Chunk graphs "
                                         "capture.*drop --cuda-graph-modules"):
        validate(*chunk, "--cuda-graph-modules", "attn")
    with pytest.raises(ValueError, match="--cuda-graph-capacity-ladder is wrong: 8. The ladder"):
        validate(*chunk, "--cuda-graph-capacity-ladder", 8)


def test_te_options_accepted_when_te_importable(with_te):
    args = validate("--attention-backend", "te", "--context-parallel-size", 2,
                    "--tensor-model-parallel-size", 2, "--sequence-parallel", world_size=4)
    assert args.data_parallel_size == 1


def test_te_graph_impl_accepted_for_whole_layers_at_pp1(with_te):
    te = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", 64]
    assert validate(*te).cuda_graph_impl == "transformer_engine"
    assert validate(*te, model="hybrid").cuda_graph_modules == []


@pytest.mark.parametrize("extra,message", [
    (["--pipeline-model-parallel-size", 2], "--pipeline-model-parallel-size is wrong: 2. "
     "--cuda-graph-impl transformer_engine captures packed layers for PP = 1 only"),
    (["--cuda-graph-modules", "attn"],
     "--cuda-graph-modules is wrong: attn. .*drop --cuda-graph-modules"),
    (["--cuda-graph-capacity-ladder", 8], "--cuda-graph-capacity-ladder is wrong: 8. "
     "--cuda-graph-impl transformer_engine captures one capacity"),
    (["--attention-dropout", 0.1], "--attention-dropout is wrong: 0.1. .*set it to 0"),
    (["--hidden-dropout", 0.1], "--hidden-dropout is wrong: 0.1. "),
])
def test_te_graph_impl_refuses_what_it_does_not_build(with_te, extra, message):
    with pytest.raises(ValueError, match=message):
        validate("--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", 64,
                 *extra, world_size=2)


# ---------------------------------------------------------------- rejections: model and hybrid

def test_rejects_unknown_model():
    with pytest.raises(ValueError, match="model is wrong: 'bert'"):
        build_parser("bert")


def test_gpt_needs_num_layers():
    args = build_parser("gpt").parse_args(BASE["gpt"][2:])
    with pytest.raises(ValueError, match="--num-layers is wrong: None"):
        validate_args(args, "gpt", world_size=1)


def test_hidden_size_divisible_by_heads():
    with pytest.raises(ValueError, match="--hidden-size is wrong: 66.*--num-attention-heads"):
        validate("--hidden-size", 66)


def test_query_groups_divide_heads():
    with pytest.raises(ValueError, match="--num-query-groups is wrong: 3.*divide"):
        validate("--num-query-groups", 3)


def test_seq_length_within_max_position_embeddings():
    with pytest.raises(ValueError, match="--seq-length is wrong: 256.*--max-position-embeddings"):
        validate("--max-position-embeddings", 128)


@pytest.mark.parametrize("flag", ["--hidden-size", "--micro-batch-size", "--train-iters",
                                  "--vocab-size", "--tensor-model-parallel-size"])
def test_sizes_must_be_positive(flag):
    with pytest.raises(ValueError, match=f"{flag} is wrong: 0. Use a value >= 1"):
        validate(flag, 0)


def test_rotary_percent_range():
    with pytest.raises(ValueError, match="--rotary-percent is wrong: 0.0"):
        validate("--rotary-percent", 0)


def test_gpt_rejects_hybrid_pattern():
    with pytest.raises(ValueError, match="--hybrid-override-pattern.*pretrain_mamba.py"):
        validate("--hybrid-override-pattern", "M*")


def test_hybrid_needs_pattern():
    args = build_parser("hybrid").parse_args(BASE["gpt"])
    with pytest.raises(ValueError, match="--hybrid-override-pattern is wrong: None"):
        validate_args(args, "hybrid", world_size=1)


def test_pattern_rejects_unknown_char():
    with pytest.raises(ValueError, match=r"Character 'X'.*'M\*-E\+'"):
        validate("--hybrid-override-pattern", "M*X-", model="hybrid")


def test_pattern_moe_layer_needs_num_experts():
    with pytest.raises(ValueError, match="Its 'E' layers are MoE layers; add --num-experts"):
        validate("--hybrid-override-pattern", "M*E-", model="hybrid")


def test_pattern_length_must_match_num_layers():
    with pytest.raises(ValueError, match="--num-layers is wrong: 6.*4 layers"):
        validate("--num-layers", 6, model="hybrid")


def test_mamba_head_dim_divides_inner_width():
    with pytest.raises(ValueError, match="--mamba-head-dim is wrong: 48"):
        validate("--mamba-head-dim", 48, model="hybrid")


def test_mamba_groups_divide_heads():
    with pytest.raises(ValueError, match="--mamba-num-groups is wrong: 3.*head count"):
        validate("--mamba-num-groups", 3, model="hybrid")


def test_mamba_groups_divisible_by_tp():
    with pytest.raises(ValueError, match="--mamba-num-groups is wrong: 2.*tensor-model"):
        validate("--mamba-num-groups", 2, "--tensor-model-parallel-size", 4, world_size=4,
                 model="hybrid")


# ---------------------------------------------------------------- rejections: parallelism

def test_world_size_divisible_by_model_parallel():
    with pytest.raises(ValueError, match="world size is wrong: 6.*2 x 2 x 1 = 4"):
        validate("--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                 world_size=6)


def test_heads_divisible_by_tp():
    with pytest.raises(ValueError, match="--num-attention-heads is wrong: 6.*tensor-model"):
        validate("--hidden-size", 96, "--num-attention-heads", 6,
                 "--tensor-model-parallel-size", 4, world_size=4)


def test_query_groups_divisible_by_tp():
    with pytest.raises(ValueError, match="--num-query-groups is wrong: 2.*tensor-model"):
        validate("--num-query-groups", 2, "--tensor-model-parallel-size", 4, world_size=4)


def test_num_layers_divisible_by_pp():
    with pytest.raises(ValueError, match="--num-layers is wrong: 5.*pipeline-model"):
        validate("--num-layers", 5, "--pipeline-model-parallel-size", 2, world_size=2)


def test_pattern_length_divisible_by_pp():
    with pytest.raises(ValueError, match="--hybrid-override-pattern length is wrong: 3"):
        validate("--hybrid-override-pattern", "M*M", "--pipeline-model-parallel-size", 2,
                 world_size=2, model="hybrid")


def test_vpp_needs_pp():
    with pytest.raises(ValueError, match="--virtual-pipeline-model-parallel-size.*> 1"):
        validate("--virtual-pipeline-model-parallel-size", 2)


def test_vpp_layers_divisible():
    with pytest.raises(ValueError, match="--num-layers is wrong: 6.*2 x 2"):
        validate("--num-layers", 6, "--pipeline-model-parallel-size", 2,
                 "--virtual-pipeline-model-parallel-size", 2, world_size=2)


def test_vpp_flags_mutually_exclusive():
    with pytest.raises(ValueError, match="mutually exclusive"):
        validate("--num-layers", 8, "--pipeline-model-parallel-size", 2,
                 "--virtual-pipeline-model-parallel-size", 2,
                 "--num-layers-per-virtual-pipeline-stage", 2, world_size=2)


def test_layers_per_virtual_stage_divides_rank_layers():
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage is wrong: 3"):
        validate("--num-layers", 8, "--pipeline-model-parallel-size", 2,
                 "--num-layers-per-virtual-pipeline-stage", 3, world_size=2)


def test_vpp_needs_two_chunks():
    with pytest.raises(ValueError, match="at least 2"):
        validate("--num-layers", 8, "--pipeline-model-parallel-size", 2,
                 "--num-layers-per-virtual-pipeline-stage", 4, world_size=2)


def test_vpp_rejected_for_hybrid():
    with pytest.raises(ValueError, match=r"interleaved stages only with '\|' stage marks"):
        validate("--pipeline-model-parallel-size", 2, "--virtual-pipeline-model-parallel-size",
                 2, world_size=2, model="hybrid")


def test_sequence_parallel_needs_tp():
    with pytest.raises(ValueError, match="--sequence-parallel.*--tensor-model-parallel-size > 1"):
        validate("--sequence-parallel")


def test_sequence_parallel_needs_te():
    with pytest.raises(ValueError, match=r"--sequence-parallel.*pip install \.\[te\]"):
        validate("--sequence-parallel", "--tensor-model-parallel-size", 2, world_size=2)


def test_sequence_parallel_splits_tokens(with_te):
    with pytest.raises(ValueError, match="--seq-length is wrong: 255"):
        validate("--sequence-parallel", "--tensor-model-parallel-size", 2, "--seq-length", 255,
                 world_size=2)


def test_context_parallel_needs_te():
    with pytest.raises(ValueError, match=r"--context-parallel-size is wrong: 2.*\.\[te\]"):
        validate("--context-parallel-size", 2, world_size=2)


def test_context_parallel_needs_te_backend(with_te):
    with pytest.raises(ValueError, match="--attention-backend torch; use te or auto"):
        validate("--context-parallel-size", 2, "--attention-backend", "torch", world_size=2)


def test_context_parallel_on_hybrid_models_splits_mamba_heads(with_te):
    args = validate("--context-parallel-size", 2, model="hybrid", world_size=2)
    assert args.context_parallel_size == 2
    with pytest.raises(ValueError, match="--context-parallel-size is wrong: 16.*8 heads"):
        validate("--context-parallel-size", 16, "--seq-length", 512, model="hybrid",
                 world_size=16)
    with pytest.raises(ValueError, match="--context-parallel-size is wrong: 3.*2 groups"):
        validate("--context-parallel-size", 3, "--mamba-num-heads", 12, "--mamba-num-groups", 2,
                 "--seq-length", 258, model="hybrid", world_size=3)


def test_context_parallel_seq_length_multiple(with_te):
    with pytest.raises(ValueError, match="--seq-length is wrong: 250.*2 \\* cp = 4"):
        validate("--context-parallel-size", 2, "--seq-length", 250, world_size=2)


# ---------------------------------------------------------------- rejections: training, lr, data

def test_global_batch_divisible():
    with pytest.raises(ValueError, match="--global-batch-size is wrong: 6.*2 x 2 = 4"):
        validate("--micro-batch-size", 2, "--global-batch-size", 6, world_size=2)


def test_fp16_rejected():
    with pytest.raises(ValueError, match="--fp16 is wrong: True.*use --bf16"):
        validate("--fp16")


def test_bf16_and_fp16_mutually_exclusive():
    with pytest.raises(ValueError, match="mutually exclusive"):
        validate("--bf16", "--fp16")


def test_warmup_within_decay():
    with pytest.raises(ValueError, match="--lr-warmup-iters is wrong: 20.*--lr-decay-iters"):
        validate("--lr-warmup-iters", 20)


@pytest.mark.parametrize("extra,message", [
    (["--lr-warmup-fraction", 1.5], "--lr-warmup-fraction is wrong: 1.5. Use a fraction of the "
                                    "decay length in \\[0, 1\\]"),
    (["--lr-warmup-fraction", 0.1, "--lr-warmup-iters", 2],
     "--lr-warmup-fraction is wrong: 0.1. It sets the warm-up length, and so does "
     "--lr-warmup-iters"),
    (["--lr-warmup-init", 0.01], "--lr-warmup-init is wrong: 0.01. Use a rate in \\[0, --lr "
                                 "\\(0.001\\)\\]"),
    (["--lr-warmup-init", -1e-4], "--lr-warmup-init is wrong: -0.0001"),
])
def test_warmup_fraction_and_initial_rate_rules(extra, message):
    with pytest.raises(ValueError, match=message):
        validate(*extra)


def test_warmup_fraction_and_initial_rate_shape_the_schedule():
    """Megatron's --lr-warmup-fraction: warm-up over that fraction of the decay samples, from
    --lr-warmup-init; megatron-core's scheduler on a real torch optimizer."""
    import torch

    from megatron.packed_training.training import build_scheduler

    args = validate("--lr-warmup-fraction", 0.25, "--lr-warmup-init", 1e-4,
                    "--lr-decay-style", "linear", "--global-batch-size", 2)
    assert (args.train_iters, args.lr_decay_iters) == (10, 10)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = build_scheduler(args, optimizer)
    assert scheduler.lr_warmup_steps == 0.25 * 10 * 2 and scheduler.init_lr == 1e-4
    rates = []
    for _ in range(4):
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=2)
    # Samples 0, 2, 4 warm up linearly from 1e-4 towards 1e-3 (reached at sample 5).
    assert rates[:3] == pytest.approx([1e-4, 1e-4 + 0.9e-3 * 2 / 5, 1e-4 + 0.9e-3 * 4 / 5])
    assert rates[3] < 1e-3  # sample 6: decaying


def test_lr_at_least_min_lr():
    with pytest.raises(ValueError, match="--lr is wrong: 0.001.*--min-lr"):
        validate("--min-lr", 0.01)


def test_wsd_needs_decay_iters():
    with pytest.raises(ValueError, match="--lr-wsd-decay-iters is wrong: None"):
        validate("--lr-decay-style", "WSD")


def test_save_interval_needs_save():
    with pytest.raises(ValueError, match="--save-interval is wrong: 100.*--save"):
        validate("--save-interval", 100)


def test_log_interval_positive():
    with pytest.raises(ValueError, match="--log-interval is wrong: 0"):
        validate("--log-interval", 0)


def test_eval_iters_positive_when_evaluating():
    with pytest.raises(ValueError, match="--eval-iters is wrong: 0"):
        validate("--eval-interval", 10, "--eval-iters", 0)


def test_profile_range_must_be_nonempty():
    with pytest.raises(ValueError, match=r"--profile-step-end is wrong: 5. It must exceed --profile-step-start \(5\)"):
        validate("--profile", "--profile-step-start", 5, "--profile-step-end", 5)


def test_nan_check_of_gradients_can_be_switched_off():
    from megatron.packed_training.config import ddp_config_from_args

    assert ddp_config_from_args(validate()).check_for_nan_in_grad
    args = validate("--no-check-for-nan-in-loss-and-grad")
    assert not ddp_config_from_args(args).check_for_nan_in_grad


def test_num_workers_not_negative():
    assert validate().num_workers == 0
    with pytest.raises(ValueError, match="--num-workers is wrong: -1"):
        validate("--num-workers", -1)


def test_profile_trace_dir_needs_profile():
    with pytest.raises(ValueError, match="--profile-trace-dir is wrong: /tmp/t. It needs --profile"):
        validate("--profile-trace-dir", "/tmp/t")
    assert validate("--profile", "--profile-trace-dir", "/tmp/t").profile_trace_dir == "/tmp/t"


def test_exit_interval_positive():
    with pytest.raises(ValueError, match="--exit-interval is wrong: 0"):
        validate("--exit-interval", 0)


def test_data_source_required():
    args = build_parser("gpt").parse_args(BASE["gpt"][:-1])
    with pytest.raises(ValueError, match="--data-path / --mock-data is wrong: neither"):
        validate_args(args, "gpt", world_size=1)


def test_data_sources_exclusive():
    with pytest.raises(ValueError, match="--data-path / --mock-data is wrong: both"):
        validate("--data-path", "docs.jsonl")


def test_long_document_policy_defaults_to_split_and_the_old_flag_means_reject():
    args = validate()
    assert (args.long_document_policy, args.max_truncated_token_fraction) == ("split", None)
    assert validate("--reject-long-documents").long_document_policy == "reject"
    assert validate("--reject-long-documents", "--long-document-policy",
                    "reject").long_document_policy == "reject"
    args = validate("--long-document-policy", "truncate", "--max-truncated-token-fraction", 0.2)
    assert (args.long_document_policy, args.max_truncated_token_fraction) == ("truncate", 0.2)
    assert validate_args(args, "gpt", world_size=1) is args  # validating twice is fine


def test_reject_long_documents_contradicting_the_policy_is_rejected():
    with pytest.raises(ValueError, match="--reject-long-documents is wrong: True. It is the older "
                                         "spelling of --long-document-policy reject and "
                                         "contradicts --long-document-policy split"):
        validate("--reject-long-documents", "--long-document-policy", "split")


def test_unknown_long_document_policy_is_rejected(capsys):
    with pytest.raises(SystemExit):
        parse("--long-document-policy", "drop")
    assert "invalid choice: 'drop'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [-0.1, 1.5, "nan", "inf"])
def test_max_truncated_token_fraction_outside_0_1_is_rejected(bad):
    with pytest.raises(ValueError, match=r"--max-truncated-token-fraction is wrong: .*\. Use a "
                                         r"fraction in \[0, 1\]"):
        validate("--long-document-policy", "truncate", "--max-truncated-token-fraction", bad)


@pytest.mark.parametrize("policy", [[], ["--long-document-policy", "split"],
                                    ["--long-document-policy", "reject"]])
def test_max_truncated_token_fraction_without_truncation_is_rejected(policy):
    with pytest.raises(ValueError, match=r"--max-truncated-token-fraction is wrong: 0\.1\. It "
                                         r"limits what truncation drops, and "
                                         r"--long-document-policy (split|reject) drops nothing"):
        validate(*policy, "--max-truncated-token-fraction", 0.1)


# ---------------------------------------------------------------- rejections: attention, graphs

def test_te_backend_needs_te():
    with pytest.raises(ValueError, match=r"--attention-backend is wrong: te.*pip install \.\[te\]"):
        validate("--attention-backend", "te")


def test_flash_backend_needs_flash_attn():
    with pytest.raises(ValueError, match=r"flash_attn.*pip install \.\[flash\]"):
        validate("--attention-backend", "flash")


def test_negative_capacity():
    with pytest.raises(ValueError, match="--cuda-graph-max-packed-seqs is wrong: -1"):
        validate("--cuda-graph-max-packed-seqs", -1)


def test_graphs_need_capacity():
    with pytest.raises(ValueError, match="--cuda-graph-max-packed-seqs is wrong: 0.*"
                                         "--cuda-graph-max-packed-seqs 64.*capacity_advisor"):
        validate("--cuda-graph-impl", "local")


def test_capacity_without_graphs():
    with pytest.raises(ValueError, match="--cuda-graph-max-packed-seqs is wrong: 50.*"
                                         "add --cuda-graph-impl local"):
        validate("--cuda-graph-max-packed-seqs")


def test_modules_without_graphs():
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: attn.*--cuda-graph-impl"):
        validate("--cuda-graph-modules", "attn")


@pytest.mark.parametrize("impl", ["none", "transformer_engine"])
def test_chunk_granularity_needs_local(impl, with_te):
    extra = [] if impl == "none" else ["--cuda-graph-max-packed-seqs", 64]
    with pytest.raises(ValueError, match="--cuda-graph-granularity is wrong: chunk"):
        validate("--cuda-graph-impl", impl, "--cuda-graph-granularity", "chunk", *extra)


def test_te_graphs_need_te():
    with pytest.raises(ValueError, match=r"--cuda-graph-impl is wrong: transformer_engine.*\[te\]"):
        validate("--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", 64)


def test_warmup_steps_not_negative():
    with pytest.raises(ValueError, match="--cuda-graph-warmup-steps is wrong: -1"):
        validate("--cuda-graph-warmup-steps", -1)


def test_unknown_module_lists_valid_names():
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: 'layer'. Valid "
                                         "CudaGraphModule names are attn, mlp, moe, moe_router, "
                                         "moe_preprocess, mamba \\(this fork supports attn, mlp, "
                                         "moe_router, moe_preprocess, mamba\\)"):
        validate("--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs",
                 "--cuda-graph-modules", "attn,layer")


FULL_ITERATION = "It is a CUDA graph implementation, not a module"


@pytest.mark.parametrize("flag", ["--cuda-graph-modules", "--cuda-graph-scope"])
@pytest.mark.parametrize("name, reason", [
    ("moe", "MoE layers are captured whole when --cuda-graph-modules is not given"),
    ("full_iteration", f"{FULL_ITERATION}: whole training iterations as one graph are "
                       "--cuda-graph-impl full_iteration"),
    ("full_iteration_inference", "It is an inference graph scope"),
])
def test_unsupported_modules(flag, name, reason):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match=f"{flag} is wrong: '{name}'. {reason}"):
            validate("--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs",
                     flag, name, model="hybrid")


def test_scope_only_names_are_the_deprecated_enums_difference():
    """Every CudaGraphScope name that is no CudaGraphModule has a reason of its own."""
    assert set(argument_checks.SCOPE_ONLY_NAMES) == (set(CudaGraphScope.__members__)
                                                     - set(CudaGraphModule.__members__))


def test_mamba_module_rejected_for_gpt():
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: mamba.*no Mamba"):
        validate("--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs",
                 "--cuda-graph-modules", "mamba")


# ---------------------------------------------------------------- CLI behaviour and output

def test_parse_args_exits_2_with_message(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE["gpt"] + ["--fp16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    # One line, not the whole usage.
    assert err.startswith("pretrain_gpt.py: error: --fp16 is wrong: True") and "usage" not in err
    assert err.count("\n") == 1


def _cli_error(capsys, argv, model="gpt"):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, model=model)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    return captured.err.rstrip("\n")


def test_flag_typo_is_one_line_with_the_closest_flag(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = [a if a != "--lr" else "--lrr" for a in BASE["gpt"]] + ["--swigl"]
    assert _cli_error(capsys, BASE["gpt"] + ["--swigl"]) == (
        "pretrain_gpt.py: error: unrecognized argument --swigl; did you mean --swiglu?")
    assert _cli_error(capsys, BASE["gpt"] + ["--mock-doc-length-medain=64"]) == (
        "pretrain_gpt.py: error: unrecognized argument --mock-doc-length-medain; did you mean "
        "--mock-doc-length-median?")
    # A misspelt required flag is reported as the typo, not as "required: --seq-length".
    typo = [a if a != "--seq-length" else "--seq-lenght" for a in BASE["gpt"]]
    assert _cli_error(capsys, typo) == (
        "pretrain_gpt.py: error: unrecognized argument --seq-lenght; did you mean --seq-length?")
    assert _cli_error(capsys, argv) == (
        "pretrain_gpt.py: error: unrecognized arguments --lrr (did you mean --lr?), --swigl (did "
        "you mean --swiglu?); pretrain_gpt.py --help lists the flags")
    assert _cli_error(capsys, BASE["hybrid"] + ["--zzz-qqq"], model="hybrid") == (
        "pretrain_mamba.py: error: unrecognized argument --zzz-qqq; pretrain_mamba.py --help "
        "lists the flags")


def test_other_parse_errors_are_one_line_too(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _cli_error(capsys, BASE["gpt"] + ["--seq-length", "long"]) == (
        "pretrain_gpt.py: error: argument --seq-length: invalid int value: 'long'")
    assert _cli_error(capsys, BASE["gpt"] + ["4096"]) == (
        "pretrain_gpt.py: error: unrecognized arguments: 4096")
    no_lr = [a for a in BASE["gpt"] if a not in ("--lr", "1e-3")]
    assert _cli_error(capsys, no_lr) == (
        "pretrain_gpt.py: error: the following arguments are required: --lr")
    # A negative number is a value, not an unknown flag.
    assert parse_args(BASE["gpt"] + ["--init-method-std", "-0.02"]).init_method_std == -0.02


def test_parse_args_returns_validated_args(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(BASE["hybrid"], model="hybrid")
    assert (args.num_layers, args.data_parallel_size) == (4, 2)


def test_args_to_dict_is_json_safe():
    data = args_to_dict(validate("--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs",
                                 "--cuda-graph-modules", "attn"))
    assert json.loads(json.dumps(data)) == data
    assert data["cuda_graph_modules"] == ["attn"]
    assert data["padded_vocab_size"] == 32000


def test_format_args_is_megatron_style():
    lines = format_args(validate()).splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    body = lines[1:-1]
    assert body == sorted(body, key=str.lower)
    assert "  seq_length ...................................... 256" in body


ALLOWED_OPTIONS = [
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--accumulate-allreduce-grads-in-fp32", "--adam-beta1", "--adam-beta2", "--adam-eps",
    "--apply-layernorm-1p", "--apply-residual-connection-post-layernorm", "--async-save",
    "--attention-backend", "--attention-dropout", "--attention-softmax-in-fp32",
    "--auto-detect-ckpt-format", "--beta-fast", "--beta-slow", "--bf16", "--cache-mla-latents",
    "--calculate-per-token-loss", "--check-weight-hash-across-dp-replicas-interval",
    "--ckpt-assume-constant-structure", "--ckpt-format", "--ckpt-fully-parallel-load",
    "--clip-grad", "--context-parallel-size", "--cp-comm-type", "--cross-entropy-fusion-impl",
    "--cross-entropy-loss-fusion", "--cuda-graph-capacity-ladder", "--cuda-graph-check-action",
    "--cuda-graph-check-interval", "--cuda-graph-check-tolerance", "--cuda-graph-granularity",
    "--cuda-graph-impl", "--cuda-graph-max-packed-seqs", "--cuda-graph-modules",
    "--cuda-graph-scope", "--cuda-graph-warmup-steps", "--data-cache-path",
    "--data-parallel-sharding-strategy", "--data-path", "--dataloader-type",
    "--ddp-average-in-collective", "--ddp-bucket-size", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--deterministic-mode", "--disable-bias-linear",
    "--dist-ckpt-strictness", "--distributed-backend", "--distributed-timeout-minutes",
    "--dynamic-cp-max-packed-seqs", "--dynamic-cp-sizes", "--empty-unused-memory-level",
    "--enable-cuda-graph", "--eod-mask-loss", "--eval-interval", "--eval-iters",
    "--exit-duration-in-mins", "--exit-interval", "--exit-signal", "--exit-signal-handler",
    "--exp-avg-dtype", "--exp-avg-sq-dtype", "--expert-model-parallel-size",
    "--expert-tensor-parallel-size", "--external-cuda-graph", "--ffn-hidden-size", "--finetune",
    "--first-last-layers-bf16", "--fp16", "--fp32-residual-connection", "--fp8-format",
    "--fp8-recipe", "--global-batch-size", "--grad-reduce-in-bf16", "--group-query-attention",
    "--help", "--heterogeneous-layers-config-path", "--hidden-dropout", "--hidden-size",
    "--hybrid-attention-ratio", "--hybrid-mlp-ratio", "--hybrid-override-pattern",
    "--init-method-std", "--init-method-xavier-uniform", "--is-hybrid-model", "--kv-channels",
    "--kv-lora-rank", "--layernorm-epsilon", "--legacy-tokenizer", "--load", "--log-interval",
    "--log-memory-to-tensorboard", "--log-num-zeros-in-grad", "--log-params-norm", "--log-progress",
    "--log-straggler", "--log-throughput", "--log-timers-to-tensorboard",
    "--log-validation-ppl-to-tensorboard", "--long-document-policy", "--lr", "--lr-decay-iters",
    "--lr-decay-samples", "--lr-decay-style", "--lr-warmup-fraction", "--lr-warmup-init",
    "--lr-warmup-iters", "--lr-warmup-samples", "--lr-wsd-decay-iters", "--lr-wsd-decay-style",
    "--main-grads-dtype", "--make-vocab-size-divisible-by", "--mamba-head-dim",
    "--mamba-num-groups", "--mamba-num-heads", "--mamba-state-dim", "--manual-gc",
    "--manual-gc-interval", "--max-position-embeddings", "--max-truncated-token-fraction",
    "--merge-file", "--metrics-file", "--micro-batch-size", "--min-lr", "--mla-pad-v",
    "--mock-data", "--mock-doc-length-median", "--mock-doc-length-sigma", "--moe-aux-loss-coeff",
    "--moe-capacity-overflow", "--moe-enable-deepep", "--moe-expert-capacity-factor",
    "--moe-ffn-hidden-size", "--moe-flex-dispatcher-backend", "--moe-grouped-gemm",
    "--moe-input-jitter-eps", "--moe-layer-freq", "--moe-layer-recompute",
    "--moe-pad-expert-input-to-capacity", "--moe-per-layer-logging", "--moe-permute-fusion",
    "--moe-router-bias-update-rate", "--moe-router-dtype", "--moe-router-enable-expert-bias",
    "--moe-router-fusion", "--moe-router-group-topk", "--moe-router-load-balancing-type",
    "--moe-router-load-file", "--moe-router-num-groups", "--moe-router-pre-softmax",
    "--moe-router-score-function", "--moe-router-topk", "--moe-router-topk-scaling-factor",
    "--moe-shared-expert-intermediate-size", "--moe-shared-expert-overlap",
    "--moe-token-dispatcher-type", "--moe-token-drop-policy", "--moe-use-legacy-grouped-gemm",
    "--moe-z-loss-coeff", "--mscale", "--mscale-all-dim", "--mtp-loss-scaling-factor",
    "--mtp-num-layers", "--multi-latent-attention", "--no-async-tensor-model-parallel-allreduce",
    "--no-bias-dropout-fusion", "--no-calculate-per-token-loss",
    "--no-check-for-nan-in-loss-and-grad", "--no-create-attention-mask-in-dataloader",
    "--no-gradient-accumulation-fusion", "--no-load-optim", "--no-load-rng",
    "--no-masked-softmax-fusion", "--no-mmap-bin-files", "--no-persist-layer-norm",
    "--no-position-embedding", "--no-rope-fusion", "--no-save-optim", "--no-save-rng",
    "--norm-epsilon", "--normalization", "--num-attention-heads",
    "--num-distributed-optimizer-instances", "--num-experts", "--num-layers",
    "--num-layers-per-virtual-pipeline-stage", "--num-query-groups", "--num-workers", "--optimizer",
    "--optimizer-cuda-graph", "--original-max-position-embeddings", "--overlap-grad-reduce",
    "--overlap-param-gather", "--override-opt_param-scheduler", "--padded-vocab-size",
    "--pipeline-model-parallel-size", "--position-embedding-type", "--profile",
    "--profile-step-end", "--profile-step-start", "--profile-trace-dir", "--q-lora-rank",
    "--qk-head-dim", "--qk-layernorm", "--qk-pos-emb-head-dim", "--rampup-batch-size",
    "--recompute-granularity", "--recompute-method", "--recompute-modules",
    "--recompute-num-layers", "--reject-long-documents", "--rerun-mode", "--reset-attention-mask",
    "--reset-position-ids", "--rope-scaling", "--rope-type", "--rotary-base", "--rotary-percent",
    "--rotary-scaling-factor", "--rotary-seq-len-interpolation-factor", "--save", "--save-interval",
    "--seed", "--seq-length", "--sequence-parallel", "--sft", "--sft-tokenizer-prompt-format",
    "--spec", "--split", "--squared-relu", "--swiglu", "--te-rng-tracker",
    "--tensor-model-parallel-size", "--tensorboard-dir", "--tensorboard-log-interval",
    "--tensorboard-queue-size", "--test-data-path", "--timing-log-level", "--timing-log-option",
    "--tokenizer-model", "--tokenizer-type", "--train-data-path", "--train-iters",
    "--train-samples", "--transformer-impl", "--untie-embeddings-and-output-weights",
    "--use-checkpoint-args", "--use-checkpoint-opt_param-scheduler", "--use-distributed-optimizer",
    "--use-flash-attn", "--use-mcore-models", "--use-megatron-fsdp", "--use-persistent-ckpt-worker",
    "--use-precision-aware-optimizer", "--use-rotary-position-embeddings", "--use-torch-fsdp2",
    "--v-head-dim", "--valid-data-path", "--virtual-pipeline-model-parallel-size", "--vocab-file",
    "--vocab-size", "--wandb-exp-name", "--wandb-project", "--wandb-save-dir", "--weight-decay",
    "-h",
]


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_allowed_options_are_frozen(model):
    """Adding or renaming a flag must be a conscious change: update this list and docs/flags.md."""
    parser = build_parser(model)
    options = sorted(s for action in parser._actions for s in action.option_strings)
    assert options == ALLOWED_OPTIONS


def test_every_flag_is_documented():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "flags.md").read_text()
    missing = [o for o in ALLOWED_OPTIONS if o.startswith("--") and o != "--help"
               and f"`{o}`" not in docs and f"`{o} " not in docs]
    assert missing == []


def test_capacity_ladder_rules():
    graphs = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "64"]
    args = validate(*graphs, "--cuda-graph-capacity-ladder", "8", "16")
    assert args.cuda_graph_capacity_ladder == [8, 16]
    assert validate(*graphs).cuda_graph_capacity_ladder == []
    for ladder, message in ((["16", "8"], "strictly ascending"), (["0", "8"], "strictly ascending"),
                            (["8", "64"], "below --cuda-graph-max-packed-seqs")):
        with pytest.raises(ValueError, match="--cuda-graph-capacity-ladder is wrong: .*" + message):
            validate(*graphs, "--cuda-graph-capacity-ladder", *ladder)
    with pytest.raises(ValueError, match="silently ignored without graphs"):
        validate("--cuda-graph-capacity-ladder", "8")


def test_capacity_ladder_is_refused_with_pipeline_parallelism():
    with pytest.raises(ValueError, match="replays graph runners by turn"):
        validate("--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "64",
                 "--cuda-graph-capacity-ladder", "8", "--pipeline-model-parallel-size", "2",
                 "--global-batch-size", "4", world_size=2)


def test_rampup_batch_size_rules():
    args = validate("--global-batch-size", 8, "--rampup-batch-size", 4, 2, 16)
    assert args.rampup_batch_size == [4, 2, 16] and args.num_microbatches == 8
    for bad, message in (((0, 2, 16), "three positive integers"), ((8, 2, 16), "below --global"),
                         ((4, 3, 16), "whole INCREMENT steps")):
        with pytest.raises(ValueError, match="--rampup-batch-size is wrong: .*" + message):
            validate("--global-batch-size", 8, "--rampup-batch-size", *bad)
    with pytest.raises(ValueError, match="multiples of micro batch x data parallel size \\(2\\)"):
        validate("--global-batch-size", 8, "--micro-batch-size", 2, "--rampup-batch-size", 4, 1, 8)


def test_rampup_with_pipeline_layer_graphs_is_refused_and_chunk_graphs_allowed():
    layout = ["--pipeline-model-parallel-size", 2, "--global-batch-size", 8,
              "--rampup-batch-size", 4, 2, 16, "--cuda-graph-impl", "local",
              "--cuda-graph-max-packed-seqs", 16]
    with pytest.raises(ValueError, match="use --cuda-graph-granularity chunk"):
        validate(*layout, world_size=2)
    assert validate(*layout, "--cuda-graph-granularity", "chunk", world_size=2).rampup_batch_size


def test_graphs_on_te_attention_switch_on_the_te_rng_tracker(with_te):
    """TE attention asserts TE's RNG tracker while a graph is captured (any impl)."""
    local = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", 64]
    assert validate(*local).te_rng_tracker  # auto resolves to TE here
    assert not validate(*local, "--attention-backend", "torch").te_rng_tracker
    assert not validate().te_rng_tracker
    assert validate("--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", 64,
                    "--attention-backend", "torch").te_rng_tracker


def test_te_rng_tracker_needs_te():
    with pytest.raises(ValueError, match=r"--te-rng-tracker is wrong: True.*\.\[te\]"):
        validate("--te-rng-tracker")


# ---------------------------------------------------------------- dynamic context parallelism

DYNAMIC_CP = ("--dynamic-cp-sizes", 1, 2, 4, "--global-batch-size", 8)


def test_dynamic_cp_derives_tokens_per_rank_and_bank_capacities(with_te):
    args = validate(*DYNAMIC_CP, world_size=4)
    assert args.dynamic_cp_tokens_per_rank == 64  # --seq-length 256 / largest size 4
    assert args.dynamic_cp_max_packed_seqs == [0, 0, 0]
    args = validate(*DYNAMIC_CP, "--cuda-graph-impl", "transformer_engine",
                    "--cuda-graph-max-packed-seqs", 16, "--dynamic-cp-max-packed-seqs", 16, 8, 4,
                    world_size=4)
    assert args.dynamic_cp_max_packed_seqs == [16, 8, 4]
    args = validate(*DYNAMIC_CP, "--cuda-graph-impl", "transformer_engine",
                    "--cuda-graph-max-packed-seqs", 16, world_size=4)
    assert args.dynamic_cp_max_packed_seqs == [16, 16, 16]
    assert validate("--seq-length", 256, world_size=1).dynamic_cp_tokens_per_rank == 0


@pytest.mark.parametrize("extra, world_size, message", [
    (("--dynamic-cp-sizes", 1, 3), 4, "--dynamic-cp-sizes is wrong: 1 3. Give powers of two"),
    (("--dynamic-cp-sizes", 2, 1), 4, "--dynamic-cp-sizes is wrong: 2 1. Give powers of two"),
    (("--dynamic-cp-sizes", 1, 8), 4, "8 exceeds the 4 ranks"),
    (("--dynamic-cp-sizes", 1, 2), 6, "use a power-of-two rank count"),
    (("--dynamic-cp-sizes", 1, 2, "--context-parallel-size", 2), 4,
     "--context-parallel-size is wrong: 2. Dynamic CP picks"),
    (("--dynamic-cp-sizes", 1, 2, "--micro-batch-size", 2), 4,
     "--micro-batch-size is wrong: 2. Under dynamic CP"),
    (("--dynamic-cp-sizes", 1, 2, "--no-calculate-per-token-loss"), 4, "per-token loss"),
    (("--dynamic-cp-sizes", 1, 2, "--rampup-batch-size", 4, 4, 100), 4,
     "--rampup-batch-size is wrong: 4 4 100"),
    (("--dynamic-cp-sizes", 1, 2, "--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs",
      8), 4, "--cuda-graph-impl is wrong: local. Graph banks"),
    (("--dynamic-cp-sizes", 1, 2, "--attention-backend", "torch"), 4, "use te or auto"),
    (("--dynamic-cp-sizes", 1, 4, "--seq-length", 200), 4, "use a multiple of 32"),
    (("--dynamic-cp-max-packed-seqs", 8), 4, "add --dynamic-cp-sizes or drop it"),
    (("--dynamic-cp-sizes", 1, 2, "--dynamic-cp-max-packed-seqs", 8, 4), 4,
     "silently ignored without graphs"),
    (("--dynamic-cp-sizes", 1, 2, "--cuda-graph-impl", "transformer_engine",
      "--cuda-graph-max-packed-seqs", 8, "--dynamic-cp-max-packed-seqs", 8), 4,
     "one positive capacity per --dynamic-cp-sizes entry"),
])
def test_dynamic_cp_rejections(with_te, extra, world_size, message):
    with pytest.raises(ValueError, match=message):
        validate(*extra, world_size=world_size)


def test_dynamic_cp_needs_te():
    with pytest.raises(ValueError, match=r"--dynamic-cp-sizes is wrong: 1 2.*\.\[te\]"):
        validate("--dynamic-cp-sizes", 1, 2, world_size=2)


def test_dynamic_cp_on_hybrid_models_checks_mamba_heads(with_te):
    assert validate(*DYNAMIC_CP, model="hybrid", world_size=4).dynamic_cp_tokens_per_rank == 64
    with pytest.raises(ValueError, match="--dynamic-cp-sizes is wrong: 16.*8 heads"):
        validate("--dynamic-cp-sizes", 1, 16, "--seq-length", 512, "--global-batch-size", 16,
                 model="hybrid", world_size=16)
