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
