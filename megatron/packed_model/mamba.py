"""Packed-sequence subclass of megatron-core's Mamba mixer, entered through specs.

* `PackedMambaMixer` requires the document index of every token in
  ``packed_seq_params.seq_idx`` (built once per micro-batch, no host sync): megatron-core
  0.19.2 reads it from the params as it is, and a packed micro-batch without it would let
  Mamba's conv and scan carry state across document boundaries, silently.
* `PackedMambaMixer` also runs context parallelism on the micro-batch's own CP group when the
  micro-batch names one (dynamic CP, `packed_seq_params.cp_group`): upstream's
  `MambaContextParallel` is built once, on the static ``pg_collection.cp``.
"""

from megatron.core.ssm.mamba_context_parallel import MambaContextParallel
from megatron.core.ssm.mamba_mixer import MambaMixer

from megatron.packed_model.dynamic_cp import micro_batch_cp_group
from megatron.packed_model.padding_rows import ZeroedProjectionInput
from megatron.packed_upstream import model_layers


class PackedMambaMixer(ZeroedProjectionInput, MambaMixer):
    """MambaMixer whose packed ``seq_idx`` and CP group come from the micro-batch's params;
    under FP8 the scan output's padding rows are zero before ``out_proj`` (padding_rows.py)."""

    projection = "out_proj"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cp_by_group = {}  # micro-batch CP group -> MambaContextParallel over it

    def forward(self, hidden_states, inference_context=None, *, packed_seq_params=None,
                **kwargs):
        if packed_seq_params is not None and packed_seq_params.seq_idx is None:
            raise ValueError(
                "packed_seq_params.seq_idx is None: Mamba would mix the documents of this packed "
                "micro-batch. Build the params with build_packed_batch_params(..., "
                "with_seq_idx=True) (the hybrid training step does).")
        with model_layers.field_for_this_call(self, "cp",
                                              self._context_parallel_for(packed_seq_params)):
            return super().forward(hidden_states, inference_context,
                                   packed_seq_params=packed_seq_params, **kwargs)

    def _context_parallel_for(self, packed_seq_params) -> MambaContextParallel:
        """The static CP object, or one over the micro-batch's CP group (built once per group:
        it only slices this layer's parameters and holds no state of its own)."""
        group = micro_batch_cp_group(packed_seq_params)
        if group is None:
            return self.cp  # dynamic CP runs with static CP size 1 (checked at parse time)
        if group not in self._cp_by_group:
            cp = self.cp
            self._cp_by_group[group] = MambaContextParallel(
                cp_group=group, d_inner_local_tp=cp.d_inner_local_tp,
                nheads_local_tp=cp.nheads_local_tp, ngroups_local_tp=cp.ngroups_local_tp,
                d_state=cp.d_state, conv1d_weight_cp1=cp.conv1d_weight_cp1,
                conv1d_bias_cp1=cp.conv1d_bias_cp1, conv1d_padding=cp.conv1d_padding,
                dt_bias_cp1=cp.dt_bias_cp1,
                A_log_cp1=cp.A_log_cp1, D_cp1=cp.D_cp1, D_has_hdim=cp.D_has_hdim)
        return self._cp_by_group[group]
