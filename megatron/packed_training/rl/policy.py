"""`PackedPolicy`: the graphed packed training step as a library, for a framework's own loop.

    policy = PackedPolicy.build(PolicyConfig("policy.yaml", model="hybrid"))
    reference = policy.snapshot_weights()                     # e.g. before any update
    with policy.swapped_weights(reference):
        ref_lp = policy.logprobs(rollouts)                    # forward-only graphs
    old_lp = policy.logprobs(rollouts)
    result = policy.train_step(micro_batches, loss_fn)        # training graphs + optimizer
    policy.load_weights(new_weights)                          # a refit, in place
    for name, tensor in policy.export_weights():              # Hugging Face names: an engine
        ...

Everything runs through the one graph runtime of the run (megatron/packed_graphs/runtime.py)
behind the seam (`GraphRuntimeSchedule`, megatron-core's forward-backward function with
the runtime in front), as Megatron-LM's loop does: each micro-batch gets a graph key or an
eager reason, counted (`TrainResult.stats`, `PackedPolicy.last_stats`). Training replays the
configured training graphs (layer, chunk, TE or full-iteration); log-prob passes replay
forward-only graphs, one per capacity, captured at the first pass. Any number of
micro-batches and documents per call: a micro-batch with more sequences than every captured
capacity runs eager (``eager overflow``).

Every rank calls `train_step` and `logprobs` together (they run the model's collectives),
each data-parallel rank with its own micro-batches (the ranks of one pipeline and of one
context parallel group with the same ones). Layout: tensor, data, expert, pipeline (with
virtual stages) and static context parallelism as configured; every rank gets the whole
result (rl/layouts.py). One policy per process: Megatron-LM keeps its arguments, timers and
parallel state in process globals.
"""

import argparse
import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    get_rerun_state_machine,
)

from megatron.packed_training.rl.batches import (
    PackedSequences,
    check_values,
    lay_out,
    lay_out_all,
)
from megatron.packed_training.rl.layouts import Layout, schedule_count, step_totals
from megatron.packed_training.rl.steps import (
    INV_TEMPERATURE,
    LOGPROBS,
    METRIC_NAMES,
    LogProbStep,
    LossFunction,
    PolicyLossStep,
)
from megatron.packed_training.rl.weights import (
    WeightStore,
    load_weights,
    swapped_weights,
)


@dataclass(frozen=True)
class PolicyConfig:
    """The library's one config.

    ``training``: the training config: a YAML path or a mapping keyed by the command line's
    dest names (docs/config-api.md, `load_training_config`), or arguments it already gave.
    ``model``: "gpt" or "hybrid". ``check_inputs``: run the input health check on every call
    (`batches.check_values`: one host read per call; token ids in the vocabulary, loss tensors
    finite). A config that does not set ``calculate_per_token_loss`` gets it on: RL's global
    token-level normalization (the count over every micro-batch and data-parallel rank).
    ``hf_config``: a folder holding the model's Hugging Face config.json, which names its
    family for `PackedPolicy.export_weights` (rl/export.py); unset, the converted checkpoint
    the training config starts from (``pretrained_checkpoint`` or ``load``, where
    tools/convert_hf.py import put config.json beside megatron_flags.txt), else none (the
    policy exports nothing). A family the converter does not map is refused at `build`.
    """

    training: Union[str, os.PathLike, Mapping, argparse.Namespace]
    model: str = "gpt"
    check_inputs: bool = True
    hf_config: Optional[Union[str, os.PathLike]] = None

    def args(self) -> argparse.Namespace:
        """The validated training arguments."""
        if self.model not in ("gpt", "hybrid"):
            raise ValueError(f"PolicyConfig.model is wrong: {self.model!r}. Use 'gpt' or "
                             f"'hybrid'.")
        if isinstance(self.training, argparse.Namespace):
            return self.training
        from megatron.packed_training.config import _read_mapping, load_training_config

        training = _read_mapping(self.training)
        training.setdefault("calculate_per_token_loss", True)
        return load_training_config(training, self.model)


