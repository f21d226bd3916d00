"""Library config API of megatron/packed_training/config.py: CudaGraphConfig, load_training_config.

CPU only; Transformer Engine and flash-attn are pinned absent, as in test_arguments.py.
"""

import dataclasses
import functools
import warnings

import pytest

from megatron.packed_training import argument_checks
from megatron.packed_training.arguments import parse_args
from megatron.packed_training.config import (
    GRAPH_KEYS,
    CudaGraphConfig,
    ResolvedCudaGraphConfig,
    cuda_graph_config_from_args,
    load_training_config,
    resolve_cuda_graph_config,
    transformer_config_from_args,
)

GPT = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=256, train_iters=10,
           lr=1e-3, mock_data=True)
HYBRID = dict(model="hybrid", hybrid_override_pattern="M*M-", hidden_size=64,
              num_attention_heads=4, mamba_head_dim=16, seq_length=256, train_iters=10, lr=1e-3,
              mock_data=True)
GPT_ARGV = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "256", "--train-iters", "10", "--lr", "1e-3", "--mock-data"]
HYBRID_ARGV = ["--hybrid-override-pattern", "M*M-", "--hidden-size", "64",
               "--num-attention-heads", "4", "--mamba-head-dim", "16", "--seq-length", "256",
               "--train-iters", "10", "--lr", "1e-3", "--mock-data"]
LOCAL = dict(cuda_graph_impl="local", cuda_graph_max_packed_seqs=64)


@pytest.fixture(autouse=True)
def no_optional_packages(monkeypatch):
    """Pin "not installed" so the tests do not depend on the machine."""
    monkeypatch.setattr(argument_checks, "is_importable", lambda package: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def resolve(**keys):
    return resolve_cuda_graph_config(keys)


def _comparable(value):
    """Callables by identity; the init methods are fresh ``functools.partial``s per config."""
    if isinstance(value, functools.partial):
        return ("partial", id(value.func), value.args, value.keywords)
    return ("callable", id(value)) if callable(value) else value


def assert_same_transformer_config(a, b):
    for field in dataclasses.fields(a):
        assert _comparable(getattr(a, field.name)) == _comparable(getattr(b, field.name)), \
            field.name


# ------------------------------------------------------------------- CLI and API agree

@pytest.mark.parametrize("settings, argv", [
    ({**GPT, "cuda_graph_impl": "local", "cuda_graph_modules": "attn,mlp",
      "cuda_graph_max_packed_seqs": 64, "swiglu": True, "bf16": True},
     GPT_ARGV + ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn,mlp",
                 "--cuda-graph-max-packed-seqs", "64", "--swiglu", "--bf16"]),
    ({**HYBRID, "cuda_graph_impl": "local", "cuda_graph_modules": ["mamba", "attn"],
      "cuda_graph_max_packed_seqs": 32, "calculate_per_token_loss": False},
     HYBRID_ARGV + ["--cuda-graph-impl", "local", "--cuda-graph-modules", "mamba", "attn",
                    "--cuda-graph-max-packed-seqs", "32", "--no-calculate-per-token-loss"]),
    ({**GPT, "cuda_graph_impl": "local", "cuda_graph_scope": "attn",
      "cuda_graph_max_packed_seqs": 64},
     GPT_ARGV + ["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn",
                 "--cuda-graph-max-packed-seqs", "64"]),
    (GPT, GPT_ARGV),
    # A layer list as YAML gives it, and as the CLI's list expression.
    ({**GPT, "num_experts": 4, "moe_layer_freq": [0, 1, 1, 1]},
     GPT_ARGV + ["--num-experts", "4", "--moe-layer-freq", "[0]*1+[1]*3"]),
], ids=["gpt-graphs", "hybrid-graphs", "gpt-deprecated-scope", "gpt-eager", "gpt-moe-layers"])
def test_cli_and_api_give_the_same_transformer_config(settings, argv):
    model = settings.get("model", "gpt")
    cli = parse_args(argv, model=model)
    api = load_training_config(settings)
    assert vars(api) == vars(cli)
    assert_same_transformer_config(transformer_config_from_args(api),
                                   transformer_config_from_args(cli))
    assert cuda_graph_config_from_args(api) == cuda_graph_config_from_args(cli)


