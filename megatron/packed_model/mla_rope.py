"""Graph-safe yarn RoPE for MLA on packed (THD) micro-batches.

MLA applies its decoupled RoPE with megatron-core's fused Triton kernels
(``fused_apply_mla_rope_for_q/kv``): per physical row, the kernel walks ``cu_seqlens`` on the
GPU to find the row's segment and position, then reads that row of a cos/sin table. No host
sync, but three ways for a CUDA graph to read the wrong memory:

* a row past the last ``cu_seqlens`` value belongs to no segment and reads the table at row
  -1 (before the allocation). `cover_all_rows` appends one boundary at the end of the stream,
  the *zero-valid tail segment*: zero rows long when the boundaries already cover the stream
  (the packer's padding tail is a segment of its own), the uncovered rows otherwise;
* a position past the table's end reads past it. `PackedMLASelfAttention` (mla.py) asks for a
  table as long as the whole stream (this rank's rows x CP size), which bounds every position
  of every segment;
* upstream's ``YarnRotaryEmbedding.get_cached_cos_sin`` re-registers its cos/sin buffers
  whenever the length grows or the dtype or packing mode changes, freeing the tensors a
  captured graph reads (dynamic-CP banks differ in length). `GraphSafeYarnRotaryEmbedding`
  never replaces a table it handed out: a longer request builds a longer table and keeps the
  old one alive, with its values, for the life of the process. Layers with the same yarn
  settings share their tables (built once, not once per layer).

`fused_rope_table_rows` is the kernel's row -> table-row map in torch, so the contract can be
checked without a GPU (tests/unit/test_mla_rope.py runs the Triton kernel itself in Triton's
CPU interpreter against it).

The kernels also compile only for some head sizes: `head_size_rules` refuses the others at
parse time (packed_training/extra_args.py), before Triton would fail at the first forward.
"""

import inspect
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.packed_upstream import model_layers


