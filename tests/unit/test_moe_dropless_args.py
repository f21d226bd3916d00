"""The parse-time rules of --moe-dropless-graphs and --moe-router-skew
(megatron/packed_training/extra_args.py), on copies of one parsed MoE launch line, and
the flags themselves on a parser of the fork's flags alone (add_packed_args)."""

import argparse
import copy

import pytest

from megatron.packed_training import extra_args
from megatron.packed_training.arguments import parse_args
from megatron.packed_training.extra_args import (
    add_packed_args,
    check_moe_dropless_graphs,
    check_moe_router_skew,
)

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 4 "
        "--train-iters 10 --lr 1e-3 --mock-data --attention-backend local --bf16 "
        "--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
        "--moe-token-dispatcher-type alltoall --swiglu").split()


@pytest.fixture(scope="module")
def parsed():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(extra_args, "is_importable", lambda package: False)
        mp.delenv("WORLD_SIZE", raising=False)
        return parse_args(BASE)


@pytest.fixture
def args(parsed):
    on = copy.deepcopy(parsed)
    on.moe_dropless_graphs, on.moe_router_skew = True, 0.0
    return on


def test_the_flags_and_their_defaults():
    parser = add_packed_args(argparse.ArgumentParser())
    defaults = parser.parse_args([])
    assert (defaults.moe_dropless_graphs, defaults.moe_router_skew) == (False, 0.0)
    given = parser.parse_args(["--moe-dropless-graphs", "--moe-router-skew", "0.5"])
    assert given.moe_dropless_graphs and given.moe_router_skew == 0.5


def test_a_dropless_graph_launch_line_passes(args):
    assert check_moe_dropless_graphs(args)
    args.expert_model_parallel_size = 2  # the padded fixed-size exchange
    assert check_moe_dropless_graphs(args)
    args.moe_dropless_graphs = False
    assert not check_moe_dropless_graphs(args)  # off: nothing checked


@pytest.mark.parametrize("values,flag,fix", [
    (dict(num_experts=None), "--moe-dropless-graphs", "add --num-experts"),
    (dict(moe_expert_capacity_factor=1.25), "--moe-expert-capacity-factor", "without a capacity"),
    (dict(moe_pad_expert_input_to_capacity=True), "--moe-pad-expert-input-to-capacity",
     "drop it"),
    (dict(moe_capacity_overflow="rerun"), "--moe-capacity-overflow", "nothing is rerun"),
    (dict(moe_router_load_file="loads.json"), "--moe-router-load-file", "drop it"),
    (dict(moe_token_dispatcher_type="allgather"), "--moe-token-dispatcher-type",
     "use --moe-token-dispatcher-type alltoall"),
    (dict(expert_tensor_parallel_size=2), "--expert-tensor-parallel-size",
     "add --expert-tensor-parallel-size 1"),
    (dict(packed_cuda_graph_modules=["attn", "moe_router"]), "--cuda-graph-modules",
     "drop moe, moe_router and moe_preprocess"),
    (dict(bf16=False), "--bf16", "add --bf16"),
    (dict(fp8="hybrid"), "--fp8-format", "drop FP8/FP4"),
    (dict(add_bias_linear=True), "--disable-bias-linear", "add --disable-bias-linear"),
    (dict(moe_shared_expert_overlap=True), "--moe-shared-expert-overlap", "drop it"),
    (dict(moe_latent_size=16), "--moe-latent-size", "drop it"),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
     "--recompute-modules", "drop moe_act"),
    (dict(hidden_size=60), "--hidden-size", "multiple of 8"),
    (dict(moe_ffn_hidden_size=36), "--moe-ffn-hidden-size", "multiple of 8"),
])
def test_what_dropless_graphs_refuse(args, values, flag, fix):
    for name, value in values.items():
        setattr(args, name, value)
    with pytest.raises(ValueError, match=rf"{flag} is wrong: .*\. .*{fix}"):
        check_moe_dropless_graphs(args)


@pytest.mark.parametrize("skew", [0.5, 1.0, -0.1])
def test_router_skew_is_a_share_the_router_can_reach(args, skew):
    # 4 experts, top-2: the hot expert (the first eighth, at least one) gets at most one of a
    # token's two slots, so a share below 0.5.
    args.moe_router_skew = 0.4
    check_moe_router_skew(args)
    args.moe_router_skew = skew
    with pytest.raises(ValueError, match=rf"--moe-router-skew is wrong: {skew}. With 4 experts, "
                                         rf"top-2, .* in \(0, 0.5\) .*choose one inside\.$"):
        check_moe_router_skew(args)
    args.moe_router_skew, args.num_experts = 0.4, None
    with pytest.raises(ValueError, match="add --num-experts"):
        check_moe_router_skew(args)
