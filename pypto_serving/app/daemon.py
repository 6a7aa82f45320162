"""`pypto-serving daemon start|stop|status|restart|logs`: the server as a background process.

Receives the daemon's command line; every flag it does not know is a serve flag, checked with
the serve parser before anything starts and handed to `python -m pypto_serving` unchanged.
State: one JSON pidfile per instance (`--name`), an `Instance`; the server writes a log file.
Invariant: an instance runs only while its pidfile's pid is alive with the recorded create
time and command line, so a dead or reused pid reads as a stale pidfile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from pypto_serving.app.cli import build_parser

OK, FAILED, BAD_USAGE, STOPPED = 0, 1, 2, 3  # STOPPED: `status` only, as LSB init scripts do
STOP_GRACE_S = 20.0  # after the drain: aborted streams' last chunks, closing HTTP, the workers
KILL_WAIT_S = 10.0
POLL_S = 0.25
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for loopback
_HELP = """actions:
  start    start the server in the background; wait until /health answers 200
  stop     SIGTERM, wait for the drain (--shutdown-timeout + 20 s), then SIGKILL
  status   running (with /health), stopped, or a stale pidfile
  restart  stop, then start with the serve flags given, else those of the last start
  logs     print the log's last lines (-f: and follow it)"""
_EPILOG = """Every other flag is a serve flag (pypto-serving --help), passed to the server unchanged.
exit codes: 0 ok; 1 already running (start), not running (stop), stale pidfile (status),
the server exited or was not healthy in time (start), no log file (logs); 2 bad flags or an
unwritable pid/log path; 3 stopped (status); 130 interrupted."""


class Fail(Exception):
    """Ends the command: `message` (if any) printed as one line, `code` the exit status."""

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True, slots=True)
class Instance:
    """A pidfile's record: enough to find, check, stop and restart the server."""

    name: str
    pid: int
    create_time: float
    cmdline: list[str]
    url: str  # where a client on this machine reaches it
    log_file: str
    serve_argv: list[str]
    shutdown_timeout: float


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pypto-serving daemon", allow_abbrev=False, description=_HELP,
                                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("start", "stop", "status", "restart", "logs"))
    p.add_argument("--name", default="default", help="the instance, so several daemons can run "
                   "side by side (default: default)")
    p.add_argument("--pid-file", type=Path, default=None,
                   help="default $XDG_RUNTIME_DIR/pypto-serving/NAME.pid, else the state directory")
    p.add_argument("--log-file", type=Path, default=None,
                   help="default ~/.local/state/pypto-serving/NAME.log ($XDG_STATE_HOME)")
    p.add_argument("--wait-timeout", type=float, default=600.0,
                   help="start: seconds to wait for /health 200 before giving up (default 600)")
    p.add_argument("-n", "--lines", type=int, default=40,
                   help="logs, and a failed start: log lines shown (default 40)")
    p.add_argument("-f", "--follow", action="store_true", help="logs: keep printing new lines")
    return p


def _state_dir() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "pypto-serving"


def default_pid_file(name: str) -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return (Path(runtime) / "pypto-serving" if runtime else _state_dir()) / f"{name}.pid"


def default_log_file(name: str) -> Path:
    return _state_dir() / f"{name}.log"


def _pid_file(opts: argparse.Namespace) -> Path:
    if not _NAME.fullmatch(opts.name):
        raise Fail(BAD_USAGE, f"--name {opts.name!r}: use letters, digits, '.', '_' and '-'")
    return (opts.pid_file or default_pid_file(opts.name)).absolute()


def _serve_args(argv: list[str]) -> argparse.Namespace:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # the serve parser printed why (or its --help, --version)
        raise Fail(BAD_USAGE if exc.code else OK) from None
    if args.prompt:
        raise Fail(BAD_USAGE, "--prompt is offline mode: a daemon serves HTTP")
    return args


