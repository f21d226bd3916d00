"""PackedMambaMixer's contract on the host side (the kernels need a GPU)."""

import inspect

import pytest
import torch

from megatron.core.ssm.mamba_context_parallel import MambaContextParallel
from megatron.core.ssm.mamba_mixer import MambaMixer

from megatron.packed_model.mamba import PackedMambaMixer
from megatron.packed_graphs.packed_seq import build_packed_batch_params


def test_a_packed_micro_batch_without_seq_idx_is_refused():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    params = build_packed_batch_params(cu, torch.tensor([0, 1, 2, 0, 1]), 5, with_seq_idx=False)
    # Refused before the mixer touches its weights or kernels: no module state is needed.
    with pytest.raises(ValueError, match="seq_idx is None: Mamba would mix the documents"):
        PackedMambaMixer.forward(object(), torch.zeros(5, 1, 8), packed_seq_params=params)


def test_upstream_reads_seq_idx_from_the_params_as_given():
    # When this fails, upstream builds seq_idx itself again: re-check the refusal above.
    assert "seq_idx = packed_seq_params.seq_idx" in inspect.getsource(MambaMixer._ssm_training)


def test_context_parallel_for_a_group_takes_upstreams_constructor_arguments():
    # PackedMambaMixer builds MambaContextParallel over a micro-batch's group with the static
    # one's attributes: every constructor argument must be one of them.
    params = [p for p in inspect.signature(MambaContextParallel.__init__).parameters
              if p not in ("self", "cp_group")]
    source = inspect.getsource(PackedMambaMixer._context_parallel_for)
    assert all(f"{p}=cp.{p}" in source for p in params), params
