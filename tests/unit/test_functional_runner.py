"""tests/functional on CPU: every planned run of every case passes the real command line
(Megatron-LM's parser and validate_args plus the fork's flags and rules), and the runner's logic
(variables, plans, training records -> golden, comparison, record round-trip) without training.

The first parse in a process costs ~10 s (Megatron-LM's imports), every later one well under a
second: the parses stay in this process.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import yaml

from megatron.packed_training import extra_args
from megatron.packed_training.arguments import parse_args
from tests.functional import golden as gv
from tests.functional import run as runner
from tests.functional.case import (
    CASES_ROOT,
    GOLDEN_NAME,
    REPO,
    case_variables,
    expand,
    list_cases,
    load_case,
    plan_runs,
    resolve_case,
    to_argv,
)

CASES = list_cases()
NOT_BUILT: dict = {}  # case -> the validation error it expects while its feature is missing
TE_BACKENDS = ("flash", "fused", "unfused")  # Megatron-LM's Transformer Engine attention


@pytest.fixture(autouse=True)
def no_optional_packages(monkeypatch):
    """Pin "not installed" so validation does not depend on the machine."""
    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)


def parse(case, argv):
    """The real command line of ``case``'s script: ``parse_args(argv, model)`` as rank 0 of
    NPROC processes in the runner's environment (the case's ENV_VARS)."""
    env = {"WORLD_SIZE": str(case.nproc), "RANK": "0",
           **{k: str(v) for k, v in case.env_vars.items()}}
    with mock.patch.dict(os.environ, env):  # the launcher's environment, put back after
        return parse_args(argv, case.model)


def pins_te(case) -> bool:
    return case.model_args.get("--attention-backend") in TE_BACKENDS


def fake_te_for(case, monkeypatch):
    """Transformer Engine (and triton, which ships with the CUDA builds TE runs on) counted
    as importable for a case that pins TE attention (the MLA cases: packed MLA runs only on
    TE); every other case validates without them."""
    from megatron.packed_model import attention

    if pins_te(case):
        monkeypatch.setattr(extra_args, "is_importable",
                            lambda package: package in ("transformer_engine", "triton"))
        monkeypatch.setattr(attention, "is_te_available", lambda: True)


def record(step, loss, zeros=0, ms=100.0):
    """A training record as the runner gets it: the metrics file's keys, with ``num_zeros``
    from Megatron-LM's log line (tests/gpu/launch.run_training)."""
    return {"iteration": step, "consumed_samples": 4 * step, "lm_loss": loss,
            "iteration_time_ms": ms, "tokens_per_sec": 1000.0, "graph fallbacks": 0,
            "num_zeros": zeros}


def golden_of(losses, start=1, **kw):
    return gv.metrics_to_golden([record(start + i, v, **kw) for i, v in enumerate(losses)])


# ----------------------------------------------------------------------------------- the cases

MOE_CASES = ["gpt_moe/gpt_moe_eager", "gpt_moe/gpt_moe_layer_graphs",
             "hybrid_moe/hybrid_moe_chunk_graphs", "hybrid_moe/hybrid_moe_eager"]
MLA_CASES = ["mla/moonlight_tiny_eager", "mla/moonlight_tiny_layer_graphs"]
GRAPH_FLAGS = {"--cuda-graph-impl", "--cuda-graph-max-packed-seqs", "--cuda-graph-warmup-steps"}


def test_the_required_cases_exist():
    assert set(CASES) >= {"gpt/gpt_eager", "gpt/gpt_layer_graphs", "gpt/gpt_ckpt_resume",
                          "hybrid/hybrid_eager", "hybrid/hybrid_layer_graphs",
                          "hybrid/hybrid_chunk_graphs_pp2", *MOE_CASES, *MLA_CASES}


@pytest.mark.parametrize("name", CASES)
def test_case_loads_and_its_script_exists(name):
    case = load_case(CASES_ROOT / name)
    assert case.name == name
    assert (REPO / case.script).is_file()
    assert case.train_iters == 50
    assert set(case.metrics) <= set(gv.METRICS)


@pytest.mark.parametrize("name", CASES)
def test_case_args_pass_the_real_cli(name, tmp_path, monkeypatch):
    case = load_case(CASES_ROOT / name)
    fake_te_for(case, monkeypatch)
    for plan in plan_runs(case, case_variables(tmp_path)):
        argv = plan.argv + ["--metrics-file", str(tmp_path / f"{plan.name}.jsonl")]
        if name in NOT_BUILT:
            with pytest.raises(ValueError, match=NOT_BUILT[name]):
                parse(case, argv)
            continue
        args = parse(case, argv)
        assert args.train_iters == 50 and args.log_interval == 1
        assert args.mock_data and args.eval_iters == 0  # no evaluation, as on the old loop
        # The old fork's defaults, which Megatron-LM's differ from.
        assert args.normalization == "RMSNorm" and not args.add_bias_linear
        assert args.hidden_dropout == 0 and args.attention_dropout == 0
        assert args.adam_beta2 == 0.95 and args.lr_decay_style == "cosine"
        assert args.calculate_per_token_loss and args.max_position_embeddings == 1024
        if case.model == "gpt":
            assert args.position_embedding_type == "rope"
            assert args.ffn_hidden_size == 4 * args.hidden_size  # not SwiGLU's 2/3
        else:
            assert args.position_embedding_type == "none"
            assert args.num_layers == len(args.hybrid_layer_pattern)
        if "--num-query-groups" in argv:  # read only with --group-query-attention
            assert args.group_query_attention and args.num_query_groups == 4
        assert args.attention_backend.name == ("fused" if pins_te(case) else "local")


