"""Worker of tests/gpu/test_graph_health_check.py: pretrain_gpt.py's training (Megatron-LM's
loop, the graph runtime at its seam) with a corrupted CUDA graph. Run under torchrun with
pretrain_gpt.py's flags (local layer graphs).

At the start of training iteration ``$CORRUPT_GRAPH_FROM`` (past the capture iteration) the
first layer's captured forward graphs are corrupted: after every replay, fixed noise is added
to the graph's static output buffer, on the replay's stream, as another graph writing into
that buffer would leave it. Eager runs of the layer are untouched.

The hook: a listener of the run's `GraphRuntimeSchedule` (the seam pretrain.PackedGraphRun
wraps around megatron-core's schedule), told when each training iteration closes (after its
optimizer step), so the corruption lands between iteration ``$CORRUPT_GRAPH_FROM - 1`` and the
next.
"""

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import pretrain_gpt  # noqa: E402
from megatron.packed_training import pretrain  # noqa: E402


class NoisyReplay:
    """A captured graph whose static output buffer gets ``noise`` added after each replay."""

    def __init__(self, graph, buffer: torch.Tensor):
        self.graph, self.buffer = graph, buffer
        generator = torch.Generator(device=buffer.device).manual_seed(0)  # not the run's RNG
        self.noise = torch.randn(buffer.shape, generator=generator, device=buffer.device,
                                 dtype=torch.float32).to(buffer.dtype)

    def replay(self):
        self.graph.replay()
        self.buffer.add_(self.noise)

    def __getattr__(self, name):
        return getattr(self.graph, name)


def main():
    corrupt_from = int(os.environ["CORRUPT_GRAPH_FROM"])
    chunks = []

    def provider(*args, **kwargs):
        model = pretrain_gpt.model_provider(*args, **kwargs)
        chunks.append(model)
        return model

    def corrupt(iteration):
        manager = chunks[0].decoder.layers[0].cudagraph_manager
        runners = [r for r in manager.cudagraph_runners if r.fwd_graph is not None]
        if not runners:
            raise RuntimeError(f"no captured graph of layer 1 at iteration {iteration}")
        for runner in runners:
            runner.fwd_graph = NoisyReplay(runner.fwd_graph, runner.fwd_graph_output_surface[0])
        print(f" corrupted {len(runners)} captured forward graph(s) of layer 1 at iteration "
              f"{iteration}", flush=True)

    class RunWithHook(pretrain.PackedGraphRun):
        """The run's graph set-up, with a listener on every seam it wraps."""

        def __call__(self, model, optimizer, scheduler):
            self.closed = self.args.iteration  # training iterations done (a loaded checkpoint's)
            return super().__call__(model, optimizer, scheduler)

        def wrap(self, schedule):
            seam = super().wrap(schedule)
            seam.listeners.append(self.hook)
            return seam

        def hook(self, split, stats, losses):
            if split != "train":
                return
            self.closed += 1
            if self.closed + 1 == corrupt_from:  # before the next iteration starts
                corrupt(corrupt_from)

    pretrain.PackedGraphRun = RunWithHook  # run_pretraining looks it up at call time
    pretrain.run_pretraining("gpt", provider, "health_check_worker.py")


if __name__ == "__main__":
    main()
