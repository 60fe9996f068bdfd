import pytest

from tests.harness import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _stop_rank_pools():
    yield
    shutdown_pools()