@pytest.mark.parametrize("graphs,eager,graph_flags", [
    ("gpt/gpt_layer_graphs", "gpt/gpt_eager", GRAPH_FLAGS),
    ("hybrid/hybrid_layer_graphs", "hybrid/hybrid_eager", GRAPH_FLAGS),
    ("gpt_moe/gpt_moe_layer_graphs", "gpt_moe/gpt_moe_eager", GRAPH_FLAGS),
    ("mla/moonlight_tiny_layer_graphs", "mla/moonlight_tiny_eager", GRAPH_FLAGS),
    ("hybrid_moe/hybrid_moe_chunk_graphs", "hybrid_moe/hybrid_moe_eager",
     GRAPH_FLAGS | {"--cuda-graph-granularity"})])
def test_graph_case_shares_its_eager_twins_golden_file(graphs, eager, graph_flags):
    graph_case, eager_case = load_case(CASES_ROOT / graphs), load_case(CASES_ROOT / eager)
    assert graph_case.shares_golden and not eager_case.shares_golden
    assert graph_case.golden == eager_case.golden == CASES_ROOT / eager / GOLDEN_NAME
    # Same training apart from the graph flags, so eager's golden values are graphs' reference.
    extra = {k: v for k, v in graph_case.model_args.items() if k not in eager_case.model_args}
    assert set(extra) == graph_flags
    assert {k: v for k, v in eager_case.model_args.items()
            if graph_case.model_args.get(k) != v} == {}
    assert graph_case.metrics == eager_case.metrics
    assert graph_case.model_args["--global-batch-size"] == 4  # accumulation under graphs
    assert graph_case.tolerances["lm loss"] == gv.Tolerance(atol=5e-3)
    # An eager case's tolerance is its measured run-to-run spread: 2e-3, 5e-3 for the MoE
    # cases (flipped expert choices); never wider than its graph twin's.
    expected = 5e-3 if eager in ("gpt_moe/gpt_moe_eager", "hybrid_moe/hybrid_moe_eager") else 2e-3
    assert eager_case.tolerances["lm loss"] == gv.Tolerance(atol=expected)


@pytest.mark.parametrize("graphs,eager", [
    ("gpt/gpt_layer_graphs", "gpt/gpt_eager"),
    ("hybrid/hybrid_layer_graphs", "hybrid/hybrid_eager"),
    ("hybrid/hybrid_chunk_graphs_pp2", "hybrid/hybrid_eager_pp2"),
    ("gpt_moe/gpt_moe_layer_graphs", "gpt_moe/gpt_moe_eager"),
    ("mla/moonlight_tiny_layer_graphs", "mla/moonlight_tiny_eager"),
    ("hybrid_moe/hybrid_moe_chunk_graphs", "hybrid_moe/hybrid_moe_eager")])
def test_graph_twin_parses_to_its_eager_twins_run(graphs, eager, tmp_path, monkeypatch):
    """Parsed, the twins differ in the graph settings only: the ones the case sets and what
    parse_args derives from them. Megatron-LM turns TE's RNG tracker on for graph runs (its
    default --transformer-impl transformer_engine); the MLA twins set it in both."""
    graph_case, eager_case = load_case(CASES_ROOT / graphs), load_case(CASES_ROOT / eager)
    fake_te_for(eager_case, monkeypatch)
    (graph_plan,) = plan_runs(graph_case, case_variables(tmp_path))
    (eager_plan,) = plan_runs(eager_case, case_variables(tmp_path))
    graph_args, eager_args = parse(graph_case, graph_plan.argv), parse(eager_case, eager_plan.argv)
    graph_derived = {"cuda_graph_impl", "packed_graph_impl", "cuda_graph_max_packed_seqs",
                     "cuda_graph_warmup_steps", "cuda_graph_granularity",
                     "cuda_graph_capacity_ladder", "inference_cuda_graph_scope",
                     "te_rng_tracker"}
    differ = {k for k, v in vars(graph_args).items() if vars(eager_args).get(k) != v}
    assert differ <= graph_derived, differ - graph_derived
    assert eager_args.packed_graph_impl == "none" and graph_args.packed_graph_impl == "local"
    # Graphs use TE's RNG tracker where TE is installed (Megatron-LM's rule), else
    # megatron-core's graph-safe one, as eager does.
    assert graph_args.te_rng_tracker == extra_args.is_importable("transformer_engine")
    assert eager_args.te_rng_tracker == pins_te(eager_case)