def test_cli_and_api_give_the_same_resolved_graph_config():
    cli = parse_args(GPT_ARGV + ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
                                 "mlp", "--cuda-graph-max-packed-seqs", "64"])
    api = resolve(cuda_graph_modules="attn mlp", **LOCAL)
    assert api == cuda_graph_config_from_args(cli)
    assert api.cuda_graph_modules == ("attn", "mlp")


# ------------------------------------------------------------------- every key optional

@pytest.mark.parametrize("raw", [{}, CudaGraphConfig()], ids=["dict", "dataclass"])
def test_empty_graph_config_is_graphs_off(raw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = resolve_cuda_graph_config(raw)
    assert resolved == ResolvedCudaGraphConfig(
        cuda_graph_impl="none", cuda_graph_modules=(), cuda_graph_max_packed_seqs=0,
        cuda_graph_granularity="layer", cuda_graph_capacity_ladder=(),
        cuda_graph_warmup_steps=3, rng_tracker_for_graphs=False)


def test_none_values_mean_the_cli_default():
    assert resolve(**{key: None for key in GRAPH_KEYS}) == resolve()


def test_no_graph_keys_in_training_config_is_graphs_off():
    args = load_training_config(GPT)
    assert (args.cuda_graph_impl, args.cuda_graph_modules, args.cuda_graph_max_packed_seqs) == (
        "none", [], 0)
    assert not hasattr(args, "cuda_graph_scope")


def test_dataclass_and_dict_resolve_alike():
    assert resolve_cuda_graph_config(CudaGraphConfig(cuda_graph_modules="mlp", **LOCAL)) == \
        resolve(cuda_graph_modules="mlp", **LOCAL)


def test_graph_config_fields_are_frozen():
    """A test that freezes the keys: a new key must be added to docs/config-api.md too."""
    assert GRAPH_KEYS == ("cuda_graph_impl", "cuda_graph_modules", "cuda_graph_max_packed_seqs",
                          "cuda_graph_granularity", "cuda_graph_capacity_ladder",
                          "cuda_graph_warmup_steps", "enable_cuda_graph", "cuda_graph_scope")


def test_capacity_ladder_key_follows_the_cli_rules():
    assert resolve(cuda_graph_capacity_ladder=[8, 16], **LOCAL).cuda_graph_capacity_ladder == (8, 16)
    for bad in ("8,16", [8, "16"], [True]):
        with pytest.raises(ValueError, match="cuda_graph_capacity_ladder is wrong"):
            resolve(cuda_graph_capacity_ladder=bad, **LOCAL)
    with pytest.raises(ValueError, match="strictly ascending"):
        resolve(cuda_graph_capacity_ladder=[16, 8], **LOCAL)


# ------------------------------------------------------------------- RNG tracker flag

@pytest.mark.parametrize("keys, expected", [({}, False), (LOCAL, True)])
def test_rng_tracker_is_on_whenever_graphs_are_on(keys, expected):
    assert resolve(**keys).rng_tracker_for_graphs is expected


def test_rng_tracker_is_on_with_the_deprecated_switch():
    with pytest.warns(DeprecationWarning):
        resolved = resolve(enable_cuda_graph=True, cuda_graph_max_packed_seqs=64)
    assert resolved.rng_tracker_for_graphs is True


# ------------------------------------------------------------------- deprecated enable_cuda_graph

def test_enable_cuda_graph_maps_to_local_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="enable_cuda_graph is deprecated.*cuda_graph_impl"):
        resolved = resolve(enable_cuda_graph=True, cuda_graph_max_packed_seqs=64)
    assert resolved.cuda_graph_impl == "local"