def check_library_layout(args) -> None:
    """Raise for a parallel layout the library API does not run (module doc): dynamic
    context parallelism, and static CP whose packed row does not split into 2 x CP chunks."""
    if getattr(args, "dynamic_cp_sizes", None):
        raise ValueError(f"dynamic_cp_sizes is wrong for the library API: "
                         f"{args.dynamic_cp_sizes}. Leave it unset; a static "
                         f"context_parallel_size runs.")
    cp = args.context_parallel_size
    if cp > 1 and (row := args.micro_batch_size * args.seq_length) % (2 * cp):
        raise ValueError(f"context_parallel_size is wrong for the library API: {cp} with a "
                         f"packed row of {row} positions (micro_batch_size x seq_length), not "
                         f"a multiple of 2 x {cp}. Set seq_length to a multiple of {2 * cp}.")


@dataclass
class TrainResult:
    """One `PackedPolicy.train_step`.

    ``loss``: 0-dim device tensor, the loss summed over the micro-batches of every
    data-parallel (and context parallel) rank divided by their count (tokens, or sequences
    under ``normalization="sequence"``); ``num_tokens``: that count (device). ``metrics``: the
    loss function's metrics by name, reduced the same way (device tensors). The same on
    every rank, pipeline stages included (broadcast from the last). ``grad_norm``: the
    optimizer's (a device tensor, a float, or None); ``update_successful``: False when the
    optimizer skipped the step (fp16 overflow). ``stats``: the graph runtime's counters of
    the iteration (``eager <reason>``, ``graph fallbacks``, capture time and memory). Reading
    a device value waits for the step.
    """

    loss: Tensor
    num_tokens: Tensor
    grad_norm: object
    update_successful: bool
    stats: dict
    metrics: Dict[str, Tensor] = field(default_factory=dict)