@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_cases_are_small_drop_and_pad_and_compare_the_moe_metrics(name, tmp_path):
    case = load_case(CASES_ROOT / name)
    (plan,) = plan_runs(case, case_variables(tmp_path))
    args = parse(case, plan.argv)
    assert (args.hidden_size, args.num_experts, args.moe_router_topk) == (256, 8, 2)
    # Drop-and-pad with the alltoall dispatcher, SequentialMLP experts, TE-free attention.
    assert args.moe_token_dispatcher_type == "alltoall"
    assert args.moe_expert_capacity_factor > 0 and args.moe_pad_expert_input_to_capacity
    assert not args.moe_grouped_gemm and args.attention_backend.name == "local"
    assert args.moe_aux_loss_coeff > 0 and args.moe_z_loss_coeff > 0
    # The aux loss comes from Megatron-LM's log line; the dropped-slot fraction is reported
    # nowhere on Megatron-LM's loop, so it is not compared.
    assert {"lm loss", "load_balancing_loss"} <= set(case.metrics)
    assert "moe_dropped_token_fraction" not in case.metrics
    if case.model == "hybrid":
        assert set(args.hybrid_layer_pattern) == {"M", "*", "E"}
    if "graphs" in name:
        granularity = "chunk" if "chunk" in name else "layer"
        assert (args.packed_graph_impl, args.cuda_graph_granularity) == ("local", granularity)