def _writable(path: Path, flag: str) -> None:
    """Fails at once, before any model loads, where `path` cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if flag == "--log-file":
            open(path, "ab").close()
            return
        fd, probe = tempfile.mkstemp(dir=path.parent)  # the pidfile is replaced, not opened
        os.close(fd)
        os.unlink(probe)
        if path.is_dir():
            raise IsADirectoryError(f"is a directory: {path}")
    except OSError as exc:
        raise Fail(BAD_USAGE, f"{flag} {path}: cannot write there ({exc})") from None


def _write(path: Path, instance: Instance) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(instance), f)
    os.replace(tmp, path)  # a reader never sees half a record


def _read(path: Path) -> Instance | None:
    """The pidfile's record; None without a pidfile; one that cannot be read is stale (pid 0)."""
    try:
        return Instance(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        return Instance("?", 0, 0.0, [], "", "", [], 0.0)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _process(instance: Instance) -> psutil.Process | None:
    """The live server, or None where the pid is gone, a zombie, or now another process."""
    if instance.pid <= 0:  # an unreadable pidfile
        return None
    try:
        proc = psutil.Process(instance.pid)
        same = abs(proc.create_time() - instance.create_time) < 1.0 and proc.cmdline() == instance.cmdline
        return proc if same and _alive(proc) else None
    except psutil.Error:
        return None


def _wait_gone(procs: list[psutil.Process], timeout: float) -> bool:
    """Polls: a process that is not our child cannot be waited for (and may stay a zombie)."""
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _health(url: str) -> str:
    """`ok`, or why not: the HTTP status and body, or the connection error."""
    try:
        with _DIRECT.open(url + "/health", timeout=5) as reply:
            return "ok" if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code} {exc.read().decode(errors='replace').strip()}"
    except (OSError, ValueError) as exc:
        return f"unreachable ({getattr(exc, 'reason', exc)})"


def _url(args: argparse.Namespace) -> str:
    host = _LOOPBACK.get(args.host, args.host)
    return f"http://[{host}]:{args.port}" if ":" in host else f"http://{host}:{args.port}"


def _port_free(args: argparse.Namespace) -> None:
    """A port in use fails now, not after minutes of model load."""
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:
        socket.create_server((args.host, args.port), family=family).close()
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise Fail(FAILED, f"cannot listen on {args.host}:{args.port}: {why}") from None


def _tail(path: Path, n: int, start: int = 0) -> tuple[list[str], int]:
    """The last `n` lines after byte `start`, read back from the end in blocks; and that end."""
    with open(path, "rb") as f:
        end = pos = f.seek(0, os.SEEK_END)
        data = b""
        while pos > start and data.count(b"\n") <= n:
            pos = max(start, pos - (1 << 16))
            f.seek(pos)
            data = f.read(end - pos)
    return (data.decode(errors="replace").splitlines()[-n:] if n > 0 else []), end


