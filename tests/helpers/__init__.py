"""What the tests share (no test module imports another): the spawn helper of the distributed tests, the CLI
in this process, reference implementations, plan factories, and the definitions split test files share.

Imported as ``from helpers.dist_helper import run_distributed``: tests/ is on ``sys.path`` (tests/conftest.py).
"""