class PackedPolicy:
    """A packed policy on the graph runtime (module doc). Build it with `build`; the
    constructor takes the parts (model chunks, optimizer, runtime, seam), as tests do.

    ``schedule``: the `GraphRuntimeSchedule` over megatron-core's forward-backward function
    for ``runtime``; ``step_options``: the forward steps' settings (`LogProbStep` keywords);
    ``row_positions``: positions of a packed row, micro_batch_size x seq_length;
    ``segment_multiple``: what each sequence's positions are padded to a multiple of in a
    row (2 x the context parallel size; 1 without CP): pass it to `pack_sequences`;
    ``lr_increment``: samples the learning-rate schedule advances per step (Megatron-LM's:
    the global batch size). ``hf_config``: the model's Hugging Face family for
    `export_weights` (anything `export.hf_mapping` takes: a config.json folder, a family's
    ``Converted``), or None.
    """

    def __init__(self, model: Sequence[torch.nn.Module], optimizer, runtime, schedule, *,
                 row_positions: int, vocab_size: int, step_options: dict,
                 scheduler=None, lr_increment: int = 1, check_inputs: bool = True,
                 hf_config=None):
        self.model = list(model)
        self.hf_mapping = None if hf_config is None else export_module().hf_mapping(hf_config)
        self.optimizer, self.scheduler, self.runtime = optimizer, scheduler, runtime
        self.schedule = schedule
        self.row_positions, self.vocab_size = row_positions, vocab_size
        self.lr_increment, self.check_inputs = lr_increment, check_inputs
        self._step_options = dict(step_options)
        self._logprob_step = LogProbStep(**self._step_options)
        self._loss_steps: Dict[tuple, PolicyLossStep] = {}  # by (loss_fn, normalization)
        self._metric_names: Dict[PolicyLossStep, List[str]] = {}  # PP: known on every stage
        cp_size = self._step_options.get("cp_size", 1)
        self.segment_multiple = 2 * cp_size if cp_size > 1 else 1
        self.last_stats: dict = {}  # the graph runtime's counters of the latest call
        schedule.listeners.append(self._record)

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def build(cls, config: PolicyConfig) -> "PackedPolicy":
        """Megatron-LM's start-up, model, optimizer and learning-rate schedule, and the graph
        runtime, from ``config`` (a checkpoint is loaded where the config names one).
        Needs a CUDA device; under torchrun each rank builds its part."""
        args = config.args()
        check_library_layout(args)
        family = hf_family(config, args)  # before any GPU work: a family it cannot export
        if not torch.cuda.is_available():
            raise RuntimeError("PackedPolicy.build needs a CUDA device (megatron-core's DDP, "
                               "optimizer and graphs are CUDA-only); none is visible.")
        # A plain `python script.py` is a world of one, as under torchrun with one process.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        from megatron.core.enums import ModelType
        from megatron.training import training
        from megatron.training.global_vars import set_global_variables
        from megatron.training.initialize import initialize_megatron

        from megatron.packed_upstream.patches import apply_core_patches
        from megatron.packed_upstream.training_loop import route_training_loop
        from megatron.packed_training.initialize import require_mamba_kernels
        from megatron.packed_training.models import MODEL_BUILDERS
        from megatron.packed_training.pretrain import PackedGraphRun, model_provider

        if config.model == "hybrid":
            require_mamba_kernels()
        try:
            set_global_variables(args)
        except AssertionError:
            raise RuntimeError("PackedPolicy.build runs once per process: Megatron-LM's "
                               "arguments, timers and parallel state are process globals, set "
                               "already. Build one policy and swap weights into it "
                               "(swapped_weights, load_weights).") from None
        apply_core_patches()
        run = PackedGraphRun(args, log=False)
        route_training_loop(run, capturable_optimizer=args.packed_optimizer_graph)
        initialize_megatron()
        model, optimizer, scheduler = training.setup_model_and_optimizer(
            ModelType.encoder_or_decoder, partial(model_provider, MODEL_BUILDERS[config.model]))
        prepare_training_loop(args, model, optimizer)
        seam = training.get_forward_backward_func()  # megatron-core's, behind the runtime
        return cls(model, optimizer, run.runtime, seam,
                   row_positions=args.micro_batch_size * args.seq_length,
                   vocab_size=args.padded_vocab_size, scheduler=scheduler,
                   lr_increment=args.global_batch_size, check_inputs=config.check_inputs,
                   step_options=step_options(args, config.model), hf_config=family)

    # -- calls ---------------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[PackedSequences], loss_fn: LossFunction, *,
                   temperature: float = 1.0, normalization: str = "token") -> TrainResult:
        """One optimizer step over ``micro_batches`` with the loss ``loss_fn`` (`LossInputs`
        -> the micro-batch's loss summed over positions, or over sequences of their means
        with ``normalization="sequence"``, optionally with metrics; `PolicyLossStep`,
        rl/losses.py).

        Gradients are zeroed, the micro-batches run through megatron-core's schedule under
        their graph plans (forward, ``loss_fn``, backward; the data-parallel reduction), then
        the optimizer and learning-rate schedule step. The log-probs ``loss_fn`` sees are at
        ``temperature`` (a graph input: every temperature replays the same graphs).
        Raises ValueError on bad input before anything runs (batches.py); RuntimeError,
        before the optimizer steps, where megatron-core's rerun state machine rejects a
        result of the step and asks to end the process (`_forward_backward`)."""
        batches = self._prepare(micro_batches, temperature)
        step = self._loss_step(loss_fn, normalization)
        losses = self._forward_backward(step, batches)
        # Reduced now: under a full-iteration graph the reports are graph-owned. One
        # collective over the data x context parallel ranks, and at PP > 1 a broadcast from
        # the last stage; nothing is read back to the host (layouts.step_totals).
        total, names = step_totals(losses, self._layout(), self._metric_names.get(step),
                                   METRIC_NAMES)
        self._metric_names[step] = names
        count = total[1].clamp(min=1)
        metrics = {name: total[2 + k] / count for k, name in enumerate(names)}
        stepped = self.optimizer.step()
        self.schedule.close_iteration()  # a no-op where the step closed it (pretrain.py wraps it)
        if self.scheduler is not None:
            self.scheduler.step(increment=self.lr_increment)
        update_successful, grad_norm = True, None
        if isinstance(stepped, tuple):  # megatron-core: (update_successful, grad_norm, zeros)
            update_successful, grad_norm = bool(stepped[0]), stepped[1]
        return TrainResult(loss=total[0] / count, num_tokens=total[1],
                           grad_norm=grad_norm, update_successful=update_successful,
                           stats=dict(self.last_stats), metrics=metrics)

    def logprobs(self, micro_batches: Sequence[PackedSequences], *, temperature: float = 1.0,
                 eager: bool = False) -> List[Tensor]:
        """Per-token log-probs of the given tokens, forward only: one float32 ``[N]`` device
        tensor per micro-batch, token aligned (value ``t``: log p(token t | the tokens before
        it in its sequence) under ``softmax(logits / temperature)``; 0 at each sequence's first
        token). The model runs in eval mode (no dropout) on forward-only graphs; ``eager``:
        every micro-batch eager (``eager forced``), a reference to compare graphs with.
        ``loss_weights`` and ``tensors`` of the micro-batches are not used (checked only)."""
        batches = self._prepare(micro_batches, temperature)
        forced = self.runtime.forced_eager() if eager else nullcontext()
        with torch.no_grad(), forced:
            reports = self.schedule(forward_step_func=self._logprob_step,
                                    data_iterator=self._data(batches), model=self.model,
                                    num_microbatches=len(batches), forward_only=True)
        # Whole rows on every rank: from the last pipeline stage, the CP shares gathered.
        rows = self._layout().rows([report[LOGPROBS] for report in reports], batches,
                                   self.row_positions)
        return [batch["layout"].to_tokens(row)
                for batch, row in zip(batches[:len(micro_batches)], rows)]

    # -- weights -------------------------------------------------------------------------------

    def snapshot_weights(self, device: Optional[torch.device] = None) -> WeightStore:
        """A copy of the policy's weights (e.g. the reference policy), on ``device`` (default:
        where they are; the host costs no GPU memory, a swap then copies over PCIe)."""
        return WeightStore.snapshot(self.model, device)

    def swapped_weights(self, store: WeightStore):
        """Context manager: the model holds ``store``'s weights within the scope (graphs
        replay with them), its own again after. For the reference policy's log-probs."""
        return swapped_weights(self.model, store)

    def load_weights(self, source: Union[WeightStore, Mapping[str, Tensor]]) -> None:
        """A refit: copy ``source`` (a `WeightStore` or ``{name: tensor}`` by
        `weights.policy_weights` names) into the model in place, and the optimizer's main
        parameters from them. Optimizer moments are kept."""
        load_weights(self.model, source)
        reload = getattr(self.optimizer, "reload_model_params", None)  # megatron-core's
        if reload is not None:
            reload()

    def export_weights(self, bucket_bytes: Optional[int] = None):
        """The live weights under Hugging Face names, in the Hugging Face layout of the
        policy's family, for an inference engine's refit: ``(name, tensor)`` pairs, or with
        ``bucket_bytes`` lists of them of about that many bytes (`export.export_weights`,
        docs/rl.md "Weights for an inference engine"). Whole tensors (tensor, expert and
        pipeline parallel parts gathered on the fly), on the GPU, one (or one bucket) at a
        time; every rank yields every pair and must iterate to the end (collectives).
        A tensor may be the live parameter itself: use it before the next `train_step`.
        Raises ValueError where the policy has no family (`PolicyConfig.hf_config`)."""
        if self.hf_mapping is None:
            raise ValueError("export_weights has no Hugging Face family to map the policy to: "
                             "build it with PolicyConfig(hf_config=FOLDER), FOLDER holding the "
                             "model's config.json (tools/convert_hf.py import writes one), or "
                             "from a converted checkpoint (pretrained_checkpoint or load).")
        finish_param_gather(self.model)
        return export_module().export_weights(self.model, self.hf_mapping,
                                              bucket_bytes=bucket_bytes)

    # -- internals -----------------------------------------------------------------------------

    def _prepare(self, micro_batches: Sequence[PackedSequences], temperature: float) -> list:
        if not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature is wrong: {temperature!r}. Use a positive number "
                             f"(1.0: the model's own distribution).")
        batches = lay_out_all(micro_batches, self.row_positions, self.segment_multiple)
        batches += self._schedule_padding(micro_batches)
        for batch in batches:
            batch[INV_TEMPERATURE] = 1.0 / temperature
        if self.check_inputs:
            check_values(batches, self.vocab_size)
        return batches

    def _forward_backward(self, step: PolicyLossStep, batches: list) -> list:
        """The step's forward and backward passes from zeroed gradients (the schedule's
        losses_reduced), inside megatron-core's rerun state machine as Megatron-LM's
        train_step runs them: DDP validates the gradients in it (``check_for_nan_in_grad``),
        which the machine refuses outside its loop unless its mode is ``disabled``. A rejected
        result reruns the passes in place on the same micro-batches; where the machine then
        asks to end the process (`rerun_stop`), raises RuntimeError. Forward-only passes
        (`logprobs`) validate nothing: no gradients."""
        machine = get_rerun_state_machine()
        losses = None
        # No data iterator for the machine to rewind: a rerun reads the list again.
        try:
            while machine.should_run_forward_backward(None):
                self._zero_grads()
                losses = self.schedule(forward_step_func=step, data_iterator=self._data(batches),
                                       model=self.model, num_microbatches=len(batches),
                                       forward_only=False)
        except BaseException:
            # A loss function that raised (bad output) must not leave the machine mid-run
            # (the next step would find its run over and run nothing) nor the iteration open.
            machine.should_run_forward_backward(None)
            self.schedule.close_iteration()
            raise
        stop = rerun_stop(machine)
        if stop is not None:
            self.schedule.close_iteration()  # no optimizer step will close it
            raise RuntimeError(stop)
        return losses

    def _schedule_padding(self, micro_batches: Sequence[PackedSequences]) -> list:
        """Empty micro-batches (laid out) that complete the call's count for megatron-core's
        interleaved schedule (virtual stages run micro-batches in groups); none without
        virtual stages. They weigh nothing; their log-probs are dropped."""
        layout = self._layout()
        count = len(micro_batches)
        padding = schedule_count(count, layout.pipeline_size, layout.chunks, layout.group_size)
        first = micro_batches[0]
        empty = PackedSequences.empty(sorted(first.tensors), first.tokens.device)
        return [lay_out(empty, count + k, self.row_positions, sorted(first.tensors),
                        self.segment_multiple) for k in range(padding - count)]

    def _layout(self) -> Layout:
        return Layout.current(self.model, self._step_options.get("device") or torch.device(
            "cuda", torch.cuda.current_device()))

    def _data(self, batches: list):
        """The schedule's data iterator: one per model chunk with virtual pipeline stages."""
        return [iter(batches) for _ in self.model] if len(self.model) > 1 else iter(batches)

    def _zero_grads(self) -> None:
        for chunk in self.model:
            if hasattr(chunk, "zero_grad_buffer"):  # megatron-core's DDP
                chunk.zero_grad_buffer()
            else:  # a bare module (tests, tools)
                chunk.zero_grad(set_to_none=True)
        self.optimizer.zero_grad()

    def _loss_step(self, loss_fn: LossFunction, normalization: str = "token") -> PolicyLossStep:
        if not callable(loss_fn):
            raise ValueError(f"loss_fn is wrong: a {type(loss_fn).__name__}. Pass a function "
                             f"of LossInputs (megatron.packed_training.rl.losses).")
        step = self._loss_steps.get((loss_fn, normalization))
        if step is not None:
            return step
        if self._loss_steps and self.runtime.config.full_iteration:
            raise ValueError("loss_fn is wrong: another function (or normalization) than the "
                             "earlier steps'. A full-iteration graph runs the loss it was "
                             "captured with; bind the loss's settings once "
                             "(functools.partial) and pass the same object every step.")
        step = PolicyLossStep(loss_fn, normalization, **self._step_options)
        self._loss_steps[(loss_fn, normalization)] = step
        return step

    def _record(self, split: str, stats: dict, losses) -> None:
        self.last_stats = dict(stats)