def _spawn(name: str, cmd: list[str], log_file: Path) -> tuple[subprocess.Popen, int]:
    """The server in a session of its own, writing to the log; and where this run's lines begin."""
    with open(log_file, "ab") as log:
        offset = log.seek(0, os.SEEK_END)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        log.write(f"--- {stamp} pypto-serving daemon start {name}: {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, offset


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> str | None:
    """None once /health answers 200; else why the start failed."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if _health(url) == "ok" and proc.poll() is None:
            return None
        if time.monotonic() > deadline:
            return f"/health did not answer 200 within {timeout:g} s (--wait-timeout)"
        time.sleep(POLL_S)
    return f"the server exited with status {proc.returncode} during start"


def start(opts: argparse.Namespace, argv: list[str], log_file: Path | None = None) -> int:
    pid_file, args = _pid_file(opts), _serve_args(argv)
    log_file = (opts.log_file or log_file or default_log_file(opts.name)).absolute()
    _writable(pid_file, "--pid-file")
    _writable(log_file, "--log-file")
    old = _read(pid_file)
    if old is not None and _process(old) is not None:
        raise Fail(FAILED, f"{opts.name} is already running: pid {old.pid}, {old.url} (pid file {pid_file})")
    if old is not None:
        pid_file.unlink(missing_ok=True)
        print(f"removed the stale pid file {pid_file} (pid {old.pid} is not running)")
    _port_free(args)
    cmd = [sys.executable, "-m", "pypto_serving", *argv]
    proc, offset = _spawn(opts.name, cmd, log_file)
    ps = psutil.Process(proc.pid)  # its cmdline can still read empty while exec completes
    instance = Instance(opts.name, proc.pid, ps.create_time(), cmd, _url(args), str(log_file), argv,
                        args.shutdown_timeout)
    _write(pid_file, instance)
    print(f"starting {opts.name}: pid {proc.pid}, waiting for {instance.url}/health (log {log_file})",
          flush=True)
    why = _wait_ready(proc, instance.url, opts.wait_timeout)
    if why is not None:
        _terminate(ps, instance.shutdown_timeout)
        pid_file.unlink(missing_ok=True)
        print(f"pypto-serving daemon: error: {why}; last log lines ({log_file}):", file=sys.stderr)
        print("\n".join(_tail(log_file, opts.lines, offset)[0]), file=sys.stderr)
        return FAILED
    print(f"{opts.name} is running: pid {proc.pid}\nurl: {instance.url}\nlog: {log_file}\n"
          f"pid file: {pid_file}")
    return OK


def _terminate(proc: psutil.Process, shutdown_timeout: float) -> bool:
    """SIGTERM, the drain, then SIGKILL to its process group; True when SIGTERM sufficed."""
    try:
        procs = [proc, *proc.children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
    except psutil.Error:
        return True
    if _wait_gone(procs, shutdown_timeout + STOP_GRACE_S):
        return True
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session and group: the device workers too
    except OSError:  # gone meanwhile
        pass
    _wait_gone(procs, KILL_WAIT_S)
    return False


def stop(opts: argparse.Namespace) -> int:
    pid_file = _pid_file(opts)
    instance = _read(pid_file)
    proc = None if instance is None else _process(instance)
    if instance is None or proc is None:
        if instance is not None:
            pid_file.unlink(missing_ok=True)
        raise Fail(FAILED, f"{opts.name} is not running{' (removed its stale pid file)' if instance else ''}")
    print(f"stopping {opts.name}: pid {instance.pid} (draining up to {instance.shutdown_timeout:g} s)",
          flush=True)
    graceful = _terminate(proc, instance.shutdown_timeout)
    pid_file.unlink(missing_ok=True)
    print(f"{opts.name} stopped" + ("" if graceful else " (killed: it did not exit after SIGTERM)"))
    return OK


def status(opts: argparse.Namespace) -> int:
    pid_file = _pid_file(opts)
    instance = _read(pid_file)
    if instance is None:
        print(f"{opts.name}: stopped")
        return STOPPED
    if _process(instance) is None:
        print(f"{opts.name}: stale pid file {pid_file} (pid {instance.pid} is not running)")
        return FAILED
    print(f"{opts.name}: running, pid {instance.pid}, {instance.url}, health {_health(instance.url)}\n"
          f"log: {instance.log_file}")
    return OK


def restart(opts: argparse.Namespace, argv: list[str]) -> int:
    instance = _read(_pid_file(opts))
    argv = argv or (instance.serve_argv if instance is not None else [])
    _serve_args(argv)  # a bad new flag leaves the running server alone
    if instance is not None and _process(instance) is not None:
        stop(opts)
    recorded = Path(instance.log_file) if instance is not None and instance.log_file else None
    return start(opts, argv, recorded)


def logs(opts: argparse.Namespace) -> int:
    instance = _read(_pid_file(opts))
    recorded = instance.log_file if instance is not None and instance.log_file else None
    path = opts.log_file or Path(recorded or default_log_file(opts.name))
    if not path.is_file():
        raise Fail(FAILED, f"no log file at {path}")
    lines, end = _tail(path, opts.lines)
    print("\n".join(lines), flush=True)
    with open(path, "rb") as f:
        f.seek(end)  # a line written meanwhile is followed, not lost
        while opts.follow:  # until Ctrl-C
            chunk = f.read()
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
            time.sleep(0 if chunk else POLL_S)
    return OK


def _run(opts: argparse.Namespace, rest: list[str]) -> int:
    if rest and opts.action not in ("start", "restart"):
        raise Fail(BAD_USAGE, f"{opts.action} takes no serve flags: {shlex.join(rest)}")
    match opts.action:
        case "start":
            return start(opts, rest)
        case "stop":
            return stop(opts)
        case "status":
            return status(opts)
        case "restart":
            return restart(opts, rest)
        case "logs":
            return logs(opts)
    raise AssertionError(f"unknown action {opts.action!r}")


def main(argv: list[str]) -> int:
    try:
        opts, rest = _parser().parse_known_args(argv)
        return _run(opts, rest)
    except SystemExit as exc:  # argparse: --help, or a bad daemon flag (already printed)
        return exc.code if isinstance(exc.code, int) else BAD_USAGE
    except Fail as exc:
        if exc.message:
            print(f"pypto-serving daemon: error: {exc.message}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:  # a start so interrupted leaves the server starting: `stop` ends it
        return 130
