"""The training side of the packed-graphs fork: the command line (Megatron-LM's parser plus the
fork's flags and rules), the packed data path, the model builders, the forward step, the
library API for a framework's own loop (``rl``) and Hugging Face checkpoints (``hf``).

The training loop, checkpointing and logging are Megatron-LM's: the megatron-core wheel's
``megatron.training``, which ``pretrain.py`` calls. megatron-core ships no
``megatron.packed_training``; this package is ours. ``megatron/`` itself is a namespace portion
shared with the megatron-core wheel and has no ``__init__.py``.
"""
