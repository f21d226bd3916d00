"""In-place weight updates of a graphed policy: reference-model swaps and refits.

Every CUDA graph of the policy (training layer graphs, forward-only graphs) reads the model's
weights at the addresses they had at capture. So other weights enter the model only by
copying into the live tensors, never by replacing them: then every graph computes with the
new values on its next replay, exactly as an eager call would.

* `policy_weights(model_chunks)`: the live floating-point tensors by name (parameters and
  persistent buffers, e.g. an MoE router's expert bias; tied tensors once).
* `WeightStore`: a copy of them (a reference policy, another policy's weights).
* `load_weights(model_chunks, source)`: copy a store or a ``{name: tensor}`` mapping in
  (a refit from another copy); `swapped_weights(model_chunks, store)`: exchange the live
  weights with a store for the scope (the reference model's log-probs on the policy's
  graphs), and back.

Names are the unwrapped chunk's ``state_dict`` names (``decoder.layers.0.mlp.linear_fc1.
weight``), prefixed ``chunk<i>.`` when there are several chunks. All copies run on the
current stream, device to device where both sides are on the device; nothing syncs.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

from megatron.core.utils import unwrap_model


def policy_weights(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, Tensor]:
    """The model's live floating-point weights by name (module doc); a tensor reachable under
    two names (tied embeddings) is listed once, under its first."""
    chunks = list(model_chunks)
    named, seen = {}, set()
    for index, chunk in enumerate(chunks):
        prefix = f"chunk{index}." if len(chunks) > 1 else ""
        for name, value in unwrap_model(chunk).state_dict(keep_vars=True).items():
            if not torch.is_tensor(value) or not value.is_floating_point():
                continue  # e.g. TE's _extra_state
            if id(value) in seen:
                continue
            seen.add(id(value))
            named[prefix + name] = value
    return named


@dataclass
class WeightStore:
    """A copy of a policy's weights: ``tensors`` by name, shapes and dtypes of the live ones."""

    tensors: Dict[str, Tensor]

    @classmethod
    def snapshot(cls, model_chunks: Sequence[torch.nn.Module],
                 device: Optional[torch.device] = None) -> "WeightStore":
        """The model's current weights, copied (to ``device``; default: where they are).
        A store on the host costs no GPU memory; swapping with it copies over PCIe."""
        with torch.no_grad():
            return cls({name: value.detach().to(device or value.device, copy=True)
                        for name, value in policy_weights(model_chunks).items()})

    def __len__(self) -> int:
        return len(self.tensors)


def _matched(live: Dict[str, Tensor], source: Mapping[str, Tensor]) -> None:
    """Raise unless ``source`` holds exactly the live names, each of the live shape."""
    missing = sorted(set(live) - set(source))
    extra = sorted(set(source) - set(live))
    if missing or extra:
        raise ValueError(f"weights are wrong: missing {_first(missing)}, unexpected "
                         f"{_first(extra)}. Give every weight of policy_weights(model), by its "
                         f"name (WeightStore.snapshot of a model built from the same config).")
    for name, value in live.items():
        given = source[name]
        if not torch.is_tensor(given) or tuple(given.shape) != tuple(value.shape):
            shown = tuple(given.shape) if torch.is_tensor(given) else type(given).__name__
            raise ValueError(f"weight {name} is wrong: shape {shown}, the model's is "
                             f"{tuple(value.shape)}. Give weights of the same model config and "
                             f"parallel layout (this rank's shard).")


def _first(names: list, shown: int = 4) -> str:
    return str(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def load_weights(model_chunks: Sequence[torch.nn.Module],
                 source: "WeightStore | Mapping[str, Tensor]") -> None:
    """Copy ``source`` into the model's live weights, in place (dtype converted as
    ``copy_`` does). Graph addresses stay valid. The optimizer's own copies (fp32 main
    parameters) are the caller's: `PackedPolicy.load_weights` reloads them."""
    live = policy_weights(model_chunks)
    tensors = source.tensors if isinstance(source, WeightStore) else source
    _matched(live, tensors)
    with torch.no_grad():
        for name, value in live.items():
            _copy(value, tensors[name])


@contextmanager
def swapped_weights(model_chunks: Sequence[torch.nn.Module],
                    store: WeightStore) -> Iterator[None]:
    """Within the scope the model holds ``store``'s weights and ``store`` the model's; both
    are exchanged back on exit (also on an error). In place: graphs replay with the swapped
    weights. One temporary per tensor, freed as it goes."""
    live = policy_weights(model_chunks)
    _matched(live, store.tensors)
    _exchange(live, store.tensors)
    try:
        yield
    finally:
        _exchange(live, store.tensors)


def _exchange(live: Dict[str, Tensor], stored: Dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, value in live.items():
            other = stored[name]
            held = value.detach().clone()
            _copy(value, other)
            _copy(other, held)


def _copy(destination: Tensor, source: Tensor) -> None:
    # Asynchronous only device to device: a copy to pageable host memory must finish before
    # its source (a temporary) is freed.
    destination.copy_(source, non_blocking=destination.device == source.device)