@pytest.mark.parametrize("name", MLA_CASES)
def test_mla_cases_are_small_moonlight_shaped_on_te_attention(name, tmp_path, monkeypatch):
    """MLA without query compression, V narrower than the query head (so packed data pads
    it), every MLP an MoE layer with a shared expert and sigmoid router, drop-and-pad; TE
    attention and TE's RNG tracker pinned in both twins; megatron-core's MLA config builds."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron.packed_training.config import transformer_config_from_args

    case = load_case(CASES_ROOT / name)
    (plan,) = plan_runs(case, case_variables(tmp_path))
    fake_te_for(case, monkeypatch)
    args = parse(case, plan.argv)
    assert (args.num_layers, args.hidden_size, args.num_experts) == (4, 256, 8)
    assert args.multi_latent_attention and args.q_lora_rank is None
    assert args.qk_head_dim + args.qk_pos_emb_head_dim > args.v_head_dim
    assert args.mla_pad_v == "always"
    # TE's cuDNN fused attention, pinned (the fork's old `te`); TE's RNG tracker in both twins.
    assert (args.attention_backend.name, args.te_rng_tracker) == ("fused", True)
    assert args.moe_router_score_function == "sigmoid"
    assert args.moe_shared_expert_intermediate_size
    assert args.moe_token_dispatcher_type == "alltoall"
    assert args.moe_expert_capacity_factor > 0 and args.moe_pad_expert_input_to_capacity
    assert {"lm loss", "load_balancing_loss"} <= set(case.metrics)
    config = transformer_config_from_args(args)
    # megatron-core's MLA config (Megatron-LM builds an MLATransformerConfig for MLA whatever
    # class it is given) with what the fork's layers read set on it.
    assert isinstance(config, MLATransformerConfig) and config.multi_latent_attention
    assert config.mla_pad_v and config.cuda_graph_granularity == "layer"
    assert config.num_moe_experts == 8 and config.apply_rope_fusion
    assert config.rope_type == "yarn" and config.rotary_scaling_factor == 1.0
    if "graphs" in name:
        assert (args.packed_graph_impl, args.cuda_graph_granularity) == ("local", "layer")


@pytest.mark.parametrize("name", MLA_CASES)
def test_mla_cases_are_refused_without_transformer_engine(name, tmp_path):
    case = load_case(CASES_ROOT / name)
    (plan,) = plan_runs(case, case_variables(tmp_path))
    with pytest.raises(ValueError, match="Transformer Engine backend and TE is not importable"):
        parse(case, plan.argv)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_moe/gpt_moe_eager", "hybrid_moe/hybrid_moe_eager"])
def test_moe_case_models_build_and_train_on_cpu(name, tmp_path, cpu_dist, monkeypatch):
    """The case's flags through the training config and the script's model provider at the
    case's size, then forward and backward on one packed row of 1024 positions. Without
    Mamba layers (MambaMixer needs mamba-ssm) and RoPE (megatron-core builds its table on the
    CUDA device); megatron-core's alltoall dispatcher gets a placeholder for the CUDA stream
    it creates for dropless dispatch (tests/unit/test_moe.py)."""
    import importlib

    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron.packed_graphs.packed_seq import build_packed_batch_params
    from megatron.packed_training.config import transformer_config_from_args

    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())
    get_moe_metrics_tracker().metrics.clear()
    case = load_case(CASES_ROOT / name)
    (plan,) = plan_runs(case, case_variables(tmp_path))
    # No RoPE (its table is built on the CUDA device); no fused bias-dropout / SwiGLU
    # kernels, which megatron-core torch.compiles (half a minute of CPU compilation here).
    argv = plan.argv + ["--position-embedding-type", "none", "--no-bias-dropout-fusion",
                        "--no-bias-swiglu-fusion"]
    if "--hybrid-layer-pattern" in argv:
        at = argv.index("--hybrid-layer-pattern") + 1
        argv[at] = argv[at].replace("M", "")
    args = parse(case, argv)
    # Megatron-LM's start-up (its tokenizer set-up) pads the vocabulary, not parse_args.
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    config = transformer_config_from_args(args)
    config.use_cpu_initialization = True
    torch.manual_seed(0)
    model = importlib.import_module(case.script[:-3]).model_provider(args, config)
    routers = [layer.mlp.router for layer in model.decoder.layers
               if isinstance(getattr(layer, "mlp", None), MoELayer)]
    assert len(routers) == (4 if case.model == "gpt" else 3)
    cu = torch.tensor([0, 300, 700, 900, 1024], dtype=torch.int32)  # 3 documents, padding
    positions = torch.cat([torch.arange(n) for n in (300, 400, 200, 124)])
    params = build_packed_batch_params(cu, positions, 1024, with_seq_idx=False)
    params.padding_mask = torch.arange(1024) >= 900
    tokens = torch.randint(1, 1024, (1, 1024))
    losses = model(tokens, positions.view(1, -1), None, labels=tokens, packed_seq_params=params)
    assert torch.isfinite(losses).all()
    losses.float().sum().backward()
    assert all(router.weight.grad.abs().sum() > 0 for router in routers)
    # The aux and z losses the case compares were recorded for the MoE layers.
    assert {"load_balancing_loss", "z_loss"} <= set(get_moe_metrics_tracker().metrics)
    get_moe_metrics_tracker().metrics.clear()


def test_resolve_case_accepts_name_folder_and_yaml():
    folder = CASES_ROOT / "gpt" / "gpt_eager"
    assert resolve_case("gpt/gpt_eager") == folder
    assert resolve_case(str(folder)) == folder
    assert resolve_case(str(folder / "model_config.yaml")) == folder
    with pytest.raises(ValueError, match="CASE is wrong: 'gpt/nope'"):
        resolve_case("gpt/nope")


def write_case(root, name, config):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model_config.yaml").write_text(yaml.safe_dump(config))
    return folder


BASE_CONFIG = {"SCRIPT": "pretrain_gpt.py", "TEST_TYPE": "regular",
               "MODEL_ARGS": {"--train-iters": 10, "--mock-data": True}}


@pytest.mark.parametrize("change,match", [
    ({"SCRIPT": "train.py"}, "SCRIPT is wrong: 'train.py'"),
    ({"TEST_TYPE": "resume"}, "TEST_TYPE is wrong: 'resume'"),
    ({"MODEL_ARGS": {"--mock-data": True}}, "no --train-iters"),
    ({"NPROCS": 2}, r"unknown keys \['NPROCS'\]"),
    ({"METRICS": ["loss"]}, r"METRICS is wrong: \['loss'\]"),
    ({"TOLERANCE": {"lm loss": {"atoll": 1}}}, r"TOLERANCE\['lm loss'\] is wrong"),
    ({"TOLERANCE": {"lm loss": {"atol": "big"}}}, r"atol is wrong: 'big'"),
    ({"TOLERANCE": {"loss": {"atol": 1}}}, "unknown metric"),
    ({"GOLDEN": "nowhere/golden.json"}, "GOLDEN is wrong"),
    ({"MODEL_ARGS_2": {"--train-iters": 10}}, "Only ckpt-resume cases have a second run"),
    ({"TEST_TYPE": "ckpt-resume", "MODEL_ARGS": {"--train-iters": 10, "--load": "x"}},
     "sets --exit-interval and --load itself"),
])
def test_bad_case_file_is_rejected(tmp_path, change, match):
    folder = write_case(tmp_path, "gpt/bad", BASE_CONFIG | change)
    with pytest.raises(ValueError, match=match):
        load_case(folder, tmp_path)


def test_tolerance_from_yaml_string_number(tmp_path):
    # PyYAML reads 2e-3 (no dot) as the string "2e-3".
    folder = tmp_path / "gpt" / "c"
    folder.mkdir(parents=True)
    (folder / "model_config.yaml").write_text(
        "SCRIPT: pretrain_gpt.py\nTEST_TYPE: regular\nMODEL_ARGS: {--train-iters: 5}\n"
        "TOLERANCE: {lm loss: {atol: 2e-3}}\n")
    case = load_case(folder, tmp_path)
    assert case.tolerances["lm loss"] == gv.Tolerance(atol=2e-3)
    assert case.tolerances["iteration-time"] == gv.DEFAULT_TOLERANCES["iteration-time"]
    assert case.metrics == ("lm loss", "num-zeros")


# ------------------------------------------------------------------- variables and run plans

def test_expand_variables(tmp_path, monkeypatch):
    monkeypatch.delenv("DATA_PATH", raising=False)
    variables = case_variables(tmp_path)
    assert expand("${CHECKPOINT_SAVE_PATH}/x", variables) == f"{tmp_path}/checkpoints/x"
    assert expand("${TENSORBOARD_PATH}", variables) == f"{tmp_path}/tensorboard"
    assert expand(3, variables) == "3"
    with pytest.raises(ValueError, match=r"\$\{DATA_PATH\} is wrong: not set. Export DATA_PATH"):
        expand("${DATA_PATH}", variables)
    with pytest.raises(ValueError, match=r"\$\{NOPE\} is wrong"):
        expand("${NOPE}", variables)
    monkeypatch.setenv("DATA_PATH", "/data/train.jsonl")
    assert expand("${DATA_PATH}", case_variables(tmp_path)) == "/data/train.jsonl"


def test_to_argv_bare_flags_lists_and_omitted():
    argv = to_argv({"--swiglu": True, "--untie": False, "--x": None, "--lr": 1e-3,
                    "--cuda-graph-scope": ["attn", "mlp"], "--save": "${P}"}, {"P": "/c"})
    assert argv == ["--swiglu", "--lr", "0.001", "--cuda-graph-scope", "attn", "mlp",
                    "--save", "/c"]


def test_regular_plan_and_steps_use_exit_interval(tmp_path):
    case = load_case(CASES_ROOT / "gpt" / "gpt_eager")
    (full,) = plan_runs(case, case_variables(tmp_path))
    assert "--exit-interval" not in full.argv
    (short,) = plan_runs(case, case_variables(tmp_path), steps=10)
    # The LR schedule still spans --train-iters: the first 10 golden values stay valid.
    assert short.argv[short.argv.index("--train-iters") + 1] == "50"
    assert short.argv[short.argv.index("--exit-interval") + 1] == "10"
    with pytest.raises(ValueError, match="--steps is wrong: 51"):
        plan_runs(case, case_variables(tmp_path), steps=51)


def _flag(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_ckpt_resume_plan_splits_at_half(tmp_path):
    case = load_case(CASES_ROOT / "gpt" / "gpt_ckpt_resume")
    first, second = plan_runs(case, case_variables(tmp_path))
    ckpt = str(tmp_path / "checkpoints")
    assert (_flag(first.argv, "--save"), _flag(first.argv, "--exit-interval")) == (ckpt, "25")
    assert _flag(first.argv, "--save-interval") == "25"  # Megatron-LM: --save needs one
    assert _flag(first.argv, "--load") is None
    assert _flag(second.argv, "--load") == ckpt and _flag(second.argv, "--exit-interval") is None
    first, second = plan_runs(case, case_variables(tmp_path), steps=10)
    assert _flag(first.argv, "--exit-interval") == "5"
    assert _flag(second.argv, "--exit-interval") == "10"


def test_ckpt_resume_uses_model_args_2(tmp_path):
    config = BASE_CONFIG | {"TEST_TYPE": "ckpt-resume",
                            "MODEL_ARGS_2": {"--train-iters": 10, "--mock-data": True,
                                             "--lr": 5e-4}}
    case = load_case(write_case(tmp_path, "gpt/resume", config), tmp_path)
    first, second = plan_runs(case, case_variables(tmp_path / "w"))
    assert "--lr" not in first.argv
    # The runner's own --save comes with the --save-interval Megatron-LM wants: the split.
    assert (_flag(first.argv, "--save"), _flag(first.argv, "--save-interval")) == (
        str(tmp_path / "w" / "checkpoints"), "5")
    assert _flag(second.argv, "--lr") == "0.0005"
    assert _flag(second.argv, "--load") == str(tmp_path / "w" / "checkpoints")


# -------------------------------------------------------------------- metrics -> golden layout

def test_metrics_to_golden_layout():
    golden = gv.metrics_to_golden([record(1, 6.9, zeros=3, ms=1500.0),
                                   record(2, 6.5, zeros=4, ms=100.0)])
    assert set(golden) == {"lm loss", "num-zeros", "iteration-time"}
    assert golden["lm loss"] == {"start_step": 1, "end_step": 2, "step_interval": 1,
                                 "values": {"1": 6.9, "2": 6.5}}
    assert golden["num-zeros"]["values"] == {"1": 3, "2": 4}
    assert golden["iteration-time"]["values"] == {"1": 1.5, "2": 0.1}  # seconds, as Megatron


def test_metrics_to_golden_reads_what_megatron_lms_loop_reports():
    """The metrics file has no memory or gradient-norm keys any more; num zeros comes from
    Megatron-LM's log line (a float there) and only with --log-num-zeros-in-grad."""
    records = [{"iteration": 1, "consumed_samples": 4, "lm_loss": 6.9,
                "iteration_time_ms": 120.0, "tokens_per_sec": 900.0, "graph fallbacks": 0,
                "num_zeros": 783.0, "learning_rate": 1e-3, "grad_norm": 2.5}]
    golden = gv.metrics_to_golden(records)
    assert set(golden) == {"lm loss", "num-zeros", "iteration-time"}
    assert golden["num-zeros"]["values"] == {"1": 783}
    without = [{k: v for k, v in r.items() if k != "num_zeros"} for r in records]
    assert set(gv.metrics_to_golden(without)) == {"lm loss", "iteration-time"}
    assert "mem-max-allocated-bytes" not in gv.METRICS
    assert "moe_dropped_token_fraction" not in gv.METRICS


