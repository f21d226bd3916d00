"""What two choices of packed MLA cost on one GPU, at moonlight-small's sizes.

* V padding: on packed (THD) data megatron-core pads V to the query head size (128 -> 192 at
  Moonlight's head dims) so that TE may pick FlashAttention; the narrower V leaves TE's cuDNN
  backend. Measured: the MLA attention's forward + backward with and without the padding
  (``PackedMLASelfAttention.pad_value``; ``--mla-pad-v never`` trains without it).
* The fused RoPE scan: each row of the fused MLA RoPE kernels walks every ``cu_seqlens``
  entry (capacity + 2 with the tail segment), so its cost grows with the graph capacity.
  Measured: the query and key RoPE kernels, forward + backward, at each capacity, against
  the same documents with no capacity padding.

Both are reported per layer and as a share of one whole layer's forward + backward (MLA + MoE),
an upper bound of their share of a training step (embedding, loss and optimizer only add to
the step). Prints a Markdown table; nothing is asserted.

    python tools/mla_costs.py --capacities 16 64 128 256

``MOONLIGHT_SMALL`` is tools/benchmark.py's ``moonlight-small`` preset (Moonlight-16B-A3B's
ratios at hidden 1024 and 8 layers, docs/mla.md) with TE's grouped-GEMM experts.
"""

import argparse
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(REPO, "tools") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "tools"))
from benchmark import (  # noqa: E402  (the preset's one definition)
    FORK_NUMERICS,
    GROUPED_GEMM,
    PRESETS,
)

MOONLIGHT_SMALL = PRESETS["moonlight-small"][1] + GROUPED_GEMM
# Megatron-LM's command line of one training step on mock data, with the old fork's defaults
# the preset was measured with (RMSNorm, no biases, no dropout, ...).
TRAINING = ["--sft", "--mock-data", "--bf16", "--lr", "1e-4", "--train-iters", "1",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--vocab-size", "32000",
            "--eval-iters", "0", *FORK_NUMERICS]


def document_lengths(total: int, documents: int) -> list:
    """``documents`` lengths summing to ``total``, the last one the remainder (the packer's
    padding tail is a segment too)."""
    if not 1 <= documents <= total:
        raise ValueError(f"documents is wrong: {documents}. Use 1 to {total}.")
    base = total // documents
    return [base] * (documents - 1) + [total - base * (documents - 1)]


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--capacities", type=int, nargs="+", default=[16, 64, 128, 256],
                        help="Graph capacities (cu_seqlens entries - 1) to time the RoPE at.")
    parser.add_argument("--documents", type=int, default=8,
                        help="Documents in the micro-batch (the no-padding baseline's segments).")
    parser.add_argument("--seq-length", type=int, default=4096, help="Rows per micro-batch.")
    parser.add_argument("--iters", type=int, default=20, help="Timed repetitions (median).")
    args = parser.parse_args(argv)
    if min(args.capacities) < args.documents:
        parser.error(f"--capacities must be >= --documents ({args.documents})")
    return args


def _time_ms(fn, iters: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(args) -> list:
    """Rows of (what, ms per layer, share of the layer's forward + backward)."""
    import torch

    sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.fusions.fused_mla_yarn_rope_apply import (
        fused_apply_mla_rope_for_kv,
        fused_apply_mla_rope_for_q,
    )
    from megatron.packed_graphs.capacity import pad_cu_seqlens
    from megatron.packed_model.mla_rope import cover_all_rows
    from megatron.packed_graphs.packed_seq import build_packed_batch_params
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import transformer_config_from_args
    from megatron.packed_training.initialize import initialize_single_gpu

    initialize_single_gpu()
    flags = MOONLIGHT_SMALL + TRAINING + ["--seq-length", str(args.seq_length),
                                          "--max-position-embeddings", str(args.seq_length),
                                          "--num-layers", "1"]
    train_args = parse_args(flags, model="gpt")
    config = transformer_config_from_args(train_args)
    layer = pretrain_gpt.model_provider(train_args, config).cuda().decoder.layers[0]
    attention = layer.self_attention
    rows, hidden = args.seq_length, config.hidden_size
    lengths = document_lengths(rows, args.documents)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def params(capacity):
        bounds = pad_cu_seqlens(cu, capacity).cuda()
        positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
        built = build_packed_batch_params(bounds, positions, rows, with_seq_idx=False)
        built.padding_mask = torch.zeros(rows, dtype=torch.bool, device="cuda")
        return built

    x = torch.randn(rows, 1, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    top = params(max(args.capacities))

    def layer_step():
        out = layer(x, None, packed_seq_params=top)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    def attention_step():
        attention(x, None, packed_seq_params=top)[0].backward(grad)

    layer_ms = _time_ms(layer_step, args.iters)
    rows_out = [("whole layer (MLA + MoE), fwd + bwd", layer_ms, 1.0)]
    attention.pad_value = True
    padded = _time_ms(attention_step, args.iters)
    rows_out.append(("MLA attention, V padded (upstream)", padded, padded / layer_ms))
    attention.pad_value = False
    try:
        narrow = _time_ms(attention_step, args.iters)
        rows_out.append(("MLA attention, V not padded", narrow, narrow / layer_ms))
        rows_out.append(("cost of V padding", padded - narrow, (padded - narrow) / layer_ms))
    except (RuntimeError, ValueError) as error:
        rows_out.append((f"MLA attention, V not padded: no TE kernel ({error})"[:120], 0.0, 0.0))
    attention.pad_value = True

    heads, qk, pe, v = (config.num_attention_heads, config.qk_head_dim,
                        config.qk_pos_emb_head_dim, config.v_head_dim)
    cos, sin = attention.rotary_pos_emb.get_cached_cos_sin(rows, dtype=torch.bfloat16,
                                                           packed_seq=True)
    q = torch.randn(rows, heads, qk + pe, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(rows, heads, qk + v, device="cuda", dtype=torch.bfloat16)
    k_pos = torch.randn(rows, 1, pe, device="cuda", dtype=torch.bfloat16)

    def rope_step(bounds):
        q_in = q.clone().requires_grad_().clone()  # a non-leaf, as in the model: rotated in place
        kv_in, k_in = kv.clone().requires_grad_(), k_pos.clone().requires_grad_()
        q_out = fused_apply_mla_rope_for_q(q_in, cos, sin, qk, pe, bounds, 0, 1)
        key, value = fused_apply_mla_rope_for_kv(kv_in, k_in, cos, sin, pe, qk, v, bounds, 0, 1)
        torch.autograd.backward([q_out, key, value], [torch.ones_like(q_out),
                                                      torch.ones_like(key),
                                                      torch.ones_like(value)])

    base = _time_ms(lambda: rope_step(cover_all_rows(cu.cuda(), rows)), args.iters)
    rows_out.append((f"fused RoPE q + kv, {args.documents} segments (no padding)", base,
                     base / layer_ms))
    for capacity in args.capacities:
        bounds = cover_all_rows(pad_cu_seqlens(cu, capacity).cuda(), rows)
        ms = _time_ms(lambda: rope_step(bounds), args.iters)
        rows_out.append((f"fused RoPE q + kv, capacity {capacity}: extra scan", ms - base,
                         (ms - base) / layer_ms))
    return rows_out


def table(rows) -> str:
    lines = ["| what | ms per layer | share of layer fwd + bwd |", "| --- | ---: | ---: |"]
    lines += [f"| {what} | {ms:.3f} | {share:.1%} |" for what, ms, share in rows]
    return "\n".join(lines)


def main(argv=None):
    args = parse(argv)
    print(table(measure(args)))


if __name__ == "__main__":
    main()
