from __future__ import annotations

import pytest

from tests.e2e.server import ServerProcess


@pytest.fixture(scope="session")
def server() -> ServerProcess:
    """The default packaged model (SmolLM2-135M-Instruct), shared by the e2e tests."""
    with ServerProcess(["--max-model-len", "512", "--kv-cache-memory", "256MiB"]) as srv:
        yield srv