def moe_record(step, loss, aux):
    """A record of an MoE run: Megatron-LM's log line has the aux and z losses."""
    return record(step, loss) | {"load_balancing_loss": aux, "z_loss": 2.5}


def test_moe_metrics_are_recorded_only_from_runs_that_write_them():
    golden = gv.metrics_to_golden([moe_record(1, 6.9, 1.02), moe_record(2, 6.5, 1.01)])
    assert golden["load_balancing_loss"]["values"] == {"1": 1.02, "2": 1.01}
    assert golden["z_loss"]["values"] == {"1": 2.5, "2": 2.5}
    assert set(golden_of([6.9, 6.5])) == {"lm loss", "num-zeros",
                                          "iteration-time"}  # dense: unchanged
    # A record without the key (a run that stopped logging it) is NaN, which fails a comparison.
    partial = gv.metrics_to_golden([moe_record(1, 6.9, 1.02), record(2, 6.5)])
    assert math.isnan(partial["load_balancing_loss"]["values"]["2"])


def test_a_case_comparing_the_aux_loss_fails_on_a_run_without_it():
    golden = gv.metrics_to_golden([moe_record(1, 6.9, 1.02)])
    tolerances = gv.resolve_tolerances({"load_balancing_loss": {"atol": 2e-3}})
    ok, missing = gv.compare(golden, golden_of([6.9]), ["lm loss", "load_balancing_loss"],
                             tolerances)
    assert ok.ok and not missing.ok
    assert missing.summary() == "load_balancing_loss: not in the run's metrics"
    (close,) = gv.compare(golden, gv.metrics_to_golden([moe_record(1, 6.9, 1.0215)]),
                          ["load_balancing_loss"], tolerances)
    assert close.ok


