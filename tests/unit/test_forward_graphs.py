"""Forward-only graphs on CPU: the plan of a forward-only pass (graph key or eager reason, per
micro-batch), which runs may use them, and the runtime capturing and replaying them around a
real GPT, with a CUDA graph's stand-in that re-runs the captured call on replay
(conftest.replaying_capture). The CUDA captures themselves: tests/gpu/test_evaluation_graphs.py.
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.packed_graphs.dispatch import plan_chunks, plan_iteration
from megatron.packed_graphs.forward_graphs import ForwardGraphs, eval_mode, tensor_bytes
from megatron.packed_graphs.full_iteration import StaticMicroBatches
from megatron.packed_graphs.plan import (
    Granularity,
    GraphKey,
    GraphRuntimeConfig,
    Mode,
    Reason,
    StepGraphPlan,
)
from megatron.packed_graphs.runtime import GraphRuntime, forward_graphs_unavailable
from megatron.packed_graphs.schedule import GraphRuntimeSchedule
from megatron.packed_graphs.settings import GraphSettings, MoEGraphSettings
from megatron.packed_graphs.specs import gpt_layer_spec
from megatron.packed_training.datasets.mock import MockPackedDataset
from megatron.packed_training.datasets.packing import collate_packed_rows
from megatron.packed_training.packed_step import PackedForwardStep
from tests.unit.conftest import replaying_capture

FORWARD = GraphRuntimeConfig(impl="local", capacity=16, ladder=(4, 8), warmup_iterations=2,
                             forward_graphs=True)
TOKENS, VOCAB, HIDDEN = 64, 128, 32


def forward_plans(config, counts, captured=(), cp_sizes=None, **kwargs):
    return plan_iteration(config, 0, (), counts, cp_sizes, training=False,
                          forward_captured=captured, **kwargs)


# -- the plan ----------------------------------------------------------------------------------

def test_without_forward_graphs_a_forward_only_pass_is_eager_for_its_reason():
    plans = forward_plans(replace(FORWARD, forward_graphs=False), [3, 5])
    assert [plan.reason for plan in plans] == [Reason.EVAL, Reason.EVAL]
    assert {plan.reason for plan in forward_plans(GraphRuntimeConfig(), [3])} == {Reason.DISABLED}
    assert {plan.reason for plan in forward_plans(FORWARD, [3], graphs_off=True)} == {
        Reason.DISABLED}
    assert {plan.reason for plan in forward_plans(FORWARD, [3], forced=True)} == {Reason.FORCED}


def test_each_micro_batch_takes_the_smallest_forward_bank_that_fits_or_overflows():
    plans = forward_plans(FORWARD, [3, 5, 9, 16, 17])
    assert [plan.key.capacity if plan.key else plan.reason for plan in plans] == [
        4, 8, 16, 16, Reason.OVERFLOW]
    assert all(plan.key.forward_only and plan.key.granularity is Granularity.CHUNK
               for plan in plans[:4])
    assert {plan.mode for plan in plans[:4]} == {Mode.CAPTURE}  # nothing captured yet
    replayed = forward_plans(FORWARD, [3, 9], captured={(1, 4), (1, 8), (1, 16)})
    assert [plan.mode for plan in replayed] == [Mode.REPLAY, Mode.REPLAY]
    assert plans[4].is_fallback  # counted as a fallback, as in training


def test_no_warm_up_iterations_hold_forward_graphs_back():
    """A forward-only pass before any training iteration (reference log-probs) is graphed."""
    assert forward_plans(FORWARD, [3])[0].uses_graphs


def test_dynamic_cp_has_one_forward_bank_per_cp_size():
    config = GraphRuntimeConfig(impl="transformer_engine", granularity=Granularity.CP_BANK,
                                bank_capacities=((1, 4), (2, 8)), forward_graphs=True)
    assert config.forward_banks == ((1, 4), (2, 8))
    plans = forward_plans(config, [3, 6, 9, 5], cp_sizes=[1, 2, 2, 1])
    assert [(p.key.cp_size, p.key.capacity) if p.key else p.reason for p in plans] == [
        (1, 4), (2, 8), Reason.OVERFLOW, Reason.OVERFLOW]


def test_forward_banks_are_the_ladder_at_the_static_cp_size():
    assert replace(FORWARD, cp_size=2).forward_banks == ((2, 4), (2, 8), (2, 16))


def test_forward_keys_hold_a_whole_chunk_and_get_no_chunk_slot():
    with pytest.raises(ValueError, match="forward-only graph key is wrong"):
        GraphKey(Granularity.LAYER, 8, forward_only=True)
    chunked = replace(FORWARD, granularity=Granularity.CHUNK, ladder=(), slots_per_chunk=(2,))
    plans = plan_chunks(chunked, forward_plans(chunked, [3, 4, 5]), 1)[0]
    assert [plan.key for plan in plans] == [GraphKey.forward(16)] * 3
    training = StepGraphPlan.graphed(Mode.REPLAY, GraphKey(Granularity.CHUNK, 16))
    assert plan_chunks(chunked, [training] * 3, 1)[0][2].key.slot == 0  # 2 mod 2 slots


def test_forward_graphs_need_a_graph_implementation():
    with pytest.raises(ValueError, match="forward graphs with --cuda-graph-impl none"):
        GraphRuntimeConfig(forward_graphs=True)


DROP_AND_PAD = MoEGraphSettings(expert_capacity_factor=1.0, pad_expert_input_to_capacity=True)


@pytest.mark.parametrize("changes, why", [
    ({}, None),
    ({"impl": "none"}, "--cuda-graph-impl none"),
    ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
    ({"overlap_param_gather": True}, "--overlap-param-gather"),
    ({"moe": MoEGraphSettings()}, "MoE without drop-and-pad"),
    ({"moe": MoEGraphSettings(expert_capacity_factor=1.0)}, "MoE without drop-and-pad"),
    ({"moe": DROP_AND_PAD}, None),
    ({"moe": MoEGraphSettings(dropless_graphs=True)}, None),
    ({"moe": replace(DROP_AND_PAD, capacity_overflow="rerun")}, "--moe-capacity-overflow rerun"),
])
def test_which_runs_replay_forward_only_graphs(changes, why):
    reason = forward_graphs_unavailable(replace(GraphSettings(impl="local", capacity=8),
                                                **changes))
    assert reason == why if why is None else reason.startswith(why)


def test_the_command_line_turns_forward_graphs_on_and_says_so(cpu_dist, monkeypatch):
    from megatron.packed_training import extra_args
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import graph_settings_from_args

    def runtime_of(argv):
        return GraphRuntime.from_settings(graph_settings_from_args(parse_args(argv, "gpt")), [],
                                          None)

    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size",
            "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4",
            "--mock-data", "--sft", "--vocab-size", "256", "--eval-iters", "0",
            "--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "16",
            "--cuda-graph-capacity-ladder", "4"]
    runtime = runtime_of(argv)
    assert runtime.config.forward_graphs and runtime.config.forward_banks == ((1, 4), (1, 16))
    assert "forward-only passes (evaluation, log-probs): forward-only graphs at 4, 16" in \
        runtime.describe()
    off = runtime_of(argv + [
        "--overlap-param-gather", "--overlap-grad-reduce", "--use-distributed-optimizer"])
    assert not off.config.forward_graphs
    assert "forward-only passes run eager: --overlap-param-gather" in off.describe()


# -- static inputs with per-token tensors -----------------------------------------------------

def test_static_inputs_take_dicts_of_tensors_with_the_captured_names():
    from megatron.packed_training.rl.steps import PolicyMicroBatch

    def staged(value, names=("advantages",)):
        return PolicyMicroBatch(
            tokens=torch.zeros(1, 4, dtype=torch.long), labels=None, loss_mask=None,
            position_ids=None, params=None, num_segments=1, num_documents=1,
            inv_temperature=torch.ones(1),
            loss_tensors={name: torch.full((1, 4), value) for name in names})

    inputs = StaticMicroBatches()
    static = inputs.fill([staged(1.0)])[0]
    address = static.loss_tensors["advantages"].data_ptr()
    again = inputs.fill([staged(2.0)])[0]
    assert again.loss_tensors["advantages"].data_ptr() == address
    assert again.loss_tensors["advantages"].eq(2.0).all()
    with pytest.raises(ValueError, match=r"loss_tensors is wrong: \['kl'\], captured with "
                                         r"\['advantages'\]"):
        inputs.fill([staged(1.0, ("kl",))])
    assert tensor_bytes(static) == 4 * 8 + 4 + 4 * 4  # tokens, 1 / temperature, advantages


# -- the runtime around a real GPT -------------------------------------------------------------

class CPUStep(PackedForwardStep):
    """The evaluation forward step of the command line, staged on the CPU."""

    def __init__(self, **kwargs):
        super().__init__(with_seq_idx=False, static_max_seqlen=True,
                         device=torch.device("cpu"), **kwargs)


def build_gpt(seed=0):
    """A small GPT with hidden dropout 0.1: a forward-only pass must run it in eval mode."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_dropout_fusion=False, hidden_dropout=0.1,
        attention_dropout=0.0)
    return GPTModel(config=config, transformer_layer_spec=gpt_layer_spec("torch"),
                    vocab_size=VOCAB, max_sequence_length=TOKENS, position_embedding_type="none")


