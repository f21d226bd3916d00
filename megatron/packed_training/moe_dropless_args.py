"""The flags of dropless MoE graphs and of skewed routing, and their parse-time rules.

``--moe-dropless-graphs`` (default off): MoE layers dropless with static shapes
(megatron/packed_graphs/moe_dropless.py), which whole-layer CUDA graphs capture and replay
whatever the routing: no capacity, no dropped token, no rerun. Also eager (no host read).
``--moe-router-skew F`` (default 0, off): benchmarks of unbalanced routing; a fixed logit bias
on the first eighth of the experts sends about ``F`` of the routed slots there.

`add_moe_dropless_args` adds both to an argparse group (the fork's "packed data" group, beside
``--moe-capacity-overflow``); `check_moe_dropless_graphs` and `check_moe_router_skew` are the
rules, run with the fork's others after Megatron-LM's ``validate_args`` (they read derived
values: ``expert_tensor_parallel_size``, ``add_bias_linear``). Every rule raises
``ValueError("<what> is wrong: <value>. <what to do>.")``.
"""

from megatron.core.transformer.enums import CudaGraphModule

from megatron.packed_training.extra_args import fail

PARTIAL_MOE_MODULES = (CudaGraphModule.moe_router.name, CudaGraphModule.moe_preprocess.name,
                       CudaGraphModule.moe.name)
ROW_ALIGNMENT = 8  # torch._grouped_mm: rows of 16 bytes, 8 bf16 values


def add_moe_dropless_args(group) -> None:
    """``--moe-dropless-graphs`` and ``--moe-router-skew`` on ``group`` (docs/moe.md)."""
    group.add_argument("--moe-dropless-graphs", action="store_true",
                       help="MoE layers dropless with static shapes: whole-layer CUDA graphs "
                            "capture them whatever the routing (no capacity, no drop, no "
                            "rerun; bf16).")
    group.add_argument("--moe-router-skew", type=float, default=0.0, metavar="FRACTION",
                       help="Benchmarks: a fixed router logit bias that sends about FRACTION "
                            "of the routed slots to the first eighth of the experts (0: off).")


def check_moe_dropless_graphs(args) -> bool:
    """The rules of ``--moe-dropless-graphs``; returns whether it is on. With it on, the fork's
    MoE graph rules (extra_args.check_moe_graphs) must let whole-layer graphs run without
    drop-and-pad."""
    if not getattr(args, "moe_dropless_graphs", False):
        return False
    flag = "--moe-dropless-graphs"
    if args.num_experts is None:
        fail(flag, True, "It configures MoE layers; add --num-experts or drop the flag")
    for wrong, what, value, todo in (
            (args.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor",
             args.moe_expert_capacity_factor, "Dropless MoE graphs route without a capacity: "
             "drop it (and --moe-pad-expert-input-to-capacity)"),
            (args.moe_pad_expert_input_to_capacity, "--moe-pad-expert-input-to-capacity", True,
             "Dropless MoE graphs pad no expert to a capacity: drop it"),
            (args.moe_capacity_overflow != "drop", "--moe-capacity-overflow",
             args.moe_capacity_overflow, "Nothing overflows without a capacity, so nothing "
             "is rerun: drop it with --moe-dropless-graphs"),
            (args.moe_router_load_file, "--moe-router-load-file", args.moe_router_load_file,
             "The loads are measured by --moe-capacity-overflow rerun, which dropless MoE "
             "graphs do not need: drop it"),
            (args.moe_token_dispatcher_type != "alltoall", "--moe-token-dispatcher-type",
             args.moe_token_dispatcher_type, "The static dropless dispatcher takes the place "
             "of alltoall: use --moe-token-dispatcher-type alltoall"),
            ((args.expert_tensor_parallel_size or 1) != 1, "--expert-tensor-parallel-size",
             args.expert_tensor_parallel_size, "Each rank runs whole experts on its own "
             "tokens: add --expert-tensor-parallel-size 1 (with tensor parallelism, "
             "--sequence-parallel splits the tokens)"),
            (any(m in PARTIAL_MOE_MODULES for m in args.packed_cuda_graph_modules),
             "--cuda-graph-modules", " ".join(args.packed_cuda_graph_modules),
             "Dropless MoE graphs capture whole MoE layers; drop moe, moe_router and "
             "moe_preprocess (they graph megatron-core's dispatcher in part)"),
            (not args.bf16, "--bf16", False, "The grouped experts run torch._grouped_mm, "
             "which takes bf16: add --bf16"),
            (args.fp8 is not None or getattr(args, "fp4", None) is not None, "--fp8-format",
             args.fp8 or getattr(args, "fp4", None), "The grouped experts run in bf16: drop "
             "FP8/FP4 (drop-and-pad with TE's grouped GEMM takes them)"),
            (args.add_bias_linear, "--disable-bias-linear", False, "The grouped experts have "
             "no biases: add --disable-bias-linear"),
            (args.moe_shared_expert_overlap, "--moe-shared-expert-overlap", True,
             "There is no token exchange to overlap with: drop it"),
            (args.moe_router_padding_for_quantization, "--moe-router-padding-for-quantization",
             True, "The grouped experts pad their groups themselves, in bf16: drop it"),
            (args.moe_latent_size is not None, "--moe-latent-size", args.moe_latent_size,
             "Not supported with dropless MoE graphs: drop it"),
            (args.overlap_moe_expert_parallel_comm, "--overlap-moe-expert-parallel-comm", True,
             "There is no expert-parallel exchange: drop it"),
            (args.overlap_dispatch_backward_with_experts_wgrad,
             "--overlap-dispatch-backward-with-experts-wgrad", True, "The grouped experts "
             "compute weight gradients in their backward: drop it"),
            (args.use_te_activation_func, "--use-te-activation-func", True,
             "The grouped experts use megatron-core's activations: drop it"),
            ("moe_act" in (args.recompute_modules or ()) and args.recompute_granularity
             == "selective", "--recompute-modules", " ".join(args.recompute_modules or ()),
             "The grouped experts do not recompute their activation: drop moe_act")):
        if wrong:
            fail(what, value, todo)
    for what, size in (("--hidden-size", args.hidden_size),
                       ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size)):
        if size % ROW_ALIGNMENT:
            fail(what, size, f"torch._grouped_mm needs rows of a multiple of 16 bytes: use a "
                             f"multiple of {ROW_ALIGNMENT} with --moe-dropless-graphs")
    return True


def check_moe_router_skew(args) -> None:
    """``--moe-router-skew``: a fraction in [0, 1) of an MoE model's routed slots."""
    skew = getattr(args, "moe_router_skew", 0.0)
    if not skew:
        return
    if args.num_experts is None:
        fail("--moe-router-skew", skew, "It biases MoE routers; add --num-experts or drop it")
    if not 0.0 < skew < 1.0:
        fail("--moe-router-skew", skew, "Give the fraction of routed slots the first eighth "
                                        "of the experts should get, in (0, 1), e.g. 0.5")
