"""Runs the real `pypto-serving` in a subprocess for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(["--model", ...]) as server:` then use `server.url`."""

    def __init__(self, args: list[str], startup_timeout: float = 180.0):
        self.port = free_port()
        self.args = [sys.executable, "-m", "pypto_serving", "--host", "127.0.0.1",
                     "--port", str(self.port), *args]
        self.startup_timeout = startup_timeout
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def json_records(self) -> list[dict]:
        """The output lines that are JSON log records (`--log-format json`), others skipped."""
        out = []
        for line in self.lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def __enter__(self) -> ServerProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))
        return self

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "Application startup complete" in line:
                self._ready.set()

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def output(self) -> str:
        return "".join(self.lines)