# Why megatron-core's rerun state machine asks to end the process, by its exit code.
RERUN_EXITS = {
    EXIT_CODE_RESUME_TO_DISAMBIGUATE: (
        "the result reproduced on this GPU; Megatron-LM saves a checkpoint and exits so that "
        "the step reruns from it on another GPU, to tell a faulty GPU from a real NaN"),
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION: (
        "the rerun did not reproduce the result: a possible transient hardware fault"),
}


def rerun_stop(machine) -> Optional[str]:
    """After a step's forward-backward loop, where megatron-core's rerun state machine asks
    to end the process (``should_checkpoint_and_exit``, which Megatron-LM's train_step asks
    before its optimizer step): the error message, else None. The library cannot checkpoint
    or exit for its caller: the message says why and with which exit code Megatron-LM
    exits."""
    _, should_exit, exit_code = machine.should_checkpoint_and_exit()
    if not should_exit:
        return None
    why = RERUN_EXITS.get(exit_code, "its log says why")
    return (f"train_step stopped before the optimizer step: megatron-core's rerun state "
            f"machine rejected a result of the step (e.g. a NaN gradient; its log names it) "
            f"and asks to end the process with exit code {exit_code} ({why}). The weights are "
            f"the previous step's. End the process and resume from your last checkpoint; "
            f"rerun_mode disabled in the training config raises at the first rejected result "
            f"instead.")


