"""The main-process side of a device worker: starts its process, moves messages over its pipe.

Results, profile replies and the worker's death arrive through the event loop's reader
callbacks; see worker/main.py for the worker process and messages/worker.py for the messages.
With tensor parallelism the client also starts this node's other ranks of the group
(`start_rank`); the death of any of them is the worker's death.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import msgspec
import structlog
from multiprocess.connection import Connection

from pypto_serving.messages.worker import (
    LogConfig,
    ParallelConfig,
    ProfileStopped,
    RankStart,
    Shutdown,
    StartProfile,
    StepPlan,
    StepResult,
    StopProfile,
    WorkerConfig,
    WorkerFailed,
    WorkerReady,
)

log = structlog.get_logger()


class WorkerStartError(RuntimeError):
    pass


class DeviceWorkerClient:
    """Starts one worker process and moves plans and results over its pipe.

    Results and the worker's death are reported through callbacks on the event loop; a
    profile's fragment paths come back to the one `stop_profile()` waiting for them.
    """

    def __init__(self, cfg: WorkerConfig, on_result: Callable[[StepResult], None],
                 on_death: Callable[[str], None]):
        self.cfg = cfg
        self._on_result = on_result
        self._on_death = on_death
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepResult | ProfileStopped)
        self._conn = None
        self.process: subprocess.Popen | None = None  # rank 0: the one on the pipe
        self.ranks: list[subprocess.Popen] = []  # this node's other tensor-parallel ranks
        self._sentinel: int | None = None  # a pidfd: readable once the process has exited
        self._rank_sentinels: list[int] = []
        self._stopping = False
        self._gone = False
        self._profile_reply: asyncio.Future | None = None

    async def start(self) -> WorkerReady:
        parallel = self.cfg.parallel
        if parallel.tp > 1 and parallel.master_port == 0:
            parallel = msgspec.structs.replace(parallel, master_port=free_port(parallel.master_addr))
            self.cfg = msgspec.structs.replace(self.cfg, parallel=parallel)
        self.process, self._conn = _take_early_worker() or _spawn_worker()
        # The worker ignores SIGTERM; an exit that skipped stop() must not leave it behind.
        atexit.register(self.kill)
        self._sentinel = _pidfd(self.process.pid)
        self.ranks = [start_rank(r, parallel, self.cfg.log) for r in parallel.local_ranks[1:]]
        self._rank_sentinels = [fd for p in self.ranks if (fd := _pidfd(p.pid)) is not None]
        try:
            ready = await asyncio.get_running_loop().run_in_executor(None, self._handshake)
        except WorkerStartError:
            self.kill()
            self._close()
            raise
        loop = asyncio.get_running_loop()
        loop.add_reader(self._conn.fileno(), self._readable)
        for fd in self._sentinels:
            loop.add_reader(fd, self._exited)
        return ready

    @property
    def _sentinels(self) -> list[int]:
        return ([] if self._sentinel is None else [self._sentinel]) + self._rank_sentinels

    def _close(self) -> None:
        """The pipe and the pidfd of a worker that is gone."""
        if self._conn.closed:
            return
        self._conn.close()
        for fd in self._sentinels:
            os.close(fd)
        self._sentinel, self._rank_sentinels = None, []

    @property
    def _processes(self) -> list[subprocess.Popen]:
        return ([] if self.process is None else [self.process]) + self.ranks

    def _alive(self) -> bool:
        return any(p.poll() is None for p in self._processes)

    def _join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self._processes:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def _handshake(self) -> WorkerReady:
        """Sends the config (megabytes with a tokenizer: it blocks until the worker reads it,
        hence here, off the event loop) and waits for the worker to load the model."""
        try:
            self._conn.send_bytes(self._encoder.encode(self.cfg))
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            self._join(5)
            raise WorkerStartError(f"device worker exited with code {self.process.returncode} "
                                   "before it was ready") from None
        msg = msgspec.msgpack.decode(data, type=WorkerReady | WorkerFailed)
        if isinstance(msg, WorkerFailed):
            self._join(5)
            raise WorkerStartError(msg.message)
        return msg

    def send(self, plan: StepPlan) -> None:
        self._send(plan)

    def _send(self, msg: msgspec.Struct) -> bool:
        if self._gone or self._stopping:  # its death (or stop) was handled once already
            return False
        try:
            self._conn.send_bytes(self._encoder.encode(msg))
        except (BrokenPipeError, OSError) as exc:
            self._on_death(f"device worker pipe closed: {exc}")
            return False
        return True

    def start_profile(self, levels: list[str], prefix: str) -> None:
        self._send(StartProfile(levels, prefix))

    async def stop_profile(self, timeout: float = 120.0) -> list[str]:
        """The worker's fragment paths; none when it is gone or does not answer in time."""
        if self._gone:
            return []
        self._profile_reply = asyncio.get_running_loop().create_future()
        if not self._send(StopProfile()):
            return []
        try:
            return await asyncio.wait_for(self._profile_reply, timeout)
        except TimeoutError:
            log.warning("device worker did not return its profile", device=self.cfg.device.device)
            return []

    def _readable(self) -> None:
        try:
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            self._exited()
            return
        match self._decoder.decode(data):
            case StepResult() as result:
                self._on_result(result)
            case ProfileStopped(paths):
                self._answer_profile(paths)

    def _answer_profile(self, paths: list[str]) -> None:
        if self._profile_reply is not None and not self._profile_reply.done():
            self._profile_reply.set_result(paths)

    def _exited(self) -> None:
        if self._gone:
            return
        self._gone = True
        # Who had ended when the first end was seen, before the pipe closes: rank 0 exits when
        # it does, and a rank that died first must still be the one named.
        dead = self._first_dead(0.1)
        self._answer_profile([])
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._conn.fileno())
        for fd in self._sentinels:
            loop.remove_reader(fd)
        self._close()
        if not self._stopping:
            self._on_death(self._death_reason(dead))

    def _first_dead(self, timeout: float) -> list[subprocess.Popen]:
        """The processes that have ended; waits up to `timeout` for one (a closed pipe can be
        seen a moment before its process can be reaped)."""
        deadline = time.monotonic() + timeout
        while True:
            dead = [p for p in self._processes if p.poll() is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.005)

    def _death_reason(self, dead: list[subprocess.Popen]) -> str:
        device = self.cfg.device.device
        if self.process in dead or not self.ranks:
            return f"device worker {device} died (exit code {self.process.returncode})"
        gone = [(r, p.returncode) for r, p in enumerate(self.ranks, 1) if p in dead]
        rank, code = gone[0] if gone else (0, None)
        return f"tensor-parallel rank {rank} of device worker {device} died (exit code {code})"

    def kill(self) -> None:
        """At once, without waiting (a second shutdown signal)."""
        for p in self._processes:
            if p.poll() is None:
                p.kill()

    async def stop(self, timeout: float = 5.0) -> None:
        """Asks the worker to exit, then makes sure it did."""
        self._stopping = True
        atexit.unregister(self.kill)
        if not self._alive():
            return
        try:
            self._conn.send_bytes(self._encoder.encode(Shutdown()))
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        while self._alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._alive():
            self.kill()
        self._join(1)


