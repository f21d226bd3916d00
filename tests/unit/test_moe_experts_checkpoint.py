"""Checkpoints of the dropless-graphs experts (`TorchGroupedMLP`) in megatron-core's
SequentialMLP layout, on CPU with real dist_checkpointing (torch_dist, one gloo process).

* The sharded state dict holds SequentialMLP's keys, global shapes and ``_extra_state``
  objects (expert axis after any ``sharded_offsets``, the stacked block's layer axis first)
  and, assembled, the same global tensors; also with ``singleton_local_shards``.
* A GPT-MoE model saved with SequentialMLP experts loads into one with dropless-graphs
  experts and back, every weight bit for bit; gated (SwiGLU) and not.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    apply_factories,
)

from megatron.packed_graphs.specs import gpt_layer_spec
from tests.unit.test_moe_dropless import EXPERTS, _layers, _stacked

GATED = {"swiglu": {}, "squared relu": dict(gated_linear_unit=False, activation_func=F.relu)}


@pytest.fixture
def cpu_save(cpu_moe, monkeypatch):
    """megatron-core's torch_dist save on CPU: its writer waits for the device after copying
    tensors to the host (nothing to wait for here), logs its memory with psutil (not a
    dependency of the fork) and broadcasts its failure flag from the current device."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(filesystem_async, "_process_memory", lambda: 0)


def _entries(module, offsets, metadata=None):
    """The module's sharded state dict with factories applied: its ShardedTensors and
    ShardedObjects."""
    sharded = module.sharded_state_dict(prefix="decoder.layers.mlp.experts.",
                                        sharded_offsets=offsets, metadata=metadata)
    apply_factories(sharded)
    return list(nested_values(sharded))


def _global_tensors(entries):
    """{key: the global tensor the ShardedTensors of ``key`` make}, with a count of how many
    times each element was written (exactly once where they tile it)."""
    tensors = {}
    for sh in entries:
        if not isinstance(sh, ShardedTensor):
            continue
        full, count = tensors.setdefault(sh.key, (torch.zeros(sh.global_shape),
                                                  torch.zeros(sh.global_shape)))
        index = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, (1,) * sh.prepend_axis_num
                                                      + tuple(sh.local_shape)))
        full[index] = sh.data.detach().float().view(full[index].shape)
        count[index] += 1
    return tensors


def _objects(entries):
    return sorted((sh.key, sh.global_shape, sh.global_offset, sh.replica_id, sh.data)
                  for sh in entries if isinstance(sh, ShardedObject))


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("offsets", [(), ((0, 1, 4),)], ids=["per-layer keys", "stacked block"])
def test_the_experts_save_sequential_mlps_keys_and_tensors(cpu_moe, activation, offsets):
    upstream, ours = _layers(**GATED[activation])
    ref, got = _entries(upstream.mlp.experts, offsets), _entries(ours.mlp.experts, offsets)
    assert {sh.key for sh in got} == {sh.key for sh in ref} == {
        f"decoder.layers.mlp.experts.experts.linear_fc{n}.{leaf}"
        for n in (1, 2) for leaf in ("weight", "_extra_state")}
    parameters = {f"decoder.layers.mlp.experts.experts.linear_fc{n}.weight":
                  getattr(ours.mlp.experts, f"fc{n}_weight") for n in (1, 2)}
    for sh in got:
        assert sh.replica_id == (0, 0, 0)
        if isinstance(sh, ShardedTensor):  # one chunk of this rank's experts: the parameter
            assert sh.data is parameters[sh.key]
    assert {(sh.key, sh.global_shape) for sh in got if isinstance(sh, ShardedTensor)} == {
        (sh.key, sh.global_shape) for sh in ref if isinstance(sh, ShardedTensor)}
    layer = (4,) if offsets else ()
    fc1_rows = 32 if activation == "swiglu" else 16
    assert {sh.global_shape for sh in got if sh.key.endswith("fc1.weight")} == {
        (*layer, EXPERTS, fc1_rows, 32)}
    assert _objects(got) == _objects(ref)  # an empty one per expert and linear
    # The same global tensors (a gated fc1's gate rows, then its linear rows), each element
    # written once.
    expected, actual = _global_tensors(ref), _global_tensors(got)
    for key, (full, count) in expected.items():
        assert torch.equal(actual[key][0], full) and torch.equal(actual[key][1], count)
        this_layer = count[1] if offsets else count
        assert torch.equal(this_layer, torch.ones_like(this_layer))