def test_enable_cuda_graph_with_impl_local_agrees():
    with pytest.warns(DeprecationWarning):
        assert resolve(enable_cuda_graph=True, **LOCAL).cuda_graph_impl == "local"


def test_enable_cuda_graph_false_alone_is_graphs_off():
    with pytest.warns(DeprecationWarning):
        assert resolve(enable_cuda_graph=False).cuda_graph_impl == "none"


@pytest.mark.parametrize("impl", ["none", "transformer_engine"])
def test_enable_cuda_graph_true_conflicts_with_other_impl(impl):
    with pytest.warns(DeprecationWarning), pytest.raises(
            ValueError, match=f"enable_cuda_graph is wrong: True. .*conflicts with "
                              f"cuda_graph_impl '{impl}'"):
        resolve(enable_cuda_graph=True, cuda_graph_impl=impl, cuda_graph_max_packed_seqs=64)


def test_enable_cuda_graph_false_conflicts_with_impl_local():
    with pytest.warns(DeprecationWarning), pytest.raises(
            ValueError, match="enable_cuda_graph is wrong: False. It conflicts with "
                              "cuda_graph_impl 'local'"):
        resolve(enable_cuda_graph=False, **LOCAL)


def test_enable_cuda_graph_must_be_a_bool():
    with pytest.raises(ValueError, match="enable_cuda_graph is wrong: 'yes'"):
        resolve(enable_cuda_graph="yes")


def test_enable_cuda_graph_in_training_config():
    with pytest.warns(DeprecationWarning):
        args = load_training_config({**GPT, "enable_cuda_graph": True,
                                     "cuda_graph_max_packed_seqs": 64})
    assert args.cuda_graph_impl == "local"
    assert not hasattr(args, "enable_cuda_graph")


# ------------------------------------------------------------------- modules

@pytest.mark.parametrize("modules", ["attn,mlp", "attn mlp", "attn, mlp", ["attn", "mlp"],
                                     ["attn,mlp"], ("attn", "mlp", "attn")])
def test_module_spellings_normalise_alike(modules):
    assert resolve(cuda_graph_modules=modules, **LOCAL).cuda_graph_modules == ("attn", "mlp")


@pytest.mark.parametrize("modules", ["", []])
def test_empty_modules_are_the_whole_layer(modules):
    assert resolve(cuda_graph_modules=modules, **LOCAL).cuda_graph_modules == ()


def test_modules_with_impl_none_warn_and_are_dropped():
    with pytest.warns(UserWarning, match="cuda_graph_modules attn,mlp is not applied: "
                                         "cuda_graph_impl is none"):
        resolved = resolve(cuda_graph_modules="attn,mlp")
    assert resolved.cuda_graph_modules == ()
    assert resolved.cuda_graph_impl == "none"


def test_modules_with_impl_none_in_training_config_are_dropped():
    with pytest.warns(UserWarning, match="not applied"):
        args = load_training_config({**GPT, "cuda_graph_modules": "mlp"})
    assert args.cuda_graph_modules == []


def test_modules_with_impl_none_are_still_checked():
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: 'atn'"):
        resolve(cuda_graph_modules="atn")


@pytest.mark.parametrize("name, match", [
    ("bogus", "Valid CudaGraphModule names are"),
    ("full_iteration", "It is a CUDA graph implementation, not a module: whole training "
                       "iterations as one graph are --cuda-graph-impl full_iteration"),
    ("full_iteration_inference", "It is an inference graph scope"),
    ("moe", "MoE layers are captured whole when --cuda-graph-modules is not given"),
])
def test_module_names_are_checked_like_the_cli(name, match):
    with pytest.raises(ValueError, match=f"--cuda-graph-modules is wrong: '{name}'. {match}"):
        resolve(cuda_graph_modules=f"attn,{name}", **LOCAL)


