"""Megatron-LM script flags: a Megatron-style launch line parses; flags that change nothing
here are accepted and named; the rest are refused with the reason; --train-samples,
the hybrid layer ratios, --manual-gc and --exit-duration-in-mins work as in Megatron-LM
(CPU; the deadline's agreement across ranks with two real gloo processes)."""

import gc

import pytest
from megatron.core.models.hybrid.hybrid_layer_allocation import pattern_from_ratios

from megatron.packed_training.arguments import build_parser, validate_args
from megatron.packed_training.megatron_flags import ALREADY, REFUSED
from megatron.packed_training.training import ExitDeadline, ExitSignal, ManualGC

HYBRID = ["--hidden-size", "64", "--num-attention-heads", "4", "--mamba-head-dim", "16",
          "--seq-length", "256", "--lr", "1e-3", "--mock-data"]
GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "256", "--train-iters", "10", "--lr", "1e-3", "--mock-data"]


def validate(model, *argv, world_size=1):
    args = build_parser(model).parse_args([str(a) for a in argv])
    return validate_args(args, model, world_size=world_size)


def test_a_megatron_mamba_launch_line_runs_with_its_own_flags():
    """The flags of a Megatron-LM hybrid launch script: ratios for the layout, sample-based
    length and schedule, GQA, no biases, manual GC, fused-kernel switches."""
    args = validate(
        "hybrid", *HYBRID, "--num-layers", 12, "--hybrid-attention-ratio", 0.08,
        "--hybrid-mlp-ratio", 0.5, "--group-query-attention", "--num-query-groups", 2,
        "--use-mcore-models", "--disable-bias-linear", "--no-create-attention-mask-in-dataloader",
        "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
        "--ckpt-format", "torch_dist", "--global-batch-size", 4, "--train-samples", 400,
        "--lr-warmup-samples", 40, "--lr-decay-samples", 360, "--manual-gc",
        "--manual-gc-interval", 50)
    assert args.hybrid_override_pattern == pattern_from_ratios(12, 0.08, 0.5) == "M-M-M-*-M-M-"
    assert args.num_layers == 12 and args.num_query_groups == 2
    assert (args.train_iters, args.lr_warmup_iters, args.lr_decay_iters) == (100, 10, 90)
    named = [entry.split(" (")[0] for entry in args.megatron_flags_without_effect]
    assert named == ["--use-mcore-models", "--disable-bias-linear", "--group-query-attention",
                     "--no-create-attention-mask-in-dataloader", "--no-masked-softmax-fusion",
                     "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
                     "--ckpt-format"]
    assert "(checkpoints are megatron-core distributed checkpoints)" in \
        args.megatron_flags_without_effect[-1]


def test_no_megatron_flag_given_names_none():
    assert validate("gpt", *GPT).megatron_flags_without_effect == []


@pytest.mark.parametrize("entry", REFUSED, ids=[e.flag for e in REFUSED])
def test_every_refused_flag_names_its_reason(entry):
    values = ["x"] * (1 if entry.nargs == "+" else entry.nargs or 0)
    with pytest.raises(ValueError) as error:
        validate("gpt", *GPT, entry.flag, *values)
    assert str(error.value).startswith(f"{entry.flag} is wrong: ")
    assert entry.why in str(error.value)


VALUED = [e for e in ALREADY if e.values]


@pytest.mark.parametrize("entry", VALUED, ids=[e.flag for e in VALUED])
def test_a_valued_flag_takes_only_the_values_this_fork_runs(entry):
    model, base = ("hybrid", HYBRID + ["--hybrid-override-pattern", "M*", "--train-iters", 10]) \
        if "gpt" not in entry.models else ("gpt", GPT)
    for value in entry.values:
        assert validate(model, *base, entry.flag, *value.split()).megatron_flags_without_effect
    wrong = ["7"] * entry.nargs
    with pytest.raises(ValueError, match=f"{entry.flag} is wrong: {' '.join(wrong)}. This fork "
                                         f"runs as {entry.flag} "):
        validate(model, *base, entry.flag, *wrong)


