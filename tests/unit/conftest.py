import pytest
import torch
import torch.nn.functional as F

# The small model of the CPU model tests: a layer's settings, and an MoE layer's on top.
TINY_LAYER = dict(
    num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
    normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
    add_bias_linear=False, bias_dropout_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)
TINY_MOE = dict(
    num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
    moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def tiny_moe_config(config_class=None, **overrides):
    """A config of the small MoE model (`TINY_LAYER` and `TINY_MOE`; ``overrides`` replace or
    add fields): megatron-core's TransformerConfig, or ``config_class``."""
    if config_class is None:
        from megatron.core.transformer.transformer_config import TransformerConfig

        config_class = TransformerConfig
    return config_class(**(TINY_LAYER | TINY_MOE | overrides))


@pytest.fixture(scope="session")
def cpu_dist(tmp_path_factory):
    """A one-process gloo world with megatron-core's parallel state (CPU tests of models)."""
    from megatron.core import parallel_state

    # A file rendezvous: no TCP port that another process on the machine could hold.
    store = tmp_path_factory.mktemp("dist") / "store"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}",
                                             rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture
def with_te(monkeypatch):
    """Transformer Engine importable for the fork's parse-time checks (extra_args.py);
    flash-attn and apex still not."""
    from megatron.packed_training import extra_args

    monkeypatch.setattr(extra_args, "is_importable",
                        lambda package: package == "transformer_engine")


@pytest.fixture
def cpu_moe(cpu_dist, monkeypatch):
    """megatron-core's MoE modules on CPU, with an empty MoE metrics tracker (yielded).

    The alltoall dispatcher moves its token counts to the host on a CUDA side stream; here
    they are host tensors already, so that stream is a placeholder and the move is identity.
    """
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())
    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize",
                        lambda self, point, tokens_per_expert=None: tokens_per_expert)
    get_moe_metrics_tracker().metrics.clear()
    yield get_moe_metrics_tracker()
    get_moe_metrics_tracker().metrics.clear()


class ReplayingGraph:
    """A CUDA graph's stand-in on CPU: `replay` runs the captured body again and writes its
    outputs into the tensors the capture returned, as a replay overwrites a graph's static
    outputs in place. What the body reads (static inputs, weights) it reads at replay time."""

    def __init__(self, body):
        self.body, self.result, self.replays = body, None, 0

    def replay(self):
        self.replays += 1
        _copy_outputs(self.result, self.body())


def _copy_outputs(static, new):
    if torch.is_tensor(static):
        static.copy_(new)
    elif isinstance(static, (tuple, list)):
        for old, value in zip(static, new):
            _copy_outputs(old, value)


def replaying_capture(body, *, pool, stream=None, generators=()):
    """`graph_memory.capture_graph`'s contract with `ReplayingGraph` (CPU tests of the
    forward-only graphs): the body runs once, as a capture records it."""
    graph = ReplayingGraph(body)
    graph.result = body()
    return graph, graph.result, 0.0, 0


@pytest.fixture
def restored_training_loop(monkeypatch):
    """Megatron-LM's loop module as it was, after a test that installs the seam
    (training_loop.route_training_loop): every name the seam replaces is put back."""
    import megatron.training.training as loop
    from megatron.core.rerun_state_machine import RerunStateMachine
    from megatron.training.dist_signal_handler import DistributedSignalHandler

    for name in ("setup_model_and_optimizer", "get_forward_backward_func",
                 "get_megatron_optimizer_config", "wrap_model_chunks_with_ddp",
                 "logical_and_across_model_parallel_group",
                 "reduce_max_stat_across_model_parallel_group", "training_log"):
        monkeypatch.setattr(loop, name, getattr(loop, name))
    monkeypatch.setattr(RerunStateMachine, "_reduce_any", RerunStateMachine._reduce_any)
    monkeypatch.setattr(DistributedSignalHandler, "signals_received",
                        DistributedSignalHandler.signals_received)
    from megatron.packed_upstream import gate

    # Installable again on the restored names; the process's record comes back after.
    reinstalled = ("training_loop_routed", "reduce_rerun_flags_on_host",
                   "check_exit_signal_on_host")
    monkeypatch.setattr(gate, "applied_patches", {
        name: state for name, state in gate.applied_patches.items() if name not in reinstalled})
    return loop