def test_full_iteration_impl_is_checked_like_the_cli():
    assert resolve(cuda_graph_impl="full_iteration",
                   cuda_graph_max_packed_seqs=64).cuda_graph_impl == "full_iteration"
    with pytest.raises(ValueError, match="--cuda-graph-capacity-ladder is wrong: 16. "
                                         "--cuda-graph-impl full_iteration captures one capacity"):
        resolve(cuda_graph_impl="full_iteration", cuda_graph_max_packed_seqs=64,
                cuda_graph_capacity_ladder=[16])
    with pytest.raises(ValueError, match="--no-check-for-nan-in-loss-and-grad is wrong: not "
                                         "given. DDP's NaN check"):
        load_training_config({**GPT, "cuda_graph_impl": "full_iteration",
                              "cuda_graph_max_packed_seqs": 64})


def test_mamba_module_is_rejected_for_gpt():
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: mamba. A gpt model"):
        resolve_cuda_graph_config({"cuda_graph_modules": "mamba", **LOCAL}, model="gpt")
    with pytest.raises(ValueError, match="A gpt model has no Mamba layers"):
        load_training_config({**GPT, "cuda_graph_modules": "mamba", **LOCAL})


def test_mamba_module_is_accepted_for_hybrid():
    resolved = resolve_cuda_graph_config({"cuda_graph_modules": "mamba", **LOCAL}, model="hybrid")
    assert resolved.cuda_graph_modules == ("mamba",)


@pytest.mark.parametrize("modules", [3, ["attn", 3], {"attn": True}])
def test_modules_of_the_wrong_type_are_rejected(modules):
    with pytest.raises(ValueError, match="cuda_graph_modules is wrong: .* Use a string such as"):
        resolve(cuda_graph_modules=modules, **LOCAL)


# ------------------------------------------------------------------- deprecated cuda_graph_scope

def test_cuda_graph_scope_key_is_a_deprecated_alias_that_warns_once(recwarn):
    args = load_training_config({**GPT, **LOCAL, "cuda_graph_scope": "attn,mlp"})
    alias = [w for w in recwarn if issubclass(w.category, FutureWarning)]
    assert [str(w.message) for w in alias] == [
        "cuda_graph_scope is deprecated; use cuda_graph_modules (same names) instead."]
    assert args.cuda_graph_modules == ["attn", "mlp"]
    assert not hasattr(args, "cuda_graph_scope")
    with pytest.warns(FutureWarning, match="cuda_graph_scope is deprecated"):
        resolved = resolve_cuda_graph_config(CudaGraphConfig(cuda_graph_scope=["mlp"], **LOCAL))
    assert resolved.cuda_graph_modules == ("mlp",)


def test_cuda_graph_modules_and_scope_keys_together_are_refused():
    with pytest.raises(ValueError, match="cuda_graph_modules / cuda_graph_scope is wrong: both "
                                         "given. cuda_graph_scope is the deprecated spelling of "
                                         "cuda_graph_modules; give only cuda_graph_modules"):
        resolve(cuda_graph_modules="attn", cuda_graph_scope="attn", **LOCAL)


@pytest.mark.parametrize("name, match", [
    ("full_iteration", "It is a CUDA graph implementation, not a module"),
    ("full_iteration_inference", "It is an inference graph scope"),
    ("moe", "MoE layers are captured whole when --cuda-graph-modules is not given"),
])
def test_deprecated_scope_names_are_refused_with_their_reason(name, match):
    with pytest.warns(FutureWarning), pytest.raises(
            ValueError, match=f"--cuda-graph-scope is wrong: '{name}'. {match}"):
        resolve(cuda_graph_scope=name, **LOCAL)


def test_deprecated_scope_with_impl_none_names_its_key():
    with pytest.warns(FutureWarning), pytest.warns(UserWarning, match="cuda_graph_scope mlp is "
                                                                      "not applied"):
        assert resolve(cuda_graph_scope="mlp").cuda_graph_modules == ()


