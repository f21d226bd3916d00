"""Checkpoints of the RL library on CPU (megatron/packed_training/rl/weights.py
`WeightStore.from_checkpoint`, `PackedPolicy.weights_from_checkpoint` and `save`'s argument
checks; the save / resume round trip itself runs on the GPU: tests/gpu/test_rl_checkpoint.py).

A tiny megatron-core GPTModel (local spec, bf16, SwiGLU: its fc1 is a sharded-tensor factory)
is written as a torch_dist checkpoint on CPU by the fork's writer (hf/torch_dist.py, what
megatron-core's save writes; megatron-core's own save needs CUDA), laid out as Megatron-LM's
``--save`` folder, with an optimizer tensor beside the model's. Then:

* the store holds the checkpoint's weights bitwise, under `policy_weights` names, on the
  device asked for, and the live weights are untouched; swapped in, the model holds them;
* a checkpoint saved at tensor parallel size 1 reads at TP 2 (two gloo processes): each rank
  gets what megatron-core's own load puts into its shard, and the row- and vocabulary-parallel
  weights are the slices of the whole ones;
* tools/convert_hf.py import's ``release`` checkpoint (a tiny Llama) reads as the fork's
  model loaded from it;
* refusals, before any collective: a path that is no checkpoint (missing, empty, a damaged
  tracker, a tracker naming a missing folder, the torch format) and a checkpoint of another
  model (a wider hidden size, more layers); `save` with a bad path or iteration, or on a
  policy built without Megatron-LM's arguments.
"""

import argparse
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.packed_training.rl import PackedPolicy, WeightStore, policy_weights
from tests.unit.test_hf_convert import cpu_rope  # noqa: F401  (fixture)

VOCAB, HIDDEN = 64, 32


def tiny_gpt(hidden: int = HIDDEN, layers: int = 2, seed: int = 0):
    """megatron-core's GPTModel with the local spec, bf16 weights built on CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=4,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_dropout_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, bf16=True)
    torch.manual_seed(seed)
    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=32)


def write_checkpoint(model, root, iteration: int = 7) -> str:
    """``model`` (a single process's, whole tensors) as Megatron-LM's ``--save`` folder
    ``root`` at ``iteration``: ``iter_<n>`` in torch_dist format and the tracker; the model
    under its checkpoint keys (layers stacked), an optimizer tensor beside it. Returns the
    iteration folder."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.packed_training.hf.torch_dist import Chunk, StoredTensor
    from megatron.packed_training.hf.torch_dist import write_checkpoint as write

    stored = {}
    for item in model.sharded_state_dict().values():
        parts = nested_values([item.build()]) if isinstance(item, ShardedTensorFactory) else [item]
        for part in parts:
            if not isinstance(part, ShardedTensor):
                continue  # _extra_state objects
            shape = (1,) * part.prepend_axis_num + tuple(part.local_shape)
            data = part.data.detach().clone().reshape(shape)
            stored.setdefault(part.key, StoredTensor(part.key, tuple(part.global_shape),
                                                     part.dtype, []))
            stored[part.key].chunks.append(Chunk(tuple(part.global_offset), shape,
                                                 lambda data=data: data))
    moment = torch.randn(7, dtype=torch.float32)
    stored["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = StoredTensor(
        "optimizer.state.exp_avg.embedding.word_embeddings.weight", (7,), torch.float32,
        [Chunk((0,), (7,), lambda: moment)])
    folder = os.path.join(os.fspath(root), f"iter_{iteration:07d}")
    write(folder, list(stored.values()), [], {
        "args": argparse.Namespace(num_layers=model.config.num_layers, ckpt_format="torch_dist"),
        "checkpoint_version": 3.0, "iteration": iteration,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}})
    with open(os.path.join(os.fspath(root), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return folder


def cpu_policy(model):
    """A `PackedPolicy` around ``model`` with no optimizer, runtime or schedule to run (only its
    weights and argument checks are used)."""
    return PackedPolicy([model], None, None, SimpleNamespace(listeners=[]), row_positions=64,
                        vocab_size=VOCAB, step_options={"with_seq_idx": False,
                                                        "static_max_seqlen": True,
                                                        "device": torch.device("cpu")})


def copies(model) -> dict:
    return {name: value.detach().clone() for name, value in policy_weights([model]).items()}


def bitwise(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]) for name in a)


@pytest.fixture
def saved(cpu_dist, tmp_path):
    """(the saved weights, the ``--save`` folder) of a tiny GPT at iteration 7."""
    model = tiny_gpt(seed=1)
    write_checkpoint(model, tmp_path / "run")
    return copies(model), tmp_path / "run"


# ------------------------------------------------------------------------ reading the weights