def _spawn_worker() -> tuple[subprocess.Popen, Connection]:
    """A worker process and this end of its pipe; it waits there for its config."""
    ours, theirs = socket.socketpair()
    conn = Connection(ours.detach())
    child = theirs.detach()
    try:
        process = subprocess.Popen([sys.executable, "-P", "-m", "pypto_serving.worker.main", str(child)],
                                   pass_fds=(child,), env=_child_env(), stdin=subprocess.DEVNULL)
    except BaseException:
        conn.close()
        raise
    finally:
        os.close(child)
    return process, conn


_early: list[tuple[subprocess.Popen, Connection]] = []  # at most one


def start_early_worker() -> None:
    """Starts a worker process now, before its config can be known: it imports torch and the
    model runner (~1.3 s) while this process reads the model's settings and builds its
    tokenizer. The first `DeviceWorkerClient.start` takes it; `drop_early_worker` ends one
    that none took."""
    if not _early:
        _early.append(_spawn_worker())


def _take_early_worker() -> tuple[subprocess.Popen, Connection] | None:
    return _early.pop() if _early else None


def drop_early_worker() -> None:
    """Ends a worker started early that no client took (startup failed): it holds nothing yet."""
    while _early:
        process, conn = _early.pop()
        process.kill()
        process.wait()
        conn.close()


def start_rank(rank: int, parallel: ParallelConfig, log_config: LogConfig,
               model_path: str = "") -> subprocess.Popen:
    """Tensor-parallel rank `rank` (not 0) of a group: it joins rank 0 at the master address
    and takes the rest of its config from there. It dies with this process."""
    start = RankStart(rank, parallel, log_config, model_path, parent_pid=os.getpid())
    return subprocess.Popen([sys.executable, "-P", "-m", "pypto_serving.worker.main", "--rank",
                             msgspec.json.encode(start).decode()], env=_child_env(), stdin=subprocess.DEVNULL)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    """The child imports exactly what this process would: its sys.path, and (-P) no current
    directory in front of it."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def _pidfd(pid: int) -> int | None:
    """An fd that turns readable when the process exits (Linux 5.3+). Without one, the
    worker's death still shows as the end of its socket."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
