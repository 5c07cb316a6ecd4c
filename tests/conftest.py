import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def pytest_configure(config):
    """Under pytest-xdist, each worker's torch takes its share of the cores (not all of them each),
    unless OMP_NUM_THREADS says otherwise; tests that need a thread count set their own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


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


@pytest.fixture(scope="session")
def one_step_smoke_run(tmp_path_factory) -> Path:
    """A run directory of the smoke recipe trained for one step (state.pt, tokenizer, config)."""
    from dataclasses import replace

    from hybridkv.train.loop import train
    from hybridkv.train.recipes import get_recipe

    run = tmp_path_factory.mktemp("smoke-one-step")
    train(replace(get_recipe("smoke"), steps=1, log_every=1), run, echo=lambda *_: None)
    return run


@pytest.fixture(scope="session")
def warm_start_indexer(fixtures, tmp_path_factory):
    """A memory indexer for the v4-tiny fixture: the warm start from its native indexers."""
    from hybridkv.memory.indexer import MemoryIndexer
    from hybridkv.train.export import float_model

    return MemoryIndexer.from_native(float_model(fixtures / "v4-tiny")).save(tmp_path_factory.mktemp("mi"))
