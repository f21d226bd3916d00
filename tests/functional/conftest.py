"""Nothing here is a pytest test: the cases run through ``python -m tests.functional.run``
(docs/functional-tests.md); their pure logic is tested by tests/unit/test_functional_runner.py.
"""

collect_ignore_glob = ["*"]
