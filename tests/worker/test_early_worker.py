"""A device worker started before its config exists (`start_early_worker`, which the server
calls while it reads the model's settings and builds the tokenizer): it loads torch and the
model runner meanwhile, and the first client to start takes it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pypto_serving.actors import device_client
from pypto_serving.actors.device_client import (
    DeviceWorkerClient,
    drop_early_worker,
    free_port,
    start_early_worker,
)
from tests.worker.tiny_models import worker_config

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/PID/maps")


def _maps_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


async def test_an_early_worker_loads_torch_before_its_config_and_serves_the_first_client(checkpoint) -> None:
    path, _ = checkpoint("llama")
    start_early_worker()
    start_early_worker()  # a second call keeps the one already started
    assert len(device_client._early) == 1
    process = device_client._early[0][0]
    deaths: list[str] = []
    first = second = None
    try:
        deadline = time.monotonic() + 120
        while not _maps_torch(process.pid):  # no config has been sent yet
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        first = DeviceWorkerClient(worker_config(path), lambda result: None, deaths.append)
        ready = await first.start()
        assert first.process is process and ready.num_blocks > 0
        second = DeviceWorkerClient(worker_config(path), lambda result: None, deaths.append)
        await second.start()  # none is left: it starts its own
        assert second.process.pid != process.pid
    finally:
        for client in (first, second):
            if client is not None and client.process is not None:
                await client.stop()
        drop_early_worker()
    assert deaths == []


CHILDREN_AFTER_MAIN = """
import sys, psutil
from pypto_serving.app.cli import main
code = main(sys.argv[1:])
print(code, len(psutil.Process().children(recursive=True)))
"""


def test_a_start_that_fails_ends_the_early_worker(tmp_path: Path) -> None:
    """In a process of its own: main() sets up logging on the stderr it finds."""
    flags = ["--model", str(tmp_path / "missing.gguf"), "--port", str(free_port("127.0.0.1"))]
    done = subprocess.run([sys.executable, "-c", CHILDREN_AFTER_MAIN, *flags], capture_output=True, text=True,
                          timeout=120)
    assert "missing.gguf" in done.stderr  # it got past the flags to the model
    assert done.stdout.split() == ["2", "0"], done.stderr  # exit code 2, no process left behind