def test_megatron_cores_hybrid_spec_is_accepted_for_hybrid_models_only():
    spec = "megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec".split()
    args = validate("hybrid", *HYBRID, "--hybrid-override-pattern", "M*", "--train-iters", 10,
                    "--spec", *spec)
    assert args.megatron_flags_without_effect[0].startswith("--spec (pretrain_mamba.py builds")
    with pytest.raises(ValueError, match="--spec is wrong: megatron.core.models.mamba.mamba_layer"
                                         "_specs mamba_stack_spec. It is for hybrid models"):
        validate("gpt", *GPT, "--spec", *spec)


# --- --train-samples and the sample-based schedule --------------------------------------------

def test_the_training_length_is_required_in_one_form():
    base = [a for a in GPT if a not in ("--train-iters", "10")]
    with pytest.raises(ValueError, match="--train-iters is wrong: None. Give the training length"):
        validate("gpt", *base)
    with pytest.raises(ValueError, match="--train-samples is wrong: 40. --train-iters .10. gives"):
        validate("gpt", *GPT, "--train-samples", 40)
    args = validate("gpt", *base, "--train-samples", 41, "--global-batch-size", 4)
    assert (args.train_iters, args.lr_warmup_iters, args.lr_decay_iters) == (10, 0, 10)


@pytest.mark.parametrize("extra,message", [
    (["--lr-warmup-samples", 8], "--lr-warmup-samples is wrong: 8. Sample-based schedules go "
                                 "with --train-samples"),
    (["--lr-decay-samples", 8], "--lr-decay-samples is wrong: 8. Sample-based"),
])
def test_sample_based_schedules_need_train_samples(extra, message):
    with pytest.raises(ValueError, match=message):
        validate("gpt", *GPT, *extra)


@pytest.mark.parametrize("extra,message", [
    (["--lr-warmup-samples", 8, "--lr-warmup-iters", 2], "--lr-warmup-iters is given too"),
    (["--lr-decay-samples", 80, "--lr-decay-iters", 20], "--lr-decay-iters is given too"),
    (["--rampup-batch-size", 2, 2, 8], "--train-samples is wrong: 400. With --rampup-batch-size"),
    (["--lr-decay-samples", 2], "--lr-decay-samples is wrong: 2. Use a value >= 4"),
])
def test_sample_based_rules(extra, message):
    base = [a for a in GPT if a not in ("--train-iters", "10")]
    with pytest.raises(ValueError, match=message):
        validate("gpt", *base, "--train-samples", 400, "--global-batch-size", 4, *extra)


# --- --hybrid-attention-ratio / --hybrid-mlp-ratio --------------------------------------------

@pytest.mark.parametrize("model,extra,message", [
    ("hybrid", ["--num-layers", 8, "--hybrid-attention-ratio", 1.5],
     "--hybrid-attention-ratio is wrong: 1.5. A fraction of --num-layers"),
    ("hybrid", ["--num-layers", 8, "--hybrid-attention-ratio", 0.6, "--hybrid-mlp-ratio", 0.6],
     "--hybrid-mlp-ratio is wrong: 0.6. With --hybrid-attention-ratio 0.6 the two exceed"),
    ("hybrid", ["--hybrid-attention-ratio", 0.25],
     "--hybrid-attention-ratio is wrong: 0.25. The ratios are fractions of --num-layers"),
    ("hybrid", ["--hybrid-override-pattern", "M*M-", "--hybrid-mlp-ratio", 0.25],
     "--hybrid-override-pattern already lays out the layers"),
    ("gpt", ["--hybrid-attention-ratio", 0.25], "It lays out a hybrid Mamba model"),
])
def test_hybrid_ratio_rules(model, extra, message):
    base = HYBRID + ["--train-iters", 10] if model == "hybrid" else GPT
    with pytest.raises(ValueError, match=message):
        validate(model, *base, *extra)


