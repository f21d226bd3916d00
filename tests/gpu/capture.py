"""Capture a test's step in a CUDA graph the way the graph engines do, for tests that check
a module captures without host syncs and replays other documents."""

import torch


def capture_without_host_sync(step, warmup: int = 2):
    """Run ``step()`` ``warmup`` times on a side stream (cuDNN plans, workspaces, lazily built
    tables), then capture one call in a CUDA graph with every RNG generator of megatron-core's
    tracker registered (TE's fused attention advances its offset) and host syncs raising.

    Returns ``(graph, outputs)``: ``outputs`` is what the captured call returned, in the
    graph's static memory (each ``graph.replay()`` rewrites it)."""
    from megatron.core.tensor_parallel.random import get_all_rng_states

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for state in get_all_rng_states().values():
        graph.register_generator_state(state)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            outputs = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return graph, outputs


def seam_replay_makes_no_host_sync(argv: list, kind: str, with_padding_mask: bool = False):
    """Capture local layer graphs of ``kind``'s model (``argv``: Megatron-LM flags with a
    capacity of 32 and one warm-up iteration) through the training loop's seam, then run one
    more packed micro-batch's forward and backward with host syncs raising. Returns its loss.
    ``with_padding_mask``: the micro-batch carries the padding mask (MoE routers read it)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord, delete_cuda_graphs
    from megatron.core.transformer.module import Float16Module
    from megatron.training.training import get_megatron_ddp_config

    import pretrain_gpt
    import pretrain_mamba
    from megatron.packed_upstream.patches import apply_core_patches
    from megatron.packed_graphs.runtime import GraphRuntime
    from megatron.packed_graphs.schedule import GraphRuntimeSchedule
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import (
        graph_settings_from_args,
        transformer_config_from_args,
    )
    from megatron.packed_training.datasets.mock import MockPackedDataset
    from megatron.packed_training.datasets.packing import collate_packed_rows
    from megatron.packed_training.packed_step import (
        PackedForwardStep,
        masked_lm_loss,
        to_device_micro_batch,
    )

    module = pretrain_gpt if kind == "gpt" else pretrain_mamba
    args = parse_args(argv, model=kind)
    apply_core_patches()
    config = transformer_config_from_args(args)
    # DDP (Megatron-LM's config from the arguments): megatron-core's backward graphs
    # accumulate weight gradients into main_grad.
    model = DistributedDataParallel(
        config, get_megatron_ddp_config(args),
        Float16Module(config, module.model_provider(args, config).cuda()))
    config.no_sync_func = model.no_sync
    step = PackedForwardStep.from_args(args, with_seq_idx=kind == "hybrid")
    runtime = GraphRuntime.from_settings(graph_settings_from_args(args), [model], config)
    # The training loop's seam: megatron-core's schedule behind the runtime.
    seam = GraphRuntimeSchedule(runtime, get_forward_backward_func(),
                                stream_length=args.micro_batch_size * args.seq_length)
    data = MockPackedDataset(64, args.seq_length, args.vocab_size, seed=7, doc_length_median=128)
    batches = iter(collate_packed_rows([data[i]]) for i in range(64))
    for _ in range(2):  # one eager warm-up iteration, then the capture iteration
        seam(forward_step_func=step, data_iterator=batches, model=[model], num_microbatches=2)
        seam.close_iteration()  # no optimizer step here
    assert _CudagraphGlobalRecord.cudagraph_created and runtime.captured == {(1, 32)}
    mb = to_device_micro_batch(next(batches), with_seq_idx=kind == "hybrid",
                               static_max_seqlen=True, capacity=32,
                               with_padding_mask=with_padding_mask)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        output = model(mb.tokens, mb.position_ids, None, labels=mb.labels,
                       packed_seq_params=mb.params)
        loss, _, _ = masked_lm_loss(mb.loss_mask, output)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    delete_cuda_graphs()
    return loss
