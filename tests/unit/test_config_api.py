"""The library config: megatron/packed_training/config.py's load_training_config.

A dict or YAML file keyed by the flags' dest names gives the args the command line would
(each call runs one full parse, so the loaded configs are module fixtures). Transformer
Engine, flash-attn and apex are pinned absent.
"""

import pytest
import yaml

from megatron.packed_training import extra_args
from megatron.packed_graphs.settings import GraphSettings, HealthCheckConfig
from megatron.packed_training.config import (
    PackedTransformerConfig,
    graph_settings_from_args,
    load_training_config,
    transformer_config_from_args,
)

MODEL = dict(hidden_size=64, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
             micro_batch_size=1, global_batch_size=4, train_iters=10, lr=1e-3, mock_data=True,
             attention_backend="local")
GPT = dict(MODEL, num_layers=2)
GRAPHS = dict(
    GPT,
    cuda_graph_impl="local", cuda_graph_max_packed_seqs=32,
    cuda_graph_capacity_ladder=[8, 16],          # a list: the flag's values
    cuda_graph_modules=["attn", "mlp"],
    check_for_nan_in_loss_and_grad=False,        # store_false: --no-check-for-nan-in-loss-and-grad
    use_distributed_optimizer=True,              # store_true, on
    overlap_grad_reduce=False,                   # store_true at its default: no token
    metrics_file=None,                           # None: the flag's default
    vocab_size=1000,
)
HYBRID = dict(MODEL, hybrid_layer_pattern="-M*M", mamba_head_dim=16)  # a value starting with '-'


@pytest.fixture(scope="module")
def pinned():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(extra_args, "is_importable", lambda package: False)
        mp.delenv("WORLD_SIZE", raising=False)
        mp.delenv("RANK", raising=False)
        yield


@pytest.fixture(scope="module")
def from_dict(pinned):
    return load_training_config(GRAPHS)


@pytest.fixture(scope="module")
def from_yaml(pinned, tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "hybrid.yaml"
    path.write_text(yaml.safe_dump(HYBRID))
    return load_training_config(path, model="hybrid")


def test_dict_keys_are_dest_names(from_dict):
    args = from_dict
    assert (args.model, args.num_layers, args.hidden_size, args.lr) == ("gpt", 2, 64, 1e-3)
    assert args.mock_data is True
    assert (args.tokenizer_type, args.vocab_size) == ("NullTokenizer", 1000)


def test_on_off_flags(from_dict):
    assert from_dict.check_for_nan_in_loss_and_grad is False
    assert from_dict.use_distributed_optimizer is True
    assert from_dict.overlap_grad_reduce is False
    assert from_dict.metrics_file is None


def test_list_values_and_graph_settings(from_dict):
    args = from_dict
    assert args.cuda_graph_capacity_ladder == [8, 16]
    assert args.packed_cuda_graph_modules == ["attn", "mlp"]
    assert (args.packed_graph_impl, args.cuda_graph_impl) == ("local", "local")
    assert args.cuda_graph_max_packed_seqs == 32


def test_the_args_build_a_transformer_config(from_dict):
    config = transformer_config_from_args(from_dict)
    assert isinstance(config, PackedTransformerConfig)
    assert config.cuda_graph_impl == "local" and config.cuda_graph_granularity == "layer"
    assert [m.name for m in config.cuda_graph_modules] == ["attn", "mlp"]
    assert (config.num_layers, config.hidden_size) == (2, 64)


def test_the_args_build_the_graph_settings(from_dict):
    graphs = graph_settings_from_args(from_dict)
    assert isinstance(graphs, GraphSettings)
    assert (graphs.impl, graphs.granularity, graphs.capacity, graphs.ladder) == (
        "local", "layer", 32, (8, 16))
    assert (graphs.micro_batch_size, graphs.seq_length, graphs.num_microbatches) == (1, 128, 4)
    assert graphs.moe is None and graphs.cp_banks is None
    assert graphs.health_check == HealthCheckConfig() and not graphs.optimizer_graph


def test_yaml_file_for_a_hybrid_model(from_yaml):
    args = from_yaml
    assert args.model == "hybrid"
    assert args.hybrid_layer_pattern == "-M*M"  # passed as --flag=value, not read as a flag
    assert args.num_layers == 4  # Megatron-LM derives it from the pattern
    assert args.mamba_head_dim == 16


def test_yaml_equals_dict(pinned, tmp_path, from_dict):
    path = tmp_path / "gpt.yaml"
    path.write_text(yaml.safe_dump(GRAPHS))
    assert vars(load_training_config(path)) == vars(from_dict)


def test_unknown_keys_are_named(pinned):
    with pytest.raises(ValueError, match="training config key is wrong: layer_count, "
                                         "num_layer. Keys are the flags' dest names"):
        load_training_config(dict(GPT, num_layer=2, layer_count=3))


@pytest.mark.parametrize("value", ["no", 0, "false"])
def test_on_off_flag_takes_a_bool(pinned, value):
    with pytest.raises(ValueError, match=f"check_for_nan_in_loss_and_grad is wrong: {value!r}. "
                                         "It is an on/off flag; use true or false"):
        load_training_config(dict(GPT, check_for_nan_in_loss_and_grad=value))


@pytest.mark.parametrize("key, value, fix", [
    ("num_layers", [2, 4], "It takes one value"),
    ("num_layers", True, "It takes a value"),
    ("lr", {"peak": 1e-3}, "It takes a value"),
])
def test_value_shape_is_checked(pinned, key, value, fix):
    with pytest.raises(ValueError, match=f"{key} is wrong: .*{fix}"):
        load_training_config(dict(GPT, **{key: value}))


def test_yaml_that_is_not_a_mapping(pinned, tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- num_layers\n- 2\n")
    with pytest.raises(ValueError, match=r"list.yaml is wrong: a list\. .*one mapping"):
        load_training_config(path)


def test_a_rule_refusal_surfaces(pinned):
    with pytest.raises(ValueError, match="--cuda-graph-max-packed-seqs is wrong: 32. .*add "
                                         "--cuda-graph-impl local"):
        load_training_config(dict(GPT, cuda_graph_max_packed_seqs=32))


def test_the_policy_config_normalizes_per_token_over_the_step_unless_told_otherwise(pinned):
    from megatron.packed_training.rl import PolicyConfig

    assert PolicyConfig(GPT).args().calculate_per_token_loss is True
    told = PolicyConfig(dict(GPT, calculate_per_token_loss=False)).args()
    assert told.calculate_per_token_loss is False
