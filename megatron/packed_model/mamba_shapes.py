"""The Mamba mixer's sizes from Megatron-LM's flags, as megatron-core's ``MambaMixer`` derives
them: for the parser's rules, which run before any layer exists (no torch, no megatron-core)."""


def mamba_heads(args) -> int:
    """The hybrid's Mamba heads: --mamba-num-heads, else megatron-core's default
    (2 x hidden / head dim)."""
    return args.mamba_num_heads or 2 * args.hidden_size // args.mamba_head_dim


def mamba_in_proj_width(args) -> int:
    """The Mamba input projection's output width: 2 x d_inner + 2 x groups x state + heads."""
    heads = mamba_heads(args)
    inner = heads * args.mamba_head_dim
    return 2 * inner + 2 * args.mamba_num_groups * args.mamba_state_dim + heads