@pytest.fixture(autouse=True)
def no_rng_tracker(monkeypatch):
    # megatron-core's CUDA RNG tracker needs CUDA; the stand-in capture registers nothing.
    from megatron.packed_graphs import runtime

    monkeypatch.setattr(runtime, "_rng_states", dict)


def micro_batches(first, count):
    data = MockPackedDataset(64, TOKENS, VOCAB, seed=7, doc_length_median=12)
    return [collate_packed_rows([data[first + i]]) for i in range(count)]


def forward_only_schedule(*, forward_step_func, data_iterator, model, num_microbatches,
                          forward_only, **kwargs):
    """megatron-core's forward-only schedule at PP = 1: forward step, then its loss function
    at once (before the next micro-batch), reports collected."""
    assert forward_only
    reports = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, model[0])
        reports.append(loss_func(output)[2])
    return reports


def evaluation(capacity=8, ladder=()):
    model = build_gpt()
    config = GraphRuntimeConfig(impl="local", capacity=capacity, ladder=ladder,
                                forward_graphs=True)
    runtime = GraphRuntime(config, [model])
    runtime.forward_capture = replaying_capture
    seam = GraphRuntimeSchedule(runtime, forward_only_schedule, stream_length=TOKENS)
    reported = []
    seam.listeners.append(lambda split, stats, losses: reported.append((split, stats)))
    return model, runtime, seam, reported