def test_the_store_holds_the_checkpoint_weights_and_the_live_ones_are_untouched(saved):
    weights, run = saved
    model = tiny_gpt(seed=2)  # another initialisation: the same config, other values
    live = copies(model)
    assert not bitwise(live, weights)
    store = WeightStore.from_checkpoint(run, [model])
    assert bitwise(store.tensors, weights)
    assert bitwise(copies(model), live)  # read into new tensors, not into the parameters
    assert not any(store.tensors[name].data_ptr() == value.data_ptr()
                   for name, value in policy_weights([model]).items())
    # The iteration folder itself (a str too) reads the same.
    folder = os.fspath(run / "iter_0000007")
    assert bitwise(WeightStore.from_checkpoint(folder, [model], torch.device("cpu")).tensors,
                   weights)


def test_swapped_in_the_model_holds_the_checkpoint_weights_and_then_its_own(saved):
    weights, run = saved
    model = tiny_gpt(seed=2)
    policy = cpu_policy(model)
    own = copies(model)
    reference = policy.weights_from_checkpoint(run)
    with policy.swapped_weights(reference):
        assert bitwise(copies(model), weights)
    assert bitwise(copies(model), own)
    assert bitwise(reference.tensors, weights)


def _tensor_parallel_worker(rank: int, world: int, run: str, weights: dict, store: str) -> None:
    """One rank of TP 2 on a gloo world: the checkpoint (saved at TP 1) read into a store of
    this rank's shards; each equals what megatron-core's load puts into the model's shard;
    row-parallel and vocabulary-parallel weights are the slices of the whole ones."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                         world_size=world)
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = tiny_gpt(seed=3)
    live = copies(model)
    got = WeightStore.from_checkpoint(run, [model]).tensors
    assert bitwise(copies(model), live)
    # megatron-core's own load, into the model (the checkpoint has no _extra_state objects).
    request = {name: item for name, item in model.sharded_state_dict().items() if name in live}
    loaded = dist_checkpointing.load(request, os.path.join(run, "iter_0000007"))
    model.load_state_dict({name: loaded[name] for name in live}, strict=False)
    assert bitwise(got, copies(model))
    shard = HIDDEN // world
    for name in ("decoder.layers.1.self_attention.linear_proj.weight",
                 "decoder.layers.0.mlp.linear_fc2.weight"):
        whole = weights[name]
        width = whole.shape[1] // world
        assert torch.equal(got[name], whole[:, rank * width:(rank + 1) * width]), name
    rows = VOCAB // world
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert torch.equal(got[name], weights[name][rank * rows:(rank + 1) * rows]), name
    assert got["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (3 * shard, HIDDEN)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_a_checkpoint_of_tensor_parallel_size_1_reads_at_2(saved, tmp_path):
    import torch.multiprocessing as mp

    weights, run = saved
    mp.spawn(_tensor_parallel_worker, nprocs=2,
             args=(2, os.fspath(run), weights, os.fspath(tmp_path / "store")))


def test_a_converted_hugging_face_checkpoint_reads_as_its_loaded_model(cpu_dist, cpu_rope,
                                                                       tmp_path_factory):
    """tools/convert_hf.py import's ``release`` checkpoint (a tiny Llama) into the fork's model
    of it: the store is what megatron-core's load put into the model, bit for bit."""
    from megatron.packed_training.hf import import_hf
    from tests.unit.hf_tiny import tiny_llama
    from tests.unit.test_rl_export import loaded_model

    root = tmp_path_factory.mktemp("llama")
    import_hf(tiny_llama(root / "hf"), root / "megatron")
    model = loaded_model("llama", os.fspath(root / "megatron"))
    expected = copies(model)
    with torch.no_grad():
        for value in policy_weights([model]).values():
            value.zero_()
    assert bitwise(WeightStore.from_checkpoint(root / "megatron", [model]).tensors, expected)


# ------------------------------------------------------------------------------- refusals

def _tracker(root, text: str):
    root.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text(text)
    return root


