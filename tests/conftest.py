import os

import pytest

from tests.harness import shutdown_pools
from tests.harness.procs import FRESH_ENV
from tests.harness.state import reset_module_state


def pytest_addoption(parser):
    parser.addoption(
        "--fresh", action="store_true",
        help="start every test process (pooled ranks, programs, RPC workers) as a fresh "
        "interpreter instead of forking it from the harness's forkserver (docs/testing.md)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: long multi-launcher or fault-injection runs (and the RPC suite's second "
        "channel); left out of the default run by pyproject's addopts, run by `pytest -m slow` "
        "(CI runs both)")
    config.addinivalue_line(
        "markers", "examples: every examples/*.py run under `shardwise run` (minutes on two "
        "cores); left out of the default run by pyproject's addopts, run by `pytest -m examples`")
    config.addinivalue_line(
        "markers", "fresh: one test per way of starting processes, which CI also runs with "
        "`pytest --fresh -m fresh` (every process a fresh interpreter, docs/testing.md)")
    if config.getoption("--fresh"):
        os.environ[FRESH_ENV] = "1"  # before any process starts; inherited by all of them


@pytest.fixture(scope="session", autouse=True)
def _stop_rank_pools():
    yield
    shutdown_pools()


@pytest.fixture(autouse=True)
def _reset_module_state():
    """Warn-once sets emptied before each test, as the pooled ranks do (harness/state.py)."""
    reset_module_state()

