"""PackedMambaMixer's contract on the host side (the kernels need a GPU)."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from megatron.core.ssm.mamba_context_parallel import MambaContextParallel
from megatron.core.ssm.mamba_mixer import MambaMixer

from megatron.packed_model.mamba import PackedMambaMixer
from megatron.packed_graphs.packed_seq import build_packed_batch_params
from megatron.packed_graphs.specs import hybrid_stack_spec


def test_a_packed_micro_batch_without_seq_idx_is_refused():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    params = build_packed_batch_params(cu, torch.tensor([0, 1, 2, 0, 1]), 5, with_seq_idx=False)
    # Refused before the mixer touches its weights or kernels: no module state is needed.
    with pytest.raises(ValueError, match="seq_idx is None: Mamba would mix the documents"):
        PackedMambaMixer.forward(object(), torch.zeros(5, 1, 8), packed_seq_params=params)


def test_upstream_hands_the_kernel_the_params_seq_idx_as_given(monkeypatch):
    """upstream's training pass gives mamba-ssm's fused conv + scan the ``seq_idx`` of the
    params, the very tensor. When this fails, upstream builds seq_idx itself again: re-check
    the refusal above."""
    import megatron.core.ssm.mamba_mixer as upstream

    seen = {}

    def kernel(zxBCdt, *args, seq_idx=None, **kwargs):  # mamba-ssm's kernel (GPU only)
        seen["seq_idx"] = seq_idx
        return zxBCdt[..., :8]

    monkeypatch.setattr(upstream, "mamba_split_conv1d_scan_combined", kernel)
    monkeypatch.setattr(upstream, "_check_mamba_sequence_packing_support",
                        lambda for_inference_not_training: (True, None))
    ones = torch.ones(4)
    cp = SimpleNamespace(get_A_log=lambda: ones, get_conv1d_weight=lambda: torch.ones(4, 1, 2),
                         get_conv1d_bias=lambda: ones, get_dt_bias=lambda: ones,
                         get_D=lambda: ones, ngroups_local_tpcp=1,
                         post_conv_ssm=lambda y, packed_seq_params: y)
    mixer = SimpleNamespace(cp=cp, D_has_hdim=False, headdim=2, chunk_size=4, activation="silu",
                            norm_before_gate=False, rmsnorm=False,
                            mamba_training_ssm_states_dtype=None)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    params = build_packed_batch_params(cu, torch.tensor([0, 1, 2, 0, 1]), 5)
    out = MambaMixer._ssm_training(mixer, torch.zeros(5, 1, 16), packed_seq_params=params)
    assert out.shape == (5, 1, 8)
    assert params.seq_idx is not None and seen["seq_idx"] is params.seq_idx


def test_context_parallel_for_a_group_takes_upstreams_constructor_arguments():
    """PackedMambaMixer builds MambaContextParallel over a micro-batch's group, once per group,
    from the static one's attributes: every constructor argument is carried over."""
    names = [p for p in inspect.signature(MambaContextParallel.__init__).parameters
             if p not in ("self", "cp_group")]
    static = SimpleNamespace(**{name: object() for name in names})  # a marker per argument

    class OneRank:  # MambaContextParallel over one rank keeps its arguments and slices nothing
        def size(self):
            return 1

    mixer = SimpleNamespace(cp=static, _cp_by_group={})
    group = OneRank()
    params = SimpleNamespace(cp_group=group, local_cp_size=1)
    built = PackedMambaMixer._context_parallel_for(mixer, params)
    assert isinstance(built, MambaContextParallel) and built.cp_group is group
    assert [name for name in names if getattr(built, name, None) is not getattr(static, name)] == []
    assert PackedMambaMixer._context_parallel_for(mixer, params) is built
    assert PackedMambaMixer._context_parallel_for(mixer, None) is static


@pytest.mark.parametrize("given, d_conv", [({}, 4), ({"mamba_conv_kernel_size": 3}, 3)])
def test_the_hybrid_spec_gives_the_mixer_its_conv_width(given, d_conv):
    """hybrid_stack_spec hands megatron-core's MambaMixer its ``d_conv`` (build_module passes a
    spec's params to the constructor; tests/unit/test_hf_convert.py builds the model)."""
    mixer = hybrid_stack_spec("torch", **given).submodules.mamba_layer.submodules.mixer
    assert mixer.module is PackedMambaMixer and mixer.params == {"d_conv": d_conv}
    assert "d_conv" in inspect.signature(MambaMixer.__init__).parameters