def test_metrics_to_golden_rejects_repeats_and_empty():
    with pytest.raises(ValueError, match="not strictly increasing"):
        gv.metrics_to_golden([record(1, 1.0), record(2, 1.0), record(1, 1.0)])
    with pytest.raises(ValueError, match="no training records"):
        gv.metrics_to_golden([])


def test_ckpt_resume_concatenation():
    first = [record(i, 7.0 - i / 10) for i in range(1, 26)]
    second = [record(i, 7.0 - i / 10) for i in range(26, 51)]
    merged = gv.concat_runs([first, second])
    assert [r["iteration"] for r in merged] == list(range(1, 51))
    golden = gv.metrics_to_golden(merged)
    assert (golden["lm loss"]["start_step"], golden["lm loss"]["end_step"]) == (1, 50)
    with pytest.raises(ValueError, match="run 2 is wrong: it starts at iteration 1"):
        gv.concat_runs([first, first])
    with pytest.raises(ValueError, match="run 2 is wrong: it wrote no training records"):
        gv.concat_runs([first, []])


# -------------------------------------------------------------------------------- comparison

def compare_loss(golden, now, tol=gv.Tolerance(), steps=None):
    (result,) = gv.compare(golden, now, ["lm loss"], {"lm loss": tol}, steps)
    return result


def test_exact_comparison_passes_only_on_equal_values():
    golden = golden_of([6.9, 6.5, 6.1])
    assert compare_loss(golden, golden_of([6.9, 6.5, 6.1])).ok
    result = compare_loss(golden, golden_of([6.9, 6.5, 6.1 + 1e-12]))
    assert not result.ok
    assert [row.ok for row in result.rows] == [True, True, False]
    assert "1 of 3 rows fail" in result.summary()
    assert "at step 3" in result.summary() and "allowed exact" in result.summary()


def test_atol_comparison():
    golden = golden_of([6.9, 6.5])
    assert compare_loss(golden, golden_of([6.9015, 6.4985]), gv.Tolerance(atol=2e-3)).ok
    assert not compare_loss(golden, golden_of([6.9025, 6.5]), gv.Tolerance(atol=2e-3)).ok


def test_rtol_comparison_per_step():
    golden = golden_of([1.0, 1.0], zeros=1000)
    tol = {"num-zeros": gv.Tolerance(rtol=0.05)}
    assert gv.compare(golden, golden_of([1.0, 1.0], zeros=1049), ["num-zeros"], tol)[0].ok
    assert not gv.compare(golden, golden_of([1.0, 1.0], zeros=1051), ["num-zeros"], tol)[0].ok


def test_iteration_time_compares_medians():
    tol = {"iteration-time": gv.DEFAULT_TOLERANCES["iteration-time"]}
    golden = gv.metrics_to_golden([record(i, 1.0, ms=100.0) for i in range(1, 6)])
    # One slow step (compilation, graph capture) does not move the median.
    slow_first = gv.metrics_to_golden([record(1, 1.0, ms=9000.0)] +
                                      [record(i, 1.0, ms=103.0) for i in range(2, 6)])
    (result,) = gv.compare(golden, slow_first, ["iteration-time"], tol)
    assert result.ok and [row.step for row in result.rows] == ["median"]
    slower = gv.metrics_to_golden([record(i, 1.0, ms=106.0) for i in range(1, 6)])
    assert not gv.compare(golden, slower, ["iteration-time"], tol)[0].ok


