"""`pypto-serving daemon`: two real server starts (start, then restart), the rest without a model."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from pypto_serving.app import daemon
from tests.e2e.server import free_port

SMALL = ["--max-model-len", "256", "--kv-cache-memory", "64MiB"]


def run_daemon(*args: str, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pypto_serving", "daemon", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def gone(procs: list[psutil.Process]) -> bool:
    return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)


def health(url: str) -> int:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/health", timeout=10) as r:
        return r.status


def record(path: Path, pid: int, **fields: object) -> None:
    body = {"name": "t", "pid": pid, "create_time": 1.0, "cmdline": ["python", "-m", "pypto_serving"],
            "url": "http://127.0.0.1:1", "log_file": "", "serve_argv": [], "shutdown_timeout": 1.0}
    path.write_text(json.dumps({**body, **fields}))


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def servers() -> list[psutil.Process]:
    """Servers a test started; any still alive at its end (a failed test) are killed."""
    procs: list[psutil.Process] = []
    yield procs
    for proc in procs:
        try:
            for p in [*proc.children(recursive=True), proc]:
                p.kill()
        except psutil.Error:  # gone, as it should be
            pass


def test_start_status_logs_restart_stop(smollm2_gguf: str, tmp_path: Path, servers: list[psutil.Process]):
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_STATE_HOME": str(tmp_path / "state")}
    port = free_port()
    serve = ["--host", "127.0.0.1", "--port", str(port), *SMALL]
    started = run_daemon("start", *serve[:2], "--name", "t", *serve[2:], env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    pid_file, log_file = tmp_path / "run/pypto-serving/t.pid", tmp_path / "state/pypto-serving/t.log"
    first = json.loads(pid_file.read_text())
    servers.append(psutil.Process(first["pid"]))
    url = f"http://127.0.0.1:{port}"
    assert first["serve_argv"] == serve and first["url"] == url
    assert all(part in started.stdout for part in (f"pid {first['pid']}", url, str(log_file)))
    assert health(url) == 200  # the server outlived the command that started it

    status = run_daemon("status", "--name", "t", env=env)
    assert status.returncode == 0 and "running" in status.stdout and "health ok" in status.stdout
    again = run_daemon("start", "--name", "t", *serve, env=env)
    assert again.returncode == 1 and "already running" in again.stderr
    assert json.loads(pid_file.read_text())["pid"] == first["pid"]
    logs = run_daemon("logs", "--name", "t", "-n", "5", env=env)
    assert logs.returncode == 0 and "Application startup complete" in logs.stdout

    old = [psutil.Process(first["pid"]), *psutil.Process(first["pid"]).children(recursive=True)]
    restarted = run_daemon("restart", "--name", "t", env=env)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    second = json.loads(pid_file.read_text())
    servers.append(psutil.Process(second["pid"]))
    assert second["pid"] != first["pid"] and second["serve_argv"] == serve and gone(old)
    assert health(url) == 200

    procs = [psutil.Process(second["pid"]), *psutil.Process(second["pid"]).children(recursive=True)]
    assert len(procs) >= 2  # the server and its device worker
    stopped = run_daemon("stop", "--name", "t", env=env)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout and "killed" not in stopped.stdout
    assert gone(procs) and not pid_file.exists()
    assert "shutdown complete" in log_file.read_text()
    assert run_daemon("status", "--name", "t", env=env).returncode == 3
    not_running = run_daemon("stop", "--name", "t", env=env)
    assert not_running.returncode == 1 and "not running" in not_running.stderr


def test_a_server_dying_during_start_fails_the_start_with_its_last_log_lines(tmp_path: Path):
    pid_file, log_file = tmp_path / "a.pid", tmp_path / "a.log"
    result = run_daemon("start", "--pid-file", str(pid_file), "--log-file", str(log_file),
                        "--model", str(tmp_path / "missing.gguf"), "--port", str(free_port()), timeout=120)
    assert result.returncode == 1
    assert "exited with status 2 during start" in result.stderr
    assert "missing.gguf': no such file or directory" in result.stderr  # the server's own last line
    assert not pid_file.exists()


@pytest.mark.parametrize("pid", ["dead", "reused"])
def test_a_stale_pidfile_is_reported_and_cleaned(tmp_path: Path, capsys: pytest.CaptureFixture, pid: str):
    pid_file = tmp_path / "a.pid"
    record(pid_file, dead_pid() if pid == "dead" else os.getpid())  # reused: this test's own pid
    opts = ["--pid-file", str(pid_file), "--log-file", str(tmp_path / "a.log")]
    assert daemon.main(["status", *opts]) == 1
    assert "stale pid file" in capsys.readouterr().out
    assert daemon.main(["start", *opts, "--model", str(tmp_path / "missing.gguf"),
                        "--port", str(free_port())]) == 1  # not "already running"
    assert "removed the stale pid file" in capsys.readouterr().out
    record(pid_file, os.getpid())
    assert daemon.main(["stop", *opts]) == 1
    assert "removed its stale pid file" in capsys.readouterr().err and not pid_file.exists()


@pytest.mark.parametrize("flag", ["--pid-file", "--log-file"])
def test_an_unwritable_path_fails_at_once(tmp_path: Path, capsys: pytest.CaptureFixture, flag: str):
    (tmp_path / "file").write_text("")
    paths = {"--pid-file": tmp_path / "a.pid", "--log-file": tmp_path / "a.log"}
    paths[flag] = tmp_path / "file" / "x"  # under a regular file: unwritable even for root
    t0 = time.monotonic()
    code = daemon.main(["start", *[str(v) for kv in paths.items() for v in kv], "--port", str(free_port())])
    assert code == 2 and time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "cannot write" in err
    assert not (tmp_path / "a.pid").exists()


@pytest.mark.parametrize("args", [["start", "--max-model-len", "0"], ["start", "--prompt", "hi"],
                                  ["start", "--bogus"], ["stop", "--port", "8000"],
                                  ["start", "--name", "a/b"], ["frobnicate"]])
def test_bad_flags_fail_in_the_foreground(tmp_path: Path, args: list[str]):
    assert daemon.main([*args, "--pid-file", str(tmp_path / "a.pid")]) == 2
    assert list(tmp_path.iterdir()) == []


def test_a_port_in_use_fails_before_the_server_starts(tmp_path: Path, capsys: pytest.CaptureFixture):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port, t0 = busy.getsockname()[1], time.monotonic()
        code = daemon.main(["start", "--pid-file", str(tmp_path / "a.pid"), "--log-file",
                            str(tmp_path / "a.log"), "--host", "127.0.0.1", "--port", str(port)])
    assert code == 1 and time.monotonic() - t0 < 5  # no model was loaded first
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    assert not (tmp_path / "a.pid").exists()


def test_stop_kills_a_server_that_ignores_sigterm(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(daemon, "STOP_GRACE_S", 0.5)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); " \
           "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    proc.stdout.readline()  # SIGTERM is ignored from here on
    assert daemon._terminate(psutil.Process(proc.pid), 0.0) is False
    assert proc.wait(5) == -signal.SIGKILL


def test_instances_have_their_own_default_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert daemon.default_pid_file("a") == tmp_path / "run/pypto-serving/a.pid"
    assert daemon.default_log_file("b") == tmp_path / "state/pypto-serving/b.log"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert daemon.default_pid_file("a") == tmp_path / ".local/state/pypto-serving/a.pid"


@contextlib.contextmanager
def sigint_not_ignored():
    """Children started inside begin with SIGINT at its default, even when this process
    inherited it ignored (a suite started as a background job, `tox &`, without job control):
    Python leaves an inherited ignored SIGINT ignored, and a child would never see Ctrl-C."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_logs_tails_and_follows(tmp_path: Path):
    log = tmp_path / "a.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    tail = run_daemon("logs", "--log-file", str(log), "-n", "2", timeout=30)
    assert tail.returncode == 0 and tail.stdout == "line 98\nline 99\n"
    with sigint_not_ignored():
        follow = subprocess.Popen([sys.executable, "-m", "pypto_serving", "daemon", "logs", "--log-file",
                                   str(log), "-n", "1", "-f"], stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(30, follow.kill)  # a follower that hangs fails the test, not the suite
    timer.daemon = True
    timer.start()
    try:
        assert follow.stdout.readline() == "line 99\n"
        with open(log, "a") as f:
            f.write("appended\n")
        assert follow.stdout.readline() == "appended\n"
    finally:
        follow.send_signal(signal.SIGINT)
    assert follow.wait(10) == 130
    timer.cancel()
    missing = run_daemon("logs", "--log-file", str(tmp_path / "none.log"), timeout=30)
    assert missing.returncode == 1 and "no log file" in missing.stderr