def export_module():
    """rl/export.py, which reads the converter's tables (its [hf] extra: safetensors)."""
    try:
        from megatron.packed_training.rl import export
    except ImportError as err:
        if err.name != "safetensors":
            raise
        raise ImportError("export_weights and PolicyConfig.hf_config read the converter's "
                          "tables, which need the safetensors package: pip install -e "
                          "\".[hf]\"") from None
    return export


def hf_family(config: PolicyConfig, args):
    """The policy's Hugging Face family (`export.policy_family`; a ValueError for one the
    converter does not map), or None; None also without the converter's package, unless
    ``hf_config`` asks for a family."""
    try:
        export = export_module()
    except ImportError:
        if config.hf_config is not None:
            raise
        return None
    return export.policy_family(config.hf_config, args, config.model)


def finish_param_gather(model: Sequence[torch.nn.Module]) -> None:
    """With ``--overlap-param-gather`` the distributed optimizer's updated parameters reach
    the model in the next forward pass: gather them now, synchronously, as Megatron-LM does
    before it saves a checkpoint (its ``disable_forward_pre_hook``). A no-op otherwise."""
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and getattr(ddp_config, "overlap_param_gather", False):
            chunk.start_param_sync(force_sync=True)


def prepare_training_loop(args, model: Sequence[torch.nn.Module], optimizer) -> None:
    """What Megatron-LM's ``train()`` sets in the model's config before its first iteration,
    set the same way here (the library runs its own loop): the optimizer's loss scaling;
    with ``--overlap-grad-reduce`` DDP's no-sync hook (and grad-sync with
    ``--align-grad-reduce``), with ``--overlap-param-gather --align-param-gather`` the
    param-sync hook; and ``finalize_model_grads`` (the data-parallel gradient reduction and,
    with ``--calculate-per-token-loss``, the scaling by the global token count), unless a
    builder set its own."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss

    def each(name: str):
        hooks = [getattr(chunk, name) for chunk in model]
        return hooks[0] if len(hooks) == 1 else hooks

    if args.overlap_grad_reduce:
        config.no_sync_func = each("no_sync")
        if args.align_grad_reduce:
            config.grad_sync_func = each("start_grad_sync")
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = each("start_param_sync")
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads


def step_options(args, model: str) -> dict:
    """The forward steps' settings for validated ``args`` (as PackedForwardStep.from_args)."""
    return {"with_seq_idx": model == "hybrid",
            "static_max_seqlen": args.packed_graph_impl != "none",
            "cp_size": args.context_parallel_size,
            "with_padding_mask": getattr(args, "num_experts", None) is not None}