def test_missing_and_extra_steps_fail():
    golden = golden_of([6.9, 6.5, 6.1])
    result = compare_loss(golden, golden_of([6.9, 6.5]))
    assert not result.ok
    assert (result.rows[-1].step, result.rows[-1].note) == ("3", "missing steps")
    assert "missing steps" in result.summary()
    result = compare_loss(golden, golden_of([6.9, 6.5, 6.1, 5.8]))
    assert not result.ok and result.rows[-1].note == "extra steps"
    # median comparisons report unmatched steps too
    tol = gv.DEFAULT_TOLERANCES["iteration-time"]
    (result,) = gv.compare(golden, golden_of([6.9, 6.5]), ["iteration-time"],
                           {"iteration-time": tol})
    assert not result.ok and result.rows[-1].note == "missing steps"


def test_steps_limits_the_comparison():
    golden = golden_of([6.9, 6.5, 6.1, 5.8])
    assert compare_loss(golden, golden_of([6.9, 6.5]), steps=2).ok


def test_nan_matches_only_nan():
    tol = gv.Tolerance(atol=1.0)
    assert tol.allows(math.nan, math.nan)
    assert not tol.allows(math.nan, 1.0) and not tol.allows(1.0, math.nan)


def test_metric_absent_from_golden_file_fails():
    golden = golden_of([6.9])
    del golden["num-zeros"]
    results = gv.compare(golden, golden_of([6.9]), ["lm loss", "num-zeros"],
                         gv.resolve_tolerances(None))
    assert [r.ok for r in results] == [True, False]
    assert "not in the golden file" in results[1].summary()


def test_report_has_a_row_per_step():
    report = gv.format_report([compare_loss(golden_of([6.9, 6.5]), golden_of([6.9, 6.6]))])
    lines = report.splitlines()
    assert lines[0] == "== lm loss (exact)"
    assert lines[1].split() == ["step", "golden", "now", "|diff|", "ok"]
    assert lines[2].split() == ["1", "6.9", "6.9", "0", "ok"]
    assert lines[3].split()[0] == "2" and lines[3].split()[-1] == "FAIL"


# ------------------------------------------------------------------------ record round-trip

def test_golden_file_round_trip_is_exact(tmp_path):
    losses = [6.931471805599453, 6.123456789012345, 5.000000000000001]
    golden = golden_of(losses)
    path = tmp_path / "case" / GOLDEN_NAME
    gv.write_golden(path, golden)
    assert gv.read_golden(path) == golden
    assert compare_loss(gv.read_golden(path), golden_of(losses)).ok


@pytest.fixture
def cases_copy(tmp_path):
    """A copy of the real cases, so recording does not write into the repository."""
    root = tmp_path / "cases"
    shutil.copytree(CASES_ROOT, root)
    return root


