from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def live_server():
    """One server for the API tests (random tiny model, tiny tokenizer, 4 concurrent requests)."""
    from serverkit import LiveServer

    server = LiveServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server for the session (installed with apt if missing), stopped afterwards."""
    from redis_server import RedisServer, ensure_installed

    binary = ensure_installed()
    if binary is None:
        pytest.skip("redis-server is not installed and cannot be installed here (needs root and apt-get)")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis Python client is missing: pip install -e '.[dev]'")
    server = RedisServer(binary, str(tmp_path_factory.mktemp("redis")))
    yield server.url
    server.stop()
