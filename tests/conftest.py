import pytest

from tests.harness import shutdown_pools


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: long multi-launcher or fault-injection runs (and the RPC suite's second "
        "channel); left out of the default run by pyproject's addopts, run by `pytest -m slow` "
        "(CI runs both)")


@pytest.fixture(scope="session", autouse=True)
def _stop_rank_pools():
    yield
    shutdown_pools()