def fake_gpu_and_training(monkeypatch, losses_of_runs, moe=None):
    """Pretend CUDA is there and training wrote ``losses_of_runs`` (one list per run); with
    ``moe`` (an aux loss), every record has the MoE losses of Megatron-LM's log line too."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    calls = []

    def train(case, plans, env, workdir):
        calls.append([plan.name for plan in plans])
        runs, step = [], 1
        for losses in losses_of_runs:
            runs.append([moe_record(step + i, v, moe) if moe else record(step + i, v)
                         for i, v in enumerate(losses)])
            step += len(losses)
        return gv.concat_runs(runs)

    monkeypatch.setattr(runner, "train", train)
    return calls


def test_runner_records_then_compares(cases_copy, tmp_path, monkeypatch, capsys):
    losses = [7.0 - i / 100 for i in range(50)]
    fake_gpu_and_training(monkeypatch, [losses])
    argv = ["gpt/gpt_eager", "--workdir", str(tmp_path / "w")]
    assert runner.main(argv + ["--record"], root=cases_copy) == 0
    written = json.loads((cases_copy / "gpt" / "gpt_eager" / GOLDEN_NAME).read_text())
    assert written["lm loss"]["values"]["50"] == losses[-1]
    assert runner.main(argv, root=cases_copy) == 0
    assert "PASSED" in capsys.readouterr().out
    # The graph twin compares against the same file, within its own tolerance (5e-3).
    fake_gpu_and_training(monkeypatch, [[v + 3e-3 for v in losses]])
    assert runner.main(["gpt/gpt_layer_graphs", "--workdir", str(tmp_path / "g")],
                       root=cases_copy) == 0
    fake_gpu_and_training(monkeypatch, [[v + 1e-2 for v in losses]])
    assert runner.main(argv, root=cases_copy) == 1
    err = capsys.readouterr().err
    assert "FAILED: lm loss do not match" in err


def test_runner_records_and_compares_the_moe_metrics(cases_copy, tmp_path, monkeypatch,
                                                    capsys):
    losses = [7.0 - i / 100 for i in range(50)]
    fake_gpu_and_training(monkeypatch, [losses], moe=1.02)
    assert runner.main(["hybrid_moe/hybrid_moe_eager", "--record", "--workdir",
                        str(tmp_path / "e")], root=cases_copy) == 0
    written = gv.read_golden(cases_copy / "hybrid_moe" / "hybrid_moe_eager" / GOLDEN_NAME)
    assert written["load_balancing_loss"]["values"]["50"] == 1.02 and "z_loss" in written
    assert "moe_dropped_token_fraction" not in written  # not reported on Megatron-LM's loop
    graphs = ["hybrid_moe/hybrid_moe_chunk_graphs", "--workdir", str(tmp_path / "g")]
    fake_gpu_and_training(monkeypatch, [losses], moe=1.024)
    assert runner.main(graphs, root=cases_copy) == 0
    fake_gpu_and_training(monkeypatch, [losses], moe=1.04)
    assert runner.main(graphs, root=cases_copy) == 1
    assert "FAILED: load_balancing_loss do not match" in capsys.readouterr().err
    fake_gpu_and_training(monkeypatch, [losses])  # the MoE losses missing from the log
    assert runner.main(graphs, root=cases_copy) == 1
    err = capsys.readouterr().err
    assert "FAILED: load_balancing_loss do not match" in err


def test_a_golden_file_from_the_old_loop_still_compares(cases_copy, tmp_path, monkeypatch,
                                                        capsys):
    """A golden file recorded on the fork's own loop holds keys no longer recorded (memory,
    dropped tokens): they are ignored, and a run that reproduces the compared values passes."""
    import json

    import torch

    name = "hybrid/hybrid_eager_pp2"
    golden = gv.read_golden(CASES_ROOT / name / GOLDEN_NAME)
    old_style = dict(golden)
    for key in ("mem-max-allocated-bytes", "moe_dropped_token_fraction"):
        old_style[key] = dict(golden["lm loss"], values={
            step: 1.0 for step in golden["lm loss"]["values"]})
    (cases_copy / name / GOLDEN_NAME).write_text(json.dumps(old_style))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)

    def train(case, plans, env, workdir):
        return [record(int(k), golden["lm loss"]["values"][k],
                       zeros=golden["num-zeros"]["values"][k])
                for k in sorted(golden["lm loss"]["values"], key=int)]

    monkeypatch.setattr(runner, "train", train)
    assert runner.main([name, "--workdir", str(tmp_path)], root=cases_copy) == 0
    assert "PASSED" in capsys.readouterr().out


def test_runner_ckpt_resume_records_both_halves(cases_copy, tmp_path, monkeypatch):
    losses = [7.0 - i / 100 for i in range(50)]
    calls = fake_gpu_and_training(monkeypatch, [losses[:25], losses[25:]])
    assert runner.main(["gpt/gpt_ckpt_resume", "--record", "--workdir", str(tmp_path)],
                       root=cases_copy) == 0
    assert calls == [["first_half", "second_half"]]
    written = gv.read_golden(cases_copy / "gpt" / "gpt_ckpt_resume" / GOLDEN_NAME)
    assert written["lm loss"]["values"] == {str(i + 1): v for i, v in enumerate(losses)}


def test_runner_without_golden_values_says_record(cases_copy, capsys):
    (cases_copy / "hybrid" / "hybrid_eager" / "golden_values_h200.json").unlink()
    assert runner.main(["hybrid/hybrid_layer_graphs"], root=cases_copy) == 1
    assert "no golden values: run with --record on the H200" in capsys.readouterr().err


def test_runner_refuses_to_record_a_shared_golden_file(cases_copy, capsys):
    with pytest.raises(SystemExit) as exit_info:
        runner.main(["gpt/gpt_layer_graphs", "--record"], root=cases_copy)
    assert exit_info.value.code == 2
    assert "Record that case instead" in capsys.readouterr().err


def test_runner_without_cuda_needs_the_gpu_machine(cases_copy, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runner.main(["gpt/gpt_eager", "--record"], root=cases_copy) == 1
    assert "needs a machine with GPUs" in capsys.readouterr().err


def test_runner_list_and_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "tests.functional.run", "--list"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in CASES:
        assert name in proc.stdout


def test_pytest_does_not_collect_functional_cases():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                           "no:cacheprovider", str(CASES_ROOT.parent)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 5, proc.stdout + proc.stderr  # 5: pytest collected no test
    assert not list(CASES_ROOT.parent.rglob("test_*.py"))


def test_a_case_file_that_is_not_yaml_is_named(cases_copy, capsys):
    config = cases_copy / "gpt" / "gpt_eager" / "model_config.yaml"
    config.write_text(config.read_text() + "\n  --oops: [unclosed\n")
    for argv in (["gpt/gpt_eager"], ["--list"]):
        with pytest.raises(SystemExit) as exit_info:
            runner.main(argv, root=cases_copy)
        assert exit_info.value.code == 2
        assert "gpt/gpt_eager/model_config.yaml is wrong: not valid YAML" in capsys.readouterr().err


@pytest.mark.slow
def test_a_training_runs_output_reaches_its_log_as_it_comes(tmp_path):
    """tests/gpu/launch.torchrun with ``log``: the output is in the file while the run goes
    (a run cut by a test timeout leaves it) and comes back as ``stdout``; a real torchrun."""
    from tests.gpu import launch

    script = tmp_path / "job.py"
    log = tmp_path / "job.log"
    script.write_text("import os, sys\nprint('rank', os.environ['RANK'], flush=True)\n"
                      f"assert 'rank 0' in open({str(log)!r}).read()\n"
                      "print('to stderr', file=sys.stderr)\n")
    proc = launch.torchrun(str(script), [], nproc=1, log=str(log), timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert "rank 0" in proc.stdout and "to stderr" in proc.stdout and proc.stderr == ""
    assert log.read_text() == proc.stdout
