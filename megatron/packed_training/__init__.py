"""Training layer of the packed-graphs fork: CLI, initialisation, loop, checkpointing.

megatron-core ships no ``megatron.packed_training``; this package is ours. ``megatron/`` itself is a
namespace portion shared with the megatron-core wheel and has no ``__init__.py``.
"""