# --- --manual-gc ------------------------------------------------------------------------------

def test_manual_gc_interval_needs_manual_gc():
    with pytest.raises(ValueError, match="--manual-gc-interval is wrong: 5. It sets how often "
                                         "--manual-gc collects"):
        validate("gpt", *GPT, "--manual-gc-interval", 5)


def test_manual_gc_collects_only_at_its_interval():
    """Observed through gc.callbacks: one collection at start, then every 3rd iteration; the
    automatic collector stays off until close."""
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    was_enabled = gc.isenabled()
    gc.callbacks.append(count)
    try:
        manual = ManualGC(3)
        assert not gc.isenabled() and len(collections) == 1
        for iteration in range(1, 8):
            garbage = [[] for _ in range(2000)]  # would trigger an automatic collection
            del garbage
            manual.after_step(iteration)
        assert len(collections) == 3  # start, iteration 3, iteration 6
        manual.close()
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        if not was_enabled:
            gc.disable()


# --- --exit-duration-in-mins ------------------------------------------------------------------

def test_exit_duration_must_be_positive():
    with pytest.raises(ValueError, match="--exit-duration-in-mins is wrong: 0.0. Use a positive"):
        validate("gpt", *GPT, "--exit-duration-in-mins", 0)
    assert validate("gpt", *GPT, "--exit-duration-in-mins", 1.5).exit_duration_in_mins == 1.5


def test_the_deadline_passes_at_its_minutes():
    now = [100.0]
    deadline = ExitDeadline(2.0, start=100.0, clock=lambda: now[0])
    now[0] += 119.0
    assert not deadline.passed()
    now[0] += 1.0
    assert deadline.passed() and deadline.elapsed_minutes() == 2.0