def evaluate(seam, model, batches, step):
    with torch.no_grad():
        reports = seam(forward_step_func=step, data_iterator=iter(batches), model=[model],
                       num_microbatches=len(batches), forward_only=True)
    return [report["lm loss"].clone() for report in reports]


def test_evaluation_replays_forward_graphs_equal_to_eager_with_overflow_counted(cpu_dist):
    model, runtime, seam, reported = evaluation(capacity=6, ladder=(4,))
    step = CPUStep()
    batches = micro_batches(0, 6)
    counts = [batch["num_segments"] for batch in batches]
    assert counts == [8, 6, 5, 3, 4, 7]  # capacity 4: 2, capacity 6: 2, overflow: 2
    graphed = evaluate(seam, model, batches, step)
    split, stats = reported[-1]
    fitting = 4
    assert split == "valid" and stats["forward graphs"] == fitting
    assert stats["eager overflow"] == len(batches) - fitting and "eager eval" not in stats
    assert stats["forward graphs captured"] == 2  # every bank: capacities 4 and 6
    assert model.training  # eval mode for the pass only
    with runtime.forced_eager():
        eager = evaluate(seam, model, batches, step)
    assert reported[-1][1] == {"forward graphs": 0, "eager forced": len(batches)}
    for got, want in zip(graphed, eager):  # dropout is off in both: eval mode
        assert torch.equal(got, want)
    assert runtime.iterations == 0  # no training iteration counted

    again = evaluate(seam, model, batches, step)
    assert "forward graphs captured" not in reported[-1][1]  # captured once
    assert all(torch.equal(a, b) for a, b in zip(again, graphed))
    bank = runtime.forward_graphs[0]
    assert sum(graph.graph.replays for graph in bank.graphs.values()) == 2 * fitting