def fused_rope_table_rows(cu_seqlens: Tensor, rows: int, cp_size: int = 1,
                          cp_rank: int = 0) -> Tensor:
    """Table row the fused MLA RoPE kernel reads for each of this rank's physical rows.

    Args:
        cu_seqlens: int ``[n + 1]`` boundaries the kernel is given (with CP: the whole
            stream's, CP-padded; the kernel divides each by ``cp_size``).
        rows: host int, this rank's physical rows (the kernel's grid).
    Returns int64 ``[rows]`` on ``cu_seqlens``' device: the row's position in its segment
    (with CP, its position in the whole document), or -1 for a row past the last boundary,
    which the kernel turns into a read before the table. No host sync.
    """
    local = cu_seqlens.to(torch.int64) // cp_size
    position = torch.arange(rows, device=cu_seqlens.device, dtype=torch.int64)
    # The kernel takes the first segment whose end lies past the row (empty ones never do).
    segment = torch.searchsorted(local[1:].contiguous(), position, right=True)
    inside = segment < local.numel() - 1
    segment = segment.clamp(max=local.numel() - 2)
    start = local[segment]
    length = local[segment + 1] - start
    index = position - start
    if cp_size > 1:  # the THD CP layout: chunks cp_rank and 2 * cp - 1 - cp_rank of the doc
        half = length // 2
        index = torch.where(index < half, index + cp_rank * length // 2,
                            index - half + (2 * cp_size - cp_rank - 1) * length // 2)
    return torch.where(inside, index, torch.full_like(index, -1))


def cover_all_rows(cu_seqlens: Tensor, rows: int, cp_size: int = 1) -> Tensor:
    """``cu_seqlens`` ``[n + 1]`` -> ``[n + 2]``: one more boundary at the end of the stream
    (``rows * cp_size``), so every physical row belongs to a segment for the fused RoPE.

    The appended segment is empty when ``cu_seqlens[-1]`` already is the stream's end (the
    training step's layout) and holds the uncovered rows otherwise. For RoPE only: attention
    keeps the micro-batch's own boundaries. One device op, static shape, no host sync.
    """
    return F.pad(cu_seqlens, (0, 1), value=rows * cp_size)


def inverse_frequencies(rope: YarnRotaryEmbedding, device: torch.device) -> Tuple[Tensor, Tensor]:
    """``rope``'s original and interpolated inverse frequencies, fp32 ``[dim / 2]`` on
    ``device``, by upstream's ops in upstream's order.

    Computed where upstream computes them: on ``device`` (megatron-core's MLA builds its yarn
    RoPE with ``use_cpu_initialization=False``, so on the GPU), or on the host when the module
    was built with ``use_cpu_initialization=True``. The fp32 power is the step whose rounding
    differs between CPU and CUDA; one unit in the last place of a frequency moves cos/sin by
    about 2e-4 at position 3000 and flips bf16 values.
    """
    if rope.frequencies_on_host:
        return rope.inv_freq_extra.to(device), rope.inv_freq_inter.to(device)
    exponents = torch.arange(0, rope.dim, 2, dtype=torch.float32, device=device) / rope.dim
    return (1.0 / (rope.rotary_base ** exponents),
            1.0 / (rope.scaling_factor * rope.rotary_base ** exponents))


def yarn_cos_sin(rope: YarnRotaryEmbedding, rows: int, dtype: torch.dtype,
                 device: torch.device) -> Tuple[Tensor, Tensor]:
    """Yarn cos and sin tables of ``rope``'s settings, each ``[rows, 1, 1, dim]``, scaled by
    the yarn concentration factor: upstream's ``cos_cached``/``sin_cached``, bit for bit, for
    the same constructor arguments on the same device (row ``r`` does not depend on
    ``rows``). Computed in fp32, cast to ``dtype``."""
    extrapolated, scale = model_layers.yarn_channel_mask_and_scale(rope, device)
    extra, inter = inverse_frequencies(rope, device)
    inv_freq = inter * (1.0 - extrapolated) + extra * extrapolated
    angles = torch.outer(torch.arange(rows, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    return ((angles.cos() * scale).to(dtype).contiguous(),
            (angles.sin() * scale).to(dtype).contiguous())


# (yarn settings, dtype, device) -> the current (cos, sin) of that kind, shared by every
# layer; tables replaced by longer ones move to _RETIRED. Both only grow, so a captured graph
# never reads freed or rewritten memory (tables are a few MiB).
_TABLES: Dict[tuple, Tuple[Tensor, Tensor]] = {}
_RETIRED: List[Tuple[Tensor, Tensor]] = []


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GraphSafeYarnRotaryEmbedding(YarnRotaryEmbedding):
    """YarnRotaryEmbedding whose cos/sin tables stay valid for every graph that read them.

    Same constructor as upstream, and the same values (`yarn_cos_sin`). It never touches a
    GPU when built: the host copy of the inverse frequencies is made on the CPU whatever
    ``use_cpu_initialization`` says, and each table is built on the device of its first use,
    its frequencies computed there too unless ``use_cpu_initialization`` is True (then from
    the host copy, as upstream does; ``frequencies_on_host`` keeps the choice).
    `get_cached_cos_sin` returns prefixes of one table per (settings, dtype, device), shared
    by all instances; a longer request builds a longer table and retires the old one, which
    stays alive and unchanged. The tables are not buffers, so casting or moving the module
    (``Float16Module``, ``.cuda()``) never replaces them either.
    """

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(YarnRotaryEmbedding.__init__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        on_host = bool(bound.arguments["use_cpu_initialization"])
        bound.arguments["use_cpu_initialization"] = True
        super().__init__(*bound.args[1:], **bound.kwargs)
        self.frequencies_on_host = on_host

    def _set_cos_sin_cache(self, seq_len, offset, dtype, packed_seq=False):
        # Upstream builds (and later re-registers) its cache here; the tables are built on use.
        return None

    def _key(self, dtype: torch.dtype, device: Optional[torch.device]) -> tuple:
        settings = (self.dim, self.rotary_base, self.scaling_factor,
                    self.original_max_position_embeddings, self.beta_fast, self.beta_slow,
                    self.mscale, self.mscale_all_dim, self.correction_range_round_to_int,
                    self.frequencies_on_host)
        return (settings, dtype, torch.device(device) if device is not None else _default_device())

    def get_cached_cos_sin(self, seq_len: int, offset: int = 0,
                           dtype: torch.dtype = torch.get_default_dtype(),
                           packed_seq: bool = False,
                           device: Optional[torch.device] = None) -> Tuple[Tensor, Tensor]:
        """cos and sin ``[seq_len, 1, 1, dim]`` for positions ``0 .. seq_len - 1``: views of a
        table that is never freed or rewritten.

        Builds or grows the table (device work, no host sync) only outside graph capture;
        warm-up runs eager, so a capture always finds it. Raises RuntimeError when a capture
        would need a longer table, ValueError for what training never asks (an offset, or
        unpacked data under CP, which upstream slices per rank).
        """
        if offset:
            raise ValueError(f"MLA RoPE offset is wrong: {offset}. Packed training starts every "
                             f"segment at position 0.")
        if not packed_seq and self.cp_group is not None and self.cp_group.size() > 1:
            raise ValueError("MLA RoPE on unpacked data with context parallelism is not built "
                             "by this fork; train packed (THD) micro-batches.")
        key = self._key(dtype, device)
        cos, sin = _TABLES.get(key, (None, None))
        if cos is None or cos.shape[0] < seq_len:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"MLA RoPE table too short under CUDA graph capture ({seq_len} positions, "
                    f"{0 if cos is None else cos.shape[0]} built): the eager warm-up must run "
                    f"a micro-batch of the captured length first.")
            if cos is not None:
                _RETIRED.append((cos, sin))  # a captured graph may still read it
            rows = 1 << max(seq_len - 1, 0).bit_length()  # powers of two: few rebuilds
            cos, sin = _TABLES[key] = yarn_cos_sin(self, rows, dtype, key[2])
        return cos[:seq_len], sin[:seq_len]

    def table_rows(self, dtype: torch.dtype, device: Optional[torch.device] = None) -> int:
        """Rows of the current table for ``dtype`` (0 before its first use)."""
        table = _TABLES.get(self._key(dtype, device))
        return 0 if table is None else table[0].shape[0]


def retired_tables() -> List[Tuple[Tensor, Tensor]]:
    """Tables replaced by longer ones, kept alive for the graphs that read them."""
    return list(_RETIRED)


# The head sizes the fused kernels take as Triton ``tl.arange`` ranges, which compile for
# powers of two only: half the RoPE width in both kernels (so the width is a power of two of
# at least 4), ``qk_head_dim`` and ``v_head_dim`` in the key/value kernel. (flag, dest, least)
FUSED_HEAD_SIZES = (("--qk-pos-emb-head-dim", "qk_pos_emb_head_dim", 4),
                    ("--qk-head-dim", "qk_head_dim", 1), ("--v-head-dim", "v_head_dim", 1))


def fused_rope_compiles(size: int, least: int = 1) -> bool:
    """Whether ``size`` is a power of two of at least ``least``."""
    return size >= least and size & (size - 1) == 0


def head_size_rules(args) -> list:
    """`refusals.refuse` rules for MLA head sizes in ``args`` that the fused kernels do not
    compile, each naming the largest power of two below the size (or ``least``) as the fix."""
    return [(not fused_rope_compiles(size, least), flag, size,
             f"megatron-core's fused MLA RoPE kernel (Triton) compiles power-of-two head sizes "
             f"only; use e.g. {1 << (max(size, least).bit_length() - 1)}")
            for flag, dest, least in FUSED_HEAD_SIZES for size in (getattr(args, dest),)]
