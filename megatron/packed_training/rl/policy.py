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
    policy.save("runs/rl")                                    # Megatron-LM's checkpoint; resume
                                                              # with training "load": "runs/rl"
    reference = policy.weights_from_checkpoint("runs/sft")    # another checkpoint's weights
    policy.offload(); ...; policy.onload()    # with PolicyConfig(offloadable=True): the GPU
                                              # to a rollout engine meanwhile (rl/offload.py)

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

from megatron.packed_training.packed_step import needs_padding_mask
from megatron.packed_training.rl.batches import (
    PackedSequences,
    RowLayout,
    check_values,
    lay_out,
    lay_out_all,
)
from megatron.packed_training.rl.layouts import Layout, schedule_count, step_totals
from megatron.packed_training.rl.offload import (
    MemoryMove,
    PolicyMemory,
    on_the_gpu,
    on_the_gpu_iterating,
    on_the_gpu_scope,
)
from megatron.packed_training.rl.steps import (
    ENTROPY,
    INV_TEMPERATURE,
    LOGPROBS,
    METRIC_NAMES,
    TOPK_IDS,
    TOPK_LOGPROBS,
    VOCAB_CHUNK,
    LogProbStep,
    LossFunction,
    PolicyLossStep,
    check_head_options,
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
    ``offloadable``: build the policy so that `PackedPolicy.offload` / `onload` can move its
    GPU memory (parameters, gradient buffers, optimizer state, graph pools) to pinned host
    memory and back at the same addresses, for a rollout engine on the same GPU (rl/offload.py;
    needs torch_memory_saver and its preload library, checked at `build` before any GPU work).
    """

    training: Union[str, os.PathLike, Mapping, argparse.Namespace]
    model: str = "gpt"
    check_inputs: bool = True
    hf_config: Optional[Union[str, os.PathLike]] = None
    offloadable: bool = False

    def args(self) -> argparse.Namespace:
        """The validated training arguments."""
        if self.model not in ("gpt", "hybrid"):
            raise ValueError(f"PolicyConfig.model is wrong: {self.model!r}. Use 'gpt' or "
                             f"'hybrid'.")
        if isinstance(self.training, argparse.Namespace):
            return self.training
        from megatron.packed_training.config import load_training_config, read_training_mapping

        training = read_training_mapping(self.training)
        training.setdefault("calculate_per_token_loss", True)
        return load_training_config(training, self.model)


def check_library_layout(args) -> None:
    """Raise for a parallel layout the library API does not run (module doc): dynamic
    context parallelism, static CP whose packed row does not split into 2 x CP chunks, and
    static CP without ``calculate_per_token_loss``."""
    if getattr(args, "dynamic_cp_sizes", None):
        raise ValueError(f"dynamic_cp_sizes is wrong for the library API: "
                         f"{args.dynamic_cp_sizes}. Leave it unset; a static "
                         f"context_parallel_size runs.")
    cp = args.context_parallel_size
    if cp > 1 and (row := args.micro_batch_size * args.seq_length) % (2 * cp):
        raise ValueError(f"context_parallel_size is wrong for the library API: {cp} with a "
                         f"packed row of {row} positions (micro_batch_size x seq_length), not "
                         f"a multiple of 2 x {cp}. Set seq_length to a multiple of {2 * cp}.")
    if cp > 1 and not args.calculate_per_token_loss:
        # Without it megatron-core divides each CP rank's share by that share's own count, and
        # the gradient is no longer that of the loss the step reports.
        raise ValueError(f"calculate_per_token_loss is wrong for context_parallel_size {cp}: "
                         f"False. Leave it unset (the library's default is True).")


@dataclass
class LogProbOutputs:
    """One micro-batch's `PackedPolicy.logprobs` with extras asked, token aligned, on the GPU
    (``N``: its tokens; 0 at each sequence's first token, predicted by nothing).

    ``logprobs``: float32 ``[N]``; ``entropy``: float32 ``[N]``, the entropy of
    ``softmax(logits / temperature)`` over the vocabulary at the position that predicts token
    ``t`` (None unless asked); ``topk_logprobs``: float32 ``[N, k]``, the ``k`` largest
    log-probs of that distribution, largest first, and ``topk_ids``: int64 ``[N, k]``, their
    vocabulary ids (None unless ``top_k``).
    """

    logprobs: Tensor
    entropy: Optional[Tensor] = None
    topk_logprobs: Optional[Tensor] = None
    topk_ids: Optional[Tensor] = None


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
    ``Converted``), or None. ``iteration``: the optimizer steps taken so far (a loaded
    checkpoint's iteration); `train_step` counts on from it, `save` numbers its checkpoint
    with it. ``memory``: the `offload.PolicyMemory` of an offloadable policy
    (`build` makes it), or None.

    ``logprob_vocab_chunk``: vocabulary columns per chunk of `logprobs`' head (steps.py,
    `chunked_head`); 0: the whole vocabulary shard at once through megatron-core's cross
    entropy, the head `train_step` uses (log-probs only, with a float32 ``[positions, V / TP]``
    temporary). Read at each call; every rank sets the same.
    """

    logprob_vocab_chunk: int = VOCAB_CHUNK

    def __init__(self, model: Sequence[torch.nn.Module], optimizer, runtime, schedule, *,
                 row_positions: int, vocab_size: int, step_options: dict,
                 scheduler=None, lr_increment: int = 1, check_inputs: bool = True,
                 hf_config=None, iteration: int = 0,
                 memory: Optional[PolicyMemory] = None):
        self.model = list(model)
        self.memory = memory
        self.hf_mapping = None if hf_config is None else export_module().hf_mapping(hf_config)
        self.optimizer, self.scheduler, self.runtime = optimizer, scheduler, runtime
        self.schedule = schedule
        self.row_positions, self.vocab_size = row_positions, vocab_size
        self.lr_increment, self.check_inputs = lr_increment, check_inputs
        self._step_options = dict(step_options)
        # One forward step per set of head options: the runtime keeps each step's forward-only
        # graphs apart, so a call never replays a graph captured for other outputs.
        self._logprob_steps: Dict[tuple, LogProbStep] = {}  # by (entropy, top_k, vocab_chunk)
        self._loss_steps: Dict[tuple, PolicyLossStep] = {}  # by (loss_fn, normalization)
        self._metric_names: Dict[PolicyLossStep, List[str]] = {}  # PP: known on every stage
        cp_size = self._step_options.get("cp_size", 1)
        self.segment_multiple = 2 * cp_size if cp_size > 1 else 1
        self.last_stats: dict = {}  # the graph runtime's counters of the latest call
        self.iteration = iteration
        self._checkpointing_context: dict = {}  # Megatron-LM's, kept across saves as train() does
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
        memory = PolicyMemory.open() if config.offloadable else None  # host checks
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
        # An offloadable policy's model and optimizer are allocated in its memory.
        with memory.resident("PackedPolicy.build") if memory else nullcontext():
            model, optimizer, scheduler = training.setup_model_and_optimizer(
                ModelType.encoder_or_decoder,
                partial(model_provider, MODEL_BUILDERS[config.model]))
            prepare_training_loop(args, model, optimizer)
        if memory is not None:
            memory.keep_library_workspaces_outside()
        seam = training.get_forward_backward_func()  # megatron-core's, behind the runtime
        return cls(model, optimizer, run.runtime, seam,
                   row_positions=args.micro_batch_size * args.seq_length,
                   vocab_size=args.padded_vocab_size, scheduler=scheduler,
                   lr_increment=args.global_batch_size, check_inputs=config.check_inputs,
                   step_options=step_options(args, config.model), hf_config=family,
                   iteration=args.iteration,  # a loaded checkpoint's, else 0
                   memory=memory)

    # -- calls ---------------------------------------------------------------------------------

    @on_the_gpu
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
        self.iteration += 1  # a skipped update counts, as in Megatron-LM's loop
        return TrainResult(loss=total[0] / count, num_tokens=total[1],
                           grad_norm=grad_norm, update_successful=update_successful,
                           stats=dict(self.last_stats), metrics=metrics)

    @on_the_gpu
    def logprobs(self, micro_batches: Sequence[PackedSequences], *, temperature: float = 1.0,
                 eager: bool = False, entropy: bool = False,
                 top_k: int = 0) -> Union[List[Tensor], List[LogProbOutputs]]:
        """Per-token log-probs of the given tokens, forward only: one float32 ``[N]`` device
        tensor per micro-batch, token aligned (value ``t``: log p(token t | the tokens before
        it in its sequence) under ``softmax(logits / temperature)``; 0 at each sequence's first
        token). The model runs in eval mode (no dropout) on forward-only graphs; ``eager``:
        every micro-batch eager (``eager forced``), a reference to compare graphs with.
        ``loss_weights`` and ``tensors`` of the micro-batches are not used (checked only).

        ``entropy`` (per-token entropy) or ``top_k`` (1 to 64: the ``k`` largest log-probs and
        their ids, for distillation) return one `LogProbOutputs` per micro-batch instead. Each
        set of options replays forward-only graphs of its own, captured at its first call;
        every rank passes the same options (the head's collectives, the captures). The head
        runs over vocabulary chunks (``logprob_vocab_chunk``). Bad options raise ValueError
        before anything runs."""
        step = self._head_step(entropy, top_k)
        batches = self._prepare(micro_batches, temperature)
        forced = self.runtime.forced_eager() if eager else nullcontext()
        with torch.no_grad(), forced:
            reports = self.schedule(forward_step_func=step, data_iterator=self._data(batches),
                                    model=self.model, num_microbatches=len(batches),
                                    forward_only=True)
        # Whole rows on every rank: from the last pipeline stage, the CP shares gathered.
        layout = self._layout()
        rows = layout.rows([report[LOGPROBS] for report in reports], batches,
                           self.row_positions)
        given = [batch["layout"] for batch in batches[:len(micro_batches)]]
        if not (entropy or top_k):
            return [each.to_tokens(row) for each, row in zip(given, rows)]
        return [LogProbOutputs(
            each.to_tokens(row),
            each.to_tokens(report[ENTROPY]) if entropy else None,
            rows_to_tokens(each, report[TOPK_LOGPROBS]) if top_k else None,
            rows_to_tokens(each, report[TOPK_IDS]) if top_k else None)
            for each, row, report in zip(given, rows, reports)]

    def _head_step(self, entropy: bool, top_k: int) -> LogProbStep:
        """The log-prob step of these head options (made at first ask); ValueError, before any
        device work, for bad ones."""
        entropy, top_k, chunk = check_head_options(entropy, top_k, self.logprob_vocab_chunk,
                                                   "policy.logprob_vocab_chunk")
        if top_k > self.vocab_size:
            raise ValueError(f"top_k is wrong: {top_k}, more than the vocabulary's "
                             f"{self.vocab_size} ids. Pass at most {self.vocab_size}.")
        if (entropy or top_k) and split_over_ranks():
            raise ValueError(f"entropy={entropy}, top_k={top_k} is wrong for this layout: the "
                             f"extra outputs run at pipeline and context parallel size 1. "
                             f"Ask for log-probs only here, or use tensor and data "
                             f"parallelism.")
        key = (entropy, top_k, chunk)
        if key not in self._logprob_steps:
            self._logprob_steps[key] = LogProbStep(entropy=entropy, top_k=top_k,
                                                   vocab_chunk=chunk, **self._step_options)
        return self._logprob_steps[key]

    # -- weights -------------------------------------------------------------------------------

    @on_the_gpu
    def snapshot_weights(self, device: Optional[torch.device] = None) -> WeightStore:
        """A copy of the policy's weights (e.g. the reference policy), on ``device`` (default:
        where they are; the host costs no GPU memory, a swap then copies over PCIe)."""
        return WeightStore.snapshot(self.model, device)

    @on_the_gpu_scope
    def swapped_weights(self, store: WeightStore):
        """Context manager: the model holds ``store``'s weights within the scope (graphs
        replay with them), its own again after. For the reference policy's log-probs."""
        return swapped_weights(self.model, store)

    @on_the_gpu
    def load_weights(self, source: Union[WeightStore, Mapping[str, Tensor]]) -> None:
        """A refit: copy ``source`` (a `WeightStore` or ``{name: tensor}`` by
        `weights.policy_weights` names) into the model in place, and the optimizer's main
        parameters from them. Optimizer moments are kept."""
        load_weights(self.model, source)
        reload = getattr(self.optimizer, "reload_model_params", None)  # megatron-core's
        if reload is not None:
            reload()

    @on_the_gpu
    def weights_from_checkpoint(self, path: Union[str, os.PathLike],
                                device: Optional[torch.device] = None) -> WeightStore:
        """The model weights of another Megatron-LM checkpoint (a ``--save`` or `save` folder,
        torch_dist; any parallel layout) as a store for `swapped_weights` or `load_weights`,
        e.g. the reference policy: this rank's shards, on ``device`` (default: where the
        weights are). Reads nothing else and builds no model; the live weights are untouched.
        Every rank calls it (`WeightStore.from_checkpoint`). ValueError for a path that is no
        such checkpoint or holds another model."""
        return WeightStore.from_checkpoint(path, self.model, device)

    @on_the_gpu_iterating
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

    # -- checkpoints ---------------------------------------------------------------------------

    @on_the_gpu
    def save(self, path: Union[str, os.PathLike], iteration: Optional[int] = None) -> None:
        """Megatron-LM's checkpoint of the policy in the folder ``path``: model, optimizer and
        learning-rate schedule state, RNG and rerun state, as ``--save`` writes it
        (megatron.training.checkpointing.save_checkpoint, the training config's
        ``ckpt_format``: torch_dist by default), numbered ``iteration`` (default: the policy's
        own, `iteration`). A policy built with the training config's ``load`` set to ``path``
        resumes from it: the same weights, optimizer state and schedule, so its next
        `train_step` is the one the saving policy would take.

        Collective: every rank calls it. Returns when the checkpoint is on disk (an async save
        is finished here). Megatron-LM's ``args.save`` holds ``path`` during the call only.
        Under ``--overlap-param-gather`` the updated parameters are gathered first."""
        iteration = self.iteration if iteration is None else iteration
        check_save_arguments(path, iteration)
        from megatron.training.async_utils import maybe_finalize_async_save
        from megatron.training.checkpointing import save_checkpoint

        args = megatron_args("PackedPolicy.save")
        finish_param_gather(self.model)
        kept = args.save
        args.save = os.fspath(path)
        # The samples the steps consumed, as Megatron-LM's loop counts them (a global batch of
        # lr_increment a step): a training run resuming from the checkpoint starts after them.
        args.consumed_train_samples = iteration * self.lr_increment
        try:
            save_checkpoint(iteration, self.model, self.optimizer, self.scheduler,
                            getattr(args, "num_floating_point_operations_so_far", 0),
                            checkpointing_context=self._checkpointing_context)
            maybe_finalize_async_save(blocking=True)  # a no-op unless args.async_save
        finally:
            args.save = kept

    # -- sharing the GPU -----------------------------------------------------------------------

    def offload(self) -> MemoryMove:
        """Move the policy's GPU memory to pinned host memory, for a rollout engine on the same
        GPU: parameters, gradient buffers, optimizer state, graph pools and everything else
        allocated in the policy's build and calls, the device tensors they returned included
        (read them first). The CUDA context, NCCL's buffers and allocations made outside the
        policy's calls stay (rl/offload.py). Syncs the device. Until `onload`, every call of
        the policy is refused (RuntimeError). Returns the MiB released and the seconds taken.
        Raises RuntimeError for a policy built without ``PolicyConfig(offloadable=True)``."""
        return self._offloadable("offload").offload()

    def onload(self) -> MemoryMove:
        """Bring the policy's memory back at the same addresses: the captured graphs replay
        unchanged, nothing is recaptured. Refused (RuntimeError, nothing changed) while the
        device has less free memory than the policy needs. Returns the MiB taken back and the
        seconds taken."""
        return self._offloadable("onload").onload()

    def _offloadable(self, what: str) -> PolicyMemory:
        if self.memory is None:
            raise RuntimeError(f"{what} needs a policy built with PolicyConfig(offloadable=True) "
                               f"in a process started with torch_memory_saver's preload "
                               f"library (docs/rl.md, 'Sharing the GPU with a rollout "
                               f"engine'); this one was built without it.")
        return self.memory

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


def rows_to_tokens(layout: RowLayout, per_position: Tensor) -> Tensor:
    """``[S, k]`` per-position rows -> ``[N, k]`` per token, token aligned as
    `RowLayout.to_tokens` (zeros at each sequence's first token). Device work only."""
    out = per_position.new_zeros((layout.num_tokens, per_position.shape[-1]))
    if layout.positions is None:
        rows = per_position[:layout.targets.numel()]
    else:  # sequences padded apart (context parallelism)
        rows = per_position.index_select(0, layout.positions.to(out.device, non_blocking=True))
    out.index_copy_(0, layout.targets.to(out.device, non_blocking=True), rows)
    return out


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


def check_save_arguments(path, iteration) -> None:
    """Raise ValueError for a `PackedPolicy.save` path or iteration it cannot write."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"save path is wrong: {path!r}. Give the checkpoint folder (str or "
                         f"os.PathLike), as the training config's save or load names it.")
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"save iteration is wrong: {iteration!r}. Give a non-negative int "
                         f"(default: policy.iteration, the steps taken).")


def megatron_args(caller: str) -> argparse.Namespace:
    """Megatron-LM's global arguments, which `PackedPolicy.build` set; RuntimeError naming
    ``caller`` for a policy built otherwise."""
    from megatron.training.global_vars import get_args

    try:
        return get_args()
    except AssertionError:
        raise RuntimeError(f"{caller} needs Megatron-LM's arguments, which PackedPolicy.build "
                           f"sets: build the policy with PackedPolicy.build(PolicyConfig(...))."
                           ) from None


def split_over_ranks() -> bool:
    """Whether a micro-batch's results are split over pipeline stages or context parallel
    ranks (megatron-core's parallel state; False before it is set)."""
    from megatron.core import parallel_state

    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return False
    return (parallel_state.get_pipeline_model_parallel_world_size() > 1
            or parallel_state.get_context_parallel_world_size() > 1)


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
            "with_padding_mask": needs_padding_mask(args)}