@pytest.mark.parametrize("case, message", [
    ("missing", r"checkpoint path is wrong: .*/missing is not a folder: give the folder "
                r"PackedPolicy.save or a training run's --save wrote \(or one of its iter_\* "
                r"folders\)"),
    ("empty", r"checkpoint path is wrong: .*/empty is not a Megatron-LM checkpoint \(it has "
              r"neither latest_checkpointed_iteration.txt nor metadata.json\): give the folder"),
    ("damaged", r"checkpoint path is wrong: .*/damaged/latest_checkpointed_iteration.txt says "
                r"'twelve', neither an iteration nor 'release': the checkpoint is damaged; "
                r"give the folder"),
    ("dangling", r"checkpoint path is wrong: .*/dangling/iter_0000012 \(named by .*\) is not "
                 r"a torch_dist checkpoint folder \(no metadata.json\). Model weights are read "
                 r"from torch_dist checkpoints: save with --ckpt-format torch_dist, "
                 r"Megatron-LM's default."),
    ("torch_format", r"checkpoint path is wrong: .*/torch_format/release \(named by .*\) holds "
                     r"a checkpoint of --ckpt-format torch \(mp_rank_\* folders\). .*save with "
                     r"--ckpt-format torch_dist"),
])
def test_a_path_that_is_no_checkpoint_is_refused(cpu_dist, tmp_path, case, message):
    path = tmp_path / case
    if case == "empty":
        path.mkdir()
    elif case == "damaged":
        _tracker(path, "twelve\n")
    elif case == "dangling":
        _tracker(path, "12\n")
    elif case == "torch_format":
        (_tracker(path, "release") / "release" / "mp_rank_00").mkdir(parents=True)
        (path / "release" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    model = tiny_gpt()
    with pytest.raises(ValueError, match=message):
        WeightStore.from_checkpoint(path, [model])
    with pytest.raises(ValueError, match=message):
        cpu_policy(model).weights_from_checkpoint(path)


def test_a_path_of_another_type_is_refused():
    with pytest.raises(ValueError, match=r"checkpoint path is wrong: 3. Give the folder of a "
                                         r"Megatron-LM checkpoint"):
        WeightStore.from_checkpoint(3, [])


@pytest.mark.parametrize("other, message", [
    (dict(hidden=48), r"holds another model: embedding.word_embeddings.weight is \(64, 32\) "
                      r"there, \(64, 48\) in this model; .* and \d+ more. Give a checkpoint of "
                      r"this model's config \(the policy's training config: layers, sizes, "
                      r"vocabulary\); any tensor, pipeline or expert parallel layout loads."),
    (dict(layers=3), r"holds another model: .*decoder.layers.self_attention.linear_proj.weight is "
                     r"\(2, 32, 32\) there, \(3, 32, 32\) in this model"),
])
def test_a_checkpoint_of_another_model_is_refused(saved, other, message):
    _, run = saved
    with pytest.raises(ValueError, match=rf"checkpoint path is wrong: {run}.*{message}"):
        WeightStore.from_checkpoint(run, [tiny_gpt(**other)])


def test_a_checkpoint_without_a_weight_of_the_model_is_refused(cpu_dist, tmp_path):
    # A model without the learned position embedding: the checkpoint lacks the policy's.
    from megatron.core.models.gpt import GPTModel

    model = tiny_gpt()
    write_checkpoint(GPTModel(model.config, model.transformer_layer_spec, vocab_size=VOCAB,
                              max_sequence_length=32, position_embedding_type="rope"),
                     tmp_path / "rope")
    with pytest.raises(ValueError, match=r"holds another model: embedding.position_embeddings."
                                         r"weight is not in it. Give a checkpoint"):
        WeightStore.from_checkpoint(tmp_path / "rope", [model])


# ------------------------------------------------------------------------------------ save

@pytest.mark.parametrize("path, iteration, message", [
    (None, None, r"save path is wrong: None. Give the checkpoint folder"),
    ("", None, r"save path is wrong: ''. Give the checkpoint folder"),
    ("run", -1, r"save iteration is wrong: -1. Give a non-negative int \(default: "
                r"policy.iteration, the steps taken\)."),
    ("run", 2.0, r"save iteration is wrong: 2.0. Give a non-negative int"),
    ("run", True, r"save iteration is wrong: True. Give a non-negative int"),
])
def test_save_refuses_a_bad_path_or_iteration(path, iteration, message):
    with pytest.raises(ValueError, match=message):
        cpu_policy(torch.nn.Linear(2, 2)).save(path, iteration=iteration)


def test_save_needs_a_policy_megatron_lm_built(monkeypatch, tmp_path):
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    with pytest.raises(RuntimeError, match=r"PackedPolicy.save needs Megatron-LM's arguments, "
                                           r"which PackedPolicy.build sets"):
        cpu_policy(torch.nn.Linear(2, 2)).save(tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_policy_counts_from_the_iteration_it_was_built_at():
    assert cpu_policy(torch.nn.Linear(2, 2)).iteration == 0
    policy = PackedPolicy([torch.nn.Linear(2, 2)], None, None, SimpleNamespace(listeners=[]),
                          row_positions=64, vocab_size=VOCAB, iteration=12,
                          step_options={"with_seq_idx": False, "static_max_seqlen": True,
                                        "device": torch.device("cpu")})
    assert policy.iteration == 12
