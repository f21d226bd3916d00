import pytest
import torch


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