@pytest.fixture
def calculator():
    from megatron.core import num_microbatches_calculator as calc

    calc.init_num_microbatches_calculator(0, None, 4, 1, 1)
    yield
    calc.destroy_num_microbatches_calculator()


def test_megatron_lm_builds_its_schedule_once_per_evaluation_and_evaluates_after_training():
    """What `test_each_evaluation_of_megatron_lms_loop_is_one_record` plays: evaluate() asks
    for its schedule once per pass, and pretrain() evaluates again after train() returns,
    at the iteration of train()'s last evaluation when --eval-interval divides
    --train-iters."""
    import inspect

    import megatron.training.training as loop

    evaluate = inspect.getsource(loop.evaluate)
    assert evaluate.count("get_forward_backward_func(") == 1
    assert evaluate.index("get_forward_backward_func(") < evaluate.index("while iteration <")
    pretrain = inspect.getsource(loop.pretrain)
    assert pretrain.index("train(") < pretrain.index("evaluate_and_print_results(")
    assert "iteration % args.eval_interval == 0 and args.do_valid" in inspect.getsource(loop.train)


def test_each_evaluation_of_megatron_lms_loop_is_one_record(cpu_dist, calculator, tmp_path):
    """--train-iters 10 --eval-interval 5 --eval-iters 3, 4 micro-batches per evaluation
    iteration: passes at iterations 5 and 10 and the one after training, each its own record
    of 3 x 4 micro-batches, though no training iteration comes between the last two."""
    from argparse import Namespace

    from megatron.packed_training.metrics import RuntimeLog, read_metrics
    from megatron.packed_training.pretrain import PackedGraphRun

    model, runtime, _, _ = evaluation(capacity=6, ladder=(4,))
    args = Namespace(iteration=0, metrics_file=str(tmp_path / "m.jsonl"), log_interval=5,
                     train_iters=10, seq_length=TOKENS, micro_batch_size=1,
                     consumed_train_samples=0, num_experts=None, moe_expert_capacity_factor=None,
                     packed_profile=False, profile_step_start=10, profile_step_end=12,
                     profile_trace_dir=None, dynamic_cp_sizes=None, moe_router_load_file=None)
    run = PackedGraphRun(args)
    run.runtime, run.log = runtime, RuntimeLog(args, [model])
    run.settings = GraphSettings(micro_batch_size=1, seq_length=TOKENS)
    run.optimizer = SimpleNamespace(step=lambda: None)
    run.wrap(forward_only_schedule)  # train()'s; its iterations are logged below as they close
    step, data = CPUStep(), iter(micro_batches(0, 36))

    def evaluate():  # Megatron-LM's evaluate(): its own schedule, 3 iterations
        seam = run.wrap(forward_only_schedule)
        for _ in range(3):
            with torch.no_grad():
                seam(forward_step_func=step, data_iterator=data, model=[model],
                     num_microbatches=4, forward_only=True)

    for iteration in range(1, 11):
        run.log("train", {}, [{"lm loss": torch.tensor([2.0, 1.0])}])
        if iteration % 5 == 0:
            evaluate()
    evaluate()  # pretrain()'s, after train()
    run.finish()
    valid = read_metrics(args.metrics_file, split="valid")
    assert [r["iteration"] for r in valid] == [5, 10, 10]
    assert [r["forward graphs"] + r.get("eager overflow", 0) for r in valid] == [12, 12, 12]
    assert "forward graphs captured" in valid[0]
    assert not any("forward graphs captured" in r for r in valid[1:])