# ------------------------------------------------------------------- the CLI's other rules

@pytest.mark.parametrize("keys, match", [
    ({"cuda_graph_impl": "local"},
     "--cuda-graph-max-packed-seqs is wrong: 0. --cuda-graph-impl local .* needs a fixed"),
    ({"cuda_graph_max_packed_seqs": 64},
     "--cuda-graph-max-packed-seqs is wrong: 64. It would be silently ignored"),
    ({"cuda_graph_impl": "local", "cuda_graph_max_packed_seqs": -1},
     "--cuda-graph-max-packed-seqs is wrong: -1"),
    ({**LOCAL, "cuda_graph_warmup_steps": -1}, "--cuda-graph-warmup-steps is wrong: -1"),
    ({**LOCAL, "cuda_graph_granularity": "chunk", "cuda_graph_modules": "attn"},
     "--cuda-graph-modules is wrong: attn. Chunk graphs capture the whole model chunk"),
    ({"cuda_graph_granularity": "chunk"},
     "--cuda-graph-granularity is wrong: chunk. Chunk graphs are built by the local"),
    ({"cuda_graph_impl": "transformer_engine", "cuda_graph_max_packed_seqs": 64},
     "--cuda-graph-impl is wrong: transformer_engine. It needs transformer_engine"),
])
def test_graph_rules_are_the_clis(keys, match):
    with pytest.raises(ValueError, match=match):
        resolve(**keys)


@pytest.mark.parametrize("keys, match", [
    ({"cuda_graph_impl": "cudagraph"},
     "cuda_graph_impl is wrong: 'cudagraph'. Use one of none, local, transformer_engine"),
    ({"cuda_graph_granularity": "block"},
     "cuda_graph_granularity is wrong: 'block'. Use one of layer, chunk"),
    ({"cuda_graph_max_packed_seqs": "64"}, "cuda_graph_max_packed_seqs is wrong: '64'"),
    ({"cuda_graph_max_packed_seqs": True}, "cuda_graph_max_packed_seqs is wrong: True"),
    ({"cuda_graph_warmup_steps": 1.5}, "cuda_graph_warmup_steps is wrong: 1.5"),
])
def test_graph_values_of_the_wrong_type_or_choice(keys, match):
    with pytest.raises(ValueError, match=match):
        resolve(**keys)


# ------------------------------------------------------------------- unknown keys

def test_unknown_graph_key_is_rejected():
    with pytest.raises(ValueError, match="cuda graph config key is wrong: cuda_graph_mode. "
                                         "Allowed keys are .*cuda_graph_impl"):
        resolve(cuda_graph_mode="local")


def test_unknown_training_key_is_rejected():
    with pytest.raises(ValueError, match="training config key is wrong: hiden_size, "
                                         "num_heads. Allowed keys are .*hidden_size"):
        load_training_config({**GPT, "hiden_size": 64, "num_heads": 4})


def test_derived_keys_are_not_settings():
    with pytest.raises(ValueError, match="training config key is wrong: padded_vocab_size"):
        load_training_config({**GPT, "padded_vocab_size": 32000})


# ------------------------------------------------------------------- training config values

def test_missing_required_keys_are_named():
    settings = {key: value for key, value in GPT.items() if key not in ("lr", "hidden_size")}
    with pytest.raises(ValueError, match="training config is wrong: no hidden_size, lr"):
        load_training_config(settings)


def test_unknown_model_is_rejected():
    with pytest.raises(ValueError, match="model is wrong: 'bert'"):
        load_training_config({**GPT, "model": "bert"})