@pytest.mark.parametrize("activation", GATED)
def test_singleton_local_shards_give_sequential_mlps_per_expert_keys(cpu_moe, activation):
    upstream, ours = _layers(**GATED[activation])
    metadata = {"singleton_local_shards": True}
    ref = _entries(upstream.mlp.experts, (), dict(metadata))
    got = _entries(ours.mlp.experts, (), dict(metadata))
    describe = lambda entries: sorted(  # noqa: E731
        (sh.key, sh.global_shape, sh.global_offset, sh.replica_id)
        for sh in entries if isinstance(sh, ShardedTensor))
    assert describe(got) == describe(ref)
    assert ("decoder.layers.mlp.experts.experts.3.linear_fc1.weight_w" in {sh.key for sh in got}
            ) == (activation == "swiglu")
    assert _objects(got) == _objects(ref)
    for key, (full, _) in _global_tensors(ref).items():
        assert torch.equal(_global_tensors(got)[key][0], full)


def _model(dropless_graphs: bool, seed: int, **overrides):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from tests.unit.test_moe_dropless import config

    torch.manual_seed(seed)
    return GPTModel(config=config(num_layers=2, moe_dropless_graphs=dropless_graphs,
                                  **overrides),
                    transformer_layer_spec=gpt_layer_spec("torch", num_experts=EXPERTS),
                    vocab_size=64, max_sequence_length=16, position_embedding_type="none")


def _weights(model):
    """{name: tensor} with every layer's experts as SequentialMLP's stacked weights."""
    weights = {}
    for name, value in model.state_dict().items():
        if "_extra_state" in name or "mlp.experts." in name:
            continue
        weights[name] = value
    for i, layer in enumerate(model.decoder.layers):
        experts = layer.mlp.experts
        for n in (1, 2):
            weights[f"{i}.fc{n}"] = (getattr(experts, f"fc{n}_weight")
                                     if hasattr(experts, "fc1_weight")
                                     else _stacked(experts, f"linear_fc{n}"))
    return weights


def _save_and_load(source, target, folder, metadata=None):
    folder.mkdir()
    dist_checkpointing.save(source.sharded_state_dict(metadata=metadata), str(folder))
    state = dist_checkpointing.load(target.sharded_state_dict(metadata=metadata), str(folder))
    target.load_state_dict(state, strict=True)  # no key left over, none missing


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("direction", ["sequential to dropless graphs",
                                       "dropless graphs to sequential"])
def test_a_checkpoint_moves_between_sequential_and_dropless_graph_experts(
        cpu_save, tmp_path, activation, direction):
    to_dropless = direction == "sequential to dropless graphs"
    source = _model(not to_dropless, seed=0, **GATED[activation])
    target = _model(to_dropless, seed=1, **GATED[activation])
    before = {name: value.detach().clone() for name, value in _weights(target).items()}
    _save_and_load(source, target, tmp_path / "ckpt")
    expected, loaded = _weights(source), _weights(target)
    assert expected.keys() == loaded.keys()
    assert not torch.equal(before["0.fc1"], expected["0.fc1"])  # the load changed them
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name


def test_dropless_graph_experts_round_trip_with_singleton_local_shards(cpu_save, tmp_path):
    """The per-expert layout (``singleton_local_shards``) saves and loads too: each expert's
    weights and a SwiGLU fc1's halves come back in place."""
    _, source = _layers()
    _, target = _layers()
    with torch.no_grad():
        for weight in (target.mlp.experts.fc1_weight, target.mlp.experts.fc2_weight):
            weight.normal_()
    metadata = {"singleton_local_shards": True}
    (tmp_path / "ckpt").mkdir()
    for layer, folder in ((source, None), (target, tmp_path / "ckpt")):
        sharded = layer.mlp.experts.sharded_state_dict(prefix="experts.",
                                                       metadata=dict(metadata))
        if folder is None:
            dist_checkpointing.save(sharded, str(tmp_path / "ckpt"))
        else:
            state = dist_checkpointing.load(sharded, str(folder))
            target.mlp.experts.load_state_dict(
                {k[len("experts."):]: v for k, v in state.items()}, strict=True)
    for name in ("fc1_weight", "fc2_weight"):
        assert torch.equal(getattr(target.mlp.experts, name), getattr(source.mlp.experts, name))