def test_the_forward_step_runs_on_its_own_as_megatron_lm_calls_it(cpu_dist):
    """``step(data_iterator, model)`` (Megatron-LM's contract, no runtime) is the runtime's eager
    micro-batch: the same losses as a forced-eager pass through the seam."""
    model, runtime, seam, _ = evaluation()
    step, batches = CPUStep(), micro_batches(0, 3)
    with runtime.forced_eager():
        through_runtime = evaluate(seam, model, batches, step)
    model.eval()
    data = iter(batches)
    with torch.no_grad():
        alone = [loss_func(output)[2]["lm loss"]
                 for output, loss_func in (step(data, model) for _ in batches)]
    assert all(torch.equal(a, b) for a, b in zip(alone, through_runtime))


def test_replays_read_the_weights_in_place(cpu_dist):
    model, runtime, seam, _ = evaluation()
    step, batches = CPUStep(), micro_batches(0, 2)
    before = evaluate(seam, model, batches, step)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    graphed = evaluate(seam, model, batches, step)
    with runtime.forced_eager():
        eager = evaluate(seam, model, batches, step)
    assert not torch.equal(graphed[0], before[0])
    assert all(torch.equal(a, b) for a, b in zip(graphed, eager))


def test_a_forward_graph_replays_only_the_model_it_was_captured_over(cpu_dist):
    model, runtime, seam, _ = evaluation()
    step = CPUStep()
    evaluate(seam, model, micro_batches(0, 1), step)
    with pytest.raises(RuntimeError, match="replays the model chunk it was captured over"):
        evaluate(seam, build_gpt(seed=1), micro_batches(0, 1), step)


def test_each_forward_step_has_its_own_forward_graphs(cpu_dist):
    model, runtime, seam, reported = evaluation()
    evaluate(seam, model, micro_batches(0, 1), CPUStep())
    evaluate(seam, model, micro_batches(0, 1), CPUStep())
    assert len(runtime.forward_graphs) == 2
    assert reported[-1][1]["forward graphs captured"] == 1


def test_eval_mode_restores_each_chunks_mode():
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).eval()]
    with eval_mode(chunks):
        assert not any(chunk.training for chunk in chunks)
    assert [chunk.training for chunk in chunks] == [True, False]


def test_a_missing_bank_names_what_was_captured():
    bank = ForwardGraphs(CPUStep(), pool=lambda: None, capture=replaying_capture)
    with pytest.raises(RuntimeError, match=r"no forward-only graph was captured for .*"
                                           r"capacity=8.*captured: \[\]"):
        bank.run(torch.nn.Linear(1, 1), GraphKey.forward(8), staged=None)


def test_every_rank_captures_at_its_first_pass_even_if_nothing_of_its_own_fits(cpu_dist):
    """Captures run the model's collectives: a rank whose micro-batches all overflow captures
    with the others all the same."""
    model, runtime, seam, reported = evaluation(capacity=2)
    evaluate(seam, model, micro_batches(0, 3), CPUStep())  # 8, 6 and 5 segments
    assert reported[-1][1] == {"forward graphs": 0, "eager overflow": 3,
                               "forward graph capture (s)": 0.0,
                               "forward graph memory (MiB)": reported[-1][1][
                                   "forward graph memory (MiB)"],
                               "forward graphs captured": 1}
    assert runtime.forward_graphs[0].captured == {(1, 2)}


def test_the_capture_layout_is_one_padding_segment_at_the_banks_capacity():
    layout = CPUStep().graph_layout(1, 8, like=micro_batches(0, 1)[0])
    assert layout.tokens.shape == (1, TOKENS) and not layout.loss_mask.any()
    assert layout.params.cu_seqlens_q.tolist() == [0] + [TOKENS] * 8
    assert layout.params.max_seqlen_q == TOKENS  # the static packed length, as replays
    with pytest.raises(ValueError, match="graph layout is wrong: no micro-batch"):
        CPUStep().graph_layout(1, 8)