def _deadline_rank(rank, world_size, init_file, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        # Rank 1's clock is past the deadline, rank 0's is not: both must stop.
        deadline = ExitDeadline(1.0, start=0.0, clock=lambda: 30.0 if rank == 0 else 90.0)
        results[rank] = deadline.passed()
    finally:
        dist.destroy_process_group()


def test_every_rank_stops_when_the_slowest_clock_passes(tmp_path):
    """Two real processes (gloo): the decision is all-reduced, so no rank leaves the loop
    while another trains on."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_deadline_rank, args=(2, str(tmp_path / "init"), results), nprocs=2)
        assert dict(results) == {0: True, 1: True}


def test_docs_give_every_entry_its_reason():
    """docs/flags.md's "Megatron compatibility" tables say what the tables here say."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "flags.md").read_text()
    section = docs[docs.index("## Megatron compatibility"):docs.index("## Compared with")]
    assert [e.flag for e in ALREADY + REFUSED if e.why not in section] == []


# --- --transformer-impl, --norm-epsilon ---------------------------------------------------------

def test_transformer_impl_picks_the_attention_backend(with_te):
    args = validate("gpt", *GPT, "--transformer-impl", "transformer_engine")
    assert args.attention_backend == "te" and args.megatron_flags_without_effect == []
    assert validate("gpt", *GPT, "--transformer-impl", "local").attention_backend == "torch"
    args = validate("gpt", *GPT, "--transformer-impl", "local", "--attention-backend", "torch")
    assert args.attention_backend == "torch"


@pytest.mark.parametrize("impl,backend", [("transformer_engine", "torch"), ("local", "te")])
def test_transformer_impl_refuses_the_other_implementations_backend(with_te, impl, backend):
    with pytest.raises(ValueError, match=f"--transformer-impl is wrong: {impl}. It asks for the "
                                         f".* attention backend, and --attention-backend is "
                                         f"{backend}; drop one of the two flags"):
        validate("gpt", *GPT, "--transformer-impl", impl, "--attention-backend", backend)


def test_transformer_engine_impl_needs_transformer_engine():
    with pytest.raises(ValueError, match="--attention-backend is wrong: te. It needs "
                                         "transformer_engine"):
        validate("gpt", *GPT, "--transformer-impl", "transformer_engine")


@pytest.mark.parametrize("spelling", ["--norm-epsilon", "--layernorm-epsilon"])
def test_norm_epsilon_reaches_the_config(spelling):
    from megatron.packed_training.config import transformer_config_from_args

    args = validate("gpt", *GPT, spelling, "1e-6")
    assert transformer_config_from_args(args).layernorm_epsilon == 1e-6


def test_a_megatron_moe_launch_line_runs_with_its_own_flags(with_te):
    """The extra flags of a Megatron-LM MoE script (Qwen3-MoE / Moonlight style)."""
    args = validate(
        "gpt", *GPT, "--transformer-impl", "transformer_engine", "--norm-epsilon", "1e-6",
        "--attention-softmax-in-fp32", "--no-persist-layer-norm", "--num-experts", "8",
        "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
        "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--optimizer", "adam",
        "--log-memory-to-tensorboard", "--auto-detect-ckpt-format")
    assert args.attention_backend == "te" and args.layernorm_epsilon == 1e-6
    assert [e.split(" (")[0] for e in args.megatron_flags_without_effect] == [
        "--attention-softmax-in-fp32", "--no-persist-layer-norm", "--moe-token-drop-policy",
        "--optimizer", "--log-memory-to-tensorboard", "--auto-detect-ckpt-format"]


# --- --exit-signal-handler ---------------------------------------------------------------------

@pytest.mark.parametrize("given, stored", [(None, "SIGTERM"), ("SIGUSR1", "SIGUSR1"),
                                           ("USR1", "SIGUSR1"), ("sigusr2", "SIGUSR2")])
def test_the_exit_signal_is_stored_by_its_full_name(given, stored):
    extra = ["--exit-signal", given] if given else []
    args = validate("gpt", *GPT, "--exit-signal-handler", *extra)
    assert args.exit_signal_handler and args.exit_signal == stored


def test_no_exit_signal_without_the_handler():
    assert validate("gpt", *GPT).exit_signal is None
    with pytest.raises(ValueError, match="--exit-signal is wrong: SIGUSR1. It has no effect "
                                         "without --exit-signal-handler"):
        validate("gpt", *GPT, "--exit-signal", "SIGUSR1")


@pytest.mark.parametrize("name", ["SIGKILL", "STOP", "SIGNOPE"])
def test_the_exit_signal_must_be_one_a_process_can_catch(name):
    with pytest.raises(ValueError, match=f"--exit-signal is wrong: {name}. Name a signal this "
                                         "process can catch"):
        validate("gpt", *GPT, "--exit-signal-handler", "--exit-signal", name)


def test_the_exit_signal_is_recorded_not_acted_on_and_the_old_handler_comes_back():
    """A real signal to this process: the handler only records it (the process goes on);
    ``close`` puts the previous handler back."""
    import os
    import signal

    before = signal.getsignal(signal.SIGUSR1)
    watcher = ExitSignal(signal.SIGUSR1)
    try:
        assert not watcher.received()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.received()
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def _signal_rank(rank, world_size, init_file, results):
    import os
    import signal

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    watcher = ExitSignal(signal.SIGUSR1)
    try:
        if rank == 1:  # only rank 1 gets the signal: both must stop
            os.kill(os.getpid(), signal.SIGUSR1)
        results[rank] = watcher.received()
    finally:
        watcher.close()
        dist.destroy_process_group()


def test_every_rank_stops_when_one_rank_gets_the_signal(tmp_path):
    """Two real processes (gloo), the signal sent to one: the decision is all-reduced."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_signal_rank, args=(2, str(tmp_path / "init"), results), nprocs=2)
        assert dict(results) == {0: True, 1: True}


# --- --squared-relu ----------------------------------------------------------------------------

@pytest.mark.parametrize("model, base", [("gpt", GPT),
                                         ("hybrid", HYBRID + ["--hybrid-override-pattern", "M-M*",
                                                             "--train-iters", 10])])
def test_squared_relu_is_the_mlp_activation(model, base):
    import torch
    from megatron.core.activations import squared_relu

    from megatron.packed_training.config import transformer_config_from_args

    config = transformer_config_from_args(validate(model, *base, "--squared-relu"))
    assert config.activation_func is squared_relu and not config.gated_linear_unit
    x = torch.tensor([-2.0, 0.5, 3.0])
    assert torch.equal(config.activation_func(x), torch.tensor([0.0, 0.25, 9.0]))


def test_squared_relu_and_swiglu_are_one_activation_too_many():
    with pytest.raises(ValueError, match="--squared-relu is wrong: with --swiglu. An MLP has one "
                                         "activation"):
        validate("gpt", *GPT, "--squared-relu", "--swiglu")


# --- --cross-entropy-loss-fusion ----------------------------------------------------------------

@pytest.mark.parametrize("impl", [None, "native", "te"])
def test_cross_entropy_fusion_reaches_the_model_config(impl, monkeypatch):
    from megatron.packed_training import argument_checks
    from megatron.packed_training.config import transformer_config_from_args

    monkeypatch.setattr(argument_checks, "is_importable", lambda package: True)
    extra = [] if impl is None else ["--cross-entropy-fusion-impl", impl]
    args = validate("gpt", *GPT, "--cross-entropy-loss-fusion", *extra)
    config = transformer_config_from_args(args)
    assert config.cross_entropy_loss_fusion
    assert config.cross_entropy_fusion_impl == (impl or "native")  # Megatron's default


def test_cross_entropy_is_unfused_by_default():
    from megatron.packed_training.config import transformer_config_from_args

    assert not transformer_config_from_args(validate("gpt", *GPT)).cross_entropy_loss_fusion


def test_cross_entropy_fusion_impl_without_the_fusion_is_refused():
    with pytest.raises(ValueError, match="--cross-entropy-fusion-impl is wrong: te. It picks the "
                                         "fused cross entropy's kernels: add "
                                         "--cross-entropy-loss-fusion"):
        validate("gpt", *GPT, "--cross-entropy-fusion-impl", "te")


def test_te_cross_entropy_needs_transformer_engine(monkeypatch):
    from megatron.packed_training import argument_checks

    monkeypatch.setattr(argument_checks, "is_importable", lambda package: False)
    with pytest.raises(ValueError, match="--cross-entropy-fusion-impl is wrong: te. It needs "
                                         "transformer_engine"):
        validate("hybrid", *HYBRID, "--hybrid-override-pattern", "M-M*", "--train-iters", "10",
                 "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te")


def test_an_unknown_cross_entropy_impl_is_refused_with_the_choices():
    with pytest.raises(SystemExit):
        validate("gpt", *GPT, "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "apex")


# --- --wandb-project -----------------------------------------------------------------------------

def test_wandb_flags_reach_the_run_settings(tmp_path):
    from megatron.packed_training.metrics import wandb_run_settings

    args = validate("gpt", *GPT, "--wandb-project", "sft", "--wandb-exp-name", "run-1",
                    "--wandb-save-dir", tmp_path / "wb")
    settings = wandb_run_settings(args)
    assert (settings["project"], settings["name"], settings["dir"]) == ("sft", "run-1",
                                                                        str(tmp_path / "wb"))
    assert settings["config"]["wandb_project"] == "sft"
    assert wandb_run_settings(validate("gpt", *GPT, "--wandb-project", "")) is None  # Megatron: off


def test_a_wandb_project_needs_a_run_name():
    with pytest.raises(ValueError, match="--wandb-project is wrong: sft. A W&B run needs a name: "
                                         "add --wandb-exp-name NAME"):
        validate("gpt", *GPT, "--wandb-project", "sft")


@pytest.mark.parametrize("flag", ["--wandb-exp-name", "--wandb-save-dir"])
def test_wandb_settings_without_a_project_are_refused(flag):
    with pytest.raises(ValueError, match=f"{flag} is wrong: x. It applies to W&B logging, which "
                                         f"is off without --wandb-project"):
        validate("gpt", *GPT, flag, "x")


def test_wandb_logging_needs_wandb(monkeypatch):
    from megatron.packed_training import argument_checks

    monkeypatch.setattr(argument_checks, "is_importable", lambda package: package != "wandb")
    with pytest.raises(ValueError, match=r"--wandb-project is wrong: sft. It needs wandb, which "
                                         r"is not importable: install wandb \(`pip install "
                                         r"\.\[wandb\]`\)"):
        validate("gpt", *GPT, "--wandb-project", "sft", "--wandb-exp-name", "run-1")


# --- --no-save-optim, --no-save-rng ---------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--no-save-optim", "--no-save-rng"])
def test_checkpoint_contents_need_a_checkpoint(flag, tmp_path):
    assert getattr(validate("gpt", *GPT, flag, "--save", tmp_path), flag[2:].replace("-", "_"))
    with pytest.raises(ValueError, match=f"{flag} is wrong: True. It shapes the checkpoints of "
                                         f"--save <dir>: add --save"):
        validate("gpt", *GPT, flag)


@pytest.mark.parametrize("content, load_optim, load_rng, message", [
    ({"optimizer": False, "rng": True}, True, True,
     "holds no optimizer and scheduler state \\(saved with --no-save-optim\\). Add "
     "--no-load-optim to load it without them, or --finetune"),
    ({"optimizer": True, "rng": False}, True, True,
     "holds no RNG states \\(saved with --no-save-rng\\). Add --no-load-rng"),
    ({"optimizer": False, "rng": False}, False, True, "holds no RNG states"),
])
def test_loading_what_a_checkpoint_left_out_names_the_flag(content, load_optim, load_rng,
                                                           message):
    from megatron.packed_training.checkpointing import check_checkpoint_content

    with pytest.raises(ValueError, match="--load is wrong: ckpt/iter_0000004 " + message):
        check_checkpoint_content("ckpt/iter_0000004", content, load_optim, load_rng)


@pytest.mark.parametrize("content, load_optim, load_rng", [
    (None, True, True),  # written before content metadata: it holds everything
    ({"optimizer": True, "rng": True}, True, True),
    ({"optimizer": False, "rng": False}, False, False),  # --no-load-optim --no-load-rng
])
def test_a_checkpoint_with_what_is_asked_for_loads(content, load_optim, load_rng):
    from megatron.packed_training.checkpointing import check_checkpoint_content

    check_checkpoint_content("ckpt/iter_0000004", content, load_optim, load_rng)


# --- TensorBoard extras --------------------------------------------------------------------------

def test_tensorboard_queue_size_needs_tensorboard(tmp_path):
    args = validate("gpt", *GPT, "--tensorboard-dir", tmp_path, "--tensorboard-queue-size", "5",
                    "--log-validation-ppl-to-tensorboard")
    assert args.tensorboard_queue_size == 5 and args.log_validation_ppl_to_tensorboard
    with pytest.raises(ValueError, match="--tensorboard-queue-size is wrong: 5. It sizes the "
                                         "TensorBoard writer's queue: add --tensorboard-dir"):
        validate("gpt", *GPT, "--tensorboard-queue-size", "5")
    with pytest.raises(ValueError, match="--tensorboard-queue-size is wrong: 0"):
        validate("gpt", *GPT, "--tensorboard-dir", tmp_path, "--tensorboard-queue-size", "0")


def test_a_refused_list_flag_is_refused_whole_not_unrecognized():
    """Megatron's list flags take several values; all of them reach the refusal."""
    with pytest.raises(ValueError, match="--recompute-modules is wrong: core_attn mlp. "
                                         "Activation recomputation is not supported here"):
        validate("gpt", *GPT, "--recompute-modules", "core_attn", "mlp")
