"""Save and resume training with megatron-core's distributed checkpointing.

Layout (Megatron's)::

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000100/            # a dist_checkpointing directory

A checkpoint holds the model chunks, the optimizer (sharded), the LR scheduler, the
iteration, consumed samples, every rank's RNG state and the arguments. Resuming restores all
of them, so the loss curve continues exactly where the uninterrupted run would be.
``--no-save-optim`` leaves out the optimizer and the scheduler, ``--no-save-rng`` the RNG
states (Megatron's flags, e.g. for a final SFT checkpoint); the checkpoint's content metadata
says which, and loading one asks for the matching ``--no-load-*`` flag instead of failing
inside dist_checkpointing.
"""

import os
import random
from typing import Optional

import numpy as np
import torch

from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    """Iteration recorded in ``root``'s tracker file, or None when there is no checkpoint."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"{path} is wrong: {text!r} is not an iteration number. Fix or delete the file."
        ) from None


def _rng_state() -> ShardedObject:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # One object per rank: every rank restores exactly its own generators.
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# The distributed optimizer's state as Megatron saves it by default: one tensor per
# contiguous buffer, reshardable across data-parallel sizes. megatron-core 0.19's own default
# when none is named (per-parameter flattened ranges) is refused by its dist_checkpointing.
OPTIMIZER_LAYOUT = {"distrib_optim_sharding_type": "dp_reshardable"}


def _model_key(i: int, num_chunks: int) -> str:
    return "model" if num_chunks == 1 else f"model{i}"


def _sharded_state_dict(model, optimizer, is_loading: bool, with_optimizer: bool,
                        with_rng: bool) -> dict:
    # Keys of the bare model (no DDP / Float16Module prefixes), as Megatron stores them.
    state = {}
    for i, chunk in enumerate(unwrap_model(model)):
        state[_model_key(i, len(model))] = chunk.sharded_state_dict()
    if with_optimizer:
        model_state = {k: v for k, v in state.items()}
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                          metadata=OPTIMIZER_LAYOUT)
    if with_rng:
        state["rng_state"] = _rng_state()
    return state


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler,
                    consumed_samples: int, args_dict: dict, *, with_optimizer: bool = True,
                    with_rng: bool = True) -> None:
    """Write a checkpoint of ``iteration`` under ``root`` (collective: every rank calls it);
    without the optimizer and scheduler (``with_optimizer``) or the RNG states (``with_rng``)
    when asked."""
    path = checkpoint_dir(root, iteration)
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state_dict(model, optimizer, is_loading=False,
                                with_optimizer=with_optimizer, with_rng=with_rng)
    if with_optimizer:
        state["scheduler"] = scheduler.state_dict()
    state.update(iteration=iteration, consumed_samples=consumed_samples, args=args_dict)
    dist_checkpointing.save(state, path, content_metadata={"optimizer": with_optimizer,
                                                           "rng": with_rng})
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, TRACKER_FILE), "w") as f:
            f.write(str(iteration))
        print(f" saved checkpoint at iteration {iteration:8d} to {path}", flush=True)


def check_checkpoint_content(path: str, content: Optional[dict], load_optim: bool,
                             load_rng: bool) -> None:
    """Refuse to load what a checkpoint does not hold. ``content``: its content metadata
    (``{"optimizer": bool, "rng": bool}``; None for a checkpoint written before it existed,
    which holds everything)."""
    content = content or {}
    missing = {"--no-save-optim": (load_optim and not content.get("optimizer", True),
                                   "optimizer and scheduler state", "--no-load-optim"),
               "--no-save-rng": (load_rng and not content.get("rng", True),
                                 "RNG states", "--no-load-rng")}
    for saved_with, (wanted, what, flag) in missing.items():
        if wanted:
            raise ValueError(
                f"--load is wrong: {path} holds no {what} (saved with {saved_with}). Add {flag} "
                f"to load it without them, or --finetune to start from its weights alone.")


def load_checkpoint(root: str, model, optimizer, scheduler, *, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False):
    """Load the latest checkpoint under ``root``. Returns ``(iteration, consumed_samples)``.

    ``finetune`` loads the weights only and starts from iteration 0. A missing checkpoint is
    an error (a typo in --load must not silently train from scratch).
    """
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(
            f"--load is wrong: no {TRACKER_FILE} in {root!r}. Point --load at a directory "
            "written by --save, or drop --load to train from scratch."
        )
    path = checkpoint_dir(root, iteration)
    load_optim = load_optim and not finetune
    load_rng = load_rng and not finetune
    check_checkpoint_content(path, dist_checkpointing.load_content_metadata(path), load_optim,
                             load_rng)
    state = _sharded_state_dict(model, optimizer, is_loading=True, with_optimizer=load_optim,
                                with_rng=load_rng)
    loaded = dist_checkpointing.load(state, path)
    for i, chunk in enumerate(unwrap_model(model)):
        chunk.load_state_dict(loaded[_model_key(i, len(model))])
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])
    else:
        # The mixed-precision optimizer copied the *initial* weights into its fp32 main
        # params at construction; without this its first step would write them back.
        optimizer.reload_model_params()
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    if torch.distributed.get_rank() == 0:
        print(f" loaded checkpoint from {path} at iteration {iteration}", flush=True)
    if finetune:
        return 0, 0
    return loaded["iteration"], loaded["consumed_samples"]
