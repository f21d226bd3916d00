"""Functional tests: Megatron-style cases run by ``python -m tests.functional.run``.

Not pytest tests (they train on GPUs); ``conftest.py`` keeps pytest out of here.
"""