@pytest.mark.parametrize("key, value, match", [
    ("hidden_size", "wide", "argument --hidden-size: invalid int value: 'wide'"),
    ("normalization", "BatchNorm", "argument --normalization: invalid choice"),
    ("hidden_size", True, "hidden_size is wrong: True. It takes a value"),
    ("hidden_size", [64], "hidden_size is wrong: \\[64\\]. It takes one value"),
    ("swiglu", "yes", "swiglu is wrong: 'yes'. It is an on/off flag"),
])
def test_bad_training_values_are_value_errors(key, value, match):
    with pytest.raises(ValueError, match=match):
        load_training_config({**GPT, key: value})


def test_validate_args_rules_apply():
    with pytest.raises(ValueError, match="--hidden-size is wrong: 63"):
        load_training_config({**GPT, "hidden_size": 63})


def test_flags_and_negative_looking_values():
    args = load_training_config({**HYBRID, "hybrid_override_pattern": "-M*M", "swiglu": False,
                                 "calculate_per_token_loss": False, "min_lr": 0})
    assert args.hybrid_override_pattern == "-M*M"
    assert args.swiglu is False and args.calculate_per_token_loss is False


def test_world_size_is_passed_to_validation():
    args = load_training_config({**GPT, "micro_batch_size": 2}, world_size=4)
    assert (args.data_parallel_size, args.global_batch_size) == (4, 8)


# ------------------------------------------------------------------- YAML

def test_yaml_file_loads_like_a_dict(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        "model: hybrid\n"
        "hybrid_override_pattern: M*M-\n"
        "hidden_size: 64\n"
        "num_attention_heads: 4\n"
        "mamba_head_dim: 16\n"
        "seq_length: 256\n"
        "train_iters: 10\n"
        "lr: 1e-3          # PyYAML reads this as a string; the CLI parser makes it a float\n"
        "mock_data: true\n"
        "cuda_graph_impl: local\n"
        "cuda_graph_modules: mamba,attn\n"
        "cuda_graph_max_packed_seqs: 32\n")
    args = load_training_config(path)
    assert args.lr == 1e-3
    assert args.cuda_graph_modules == ["mamba", "attn"]
    assert vars(args) == vars(load_training_config(
        {**HYBRID, "cuda_graph_impl": "local", "cuda_graph_modules": ["mamba", "attn"],
         "cuda_graph_max_packed_seqs": 32}))
    assert vars(load_training_config(str(path))) == vars(args)


def test_yaml_modules_as_a_list(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("".join(f"{key}: {value}\n" for key, value in GPT.items())
                    + "cuda_graph_impl: local\ncuda_graph_max_packed_seqs: 64\n"
                      "cuda_graph_modules: [attn, mlp]\n")
    assert load_training_config(path).cuda_graph_modules == ["attn", "mlp"]


def test_yaml_that_is_not_a_mapping_is_rejected(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("- num_layers: 4\n")
    with pytest.raises(ValueError, match="train.yaml is wrong: list. A training config file "
                                         "holds one mapping"):
        load_training_config(path)


def test_empty_yaml_names_the_missing_keys(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("")
    with pytest.raises(ValueError, match="training config is wrong: no hidden_size"):
        load_training_config(path)


def test_the_callers_dict_is_not_changed():
    settings = {**GPT, **LOCAL}
    load_training_config(settings)
    assert settings == {**GPT, **LOCAL}


@pytest.mark.parametrize("pp,vpp,batched", [(1, None, True), (2, None, True), (2, 2, False),
                                            (4, 2, True)])
def test_batched_p2p_is_off_only_where_pipeline_peers_coincide(pp, vpp, batched):
    """PP=2 x VPP: batched p2p swaps a gradient and an activation (see config.py)."""
    from megatron.packed_training.arguments import build_parser, validate_args

    argv = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
            "--pipeline-model-parallel-size", str(pp)]
    if vpp:
        argv += ["--virtual-pipeline-model-parallel-size", str(vpp)]
    args = validate_args(build_parser("gpt").parse_args(argv), "gpt", world_size=pp)
    assert transformer_config_from_args(args).batch_p2p_comm is batched
