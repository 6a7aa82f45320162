"""The device-worker process: `python -m pypto_serving.worker.main FD`, or, for a
tensor-parallel rank other than 0, `python -m pypto_serving.worker.main --rank RANKSTART_JSON`.

`DeviceWorkerClient` (actors/device_client.py) starts it with one end of a socket pair as FD
and sends the encoded `WorkerConfig` as the first message; the messages are in
messages/worker.py. The server may start it before that config exists (`start_early_worker`):
it imports torch and the model runner first, then waits for the config. A plain subprocess,
not a multiprocess "spawn" child: spawning also starts multiprocess's resource-tracker
process (~17 MiB resident for the server's lifetime), which guards semaphores and shared
memory that the worker never uses.

Handshake, then one reply per request. State owned: model weights, KV cache tensors,
per-sequence sampler state, its profiler. Knows nothing of queues, HTTP or scheduling
policy; executes plans as given.
With tensor parallelism (`--tp N`) rank 0 is the process on the pipe: it forms the group
with the other ranks (parallel/group.py), hands them its config, and then every plan (its
placeholders resolved), `Idle` and `Shutdown` it receives (parallel/channel.py). The other
ranks run each plan on their part of the model and answer nothing; one that fails a step
exits, which fails rank 0's next collective: engine death, as for one worker.
Signals: ignores SIGINT and SIGTERM (a terminal's Ctrl-C or `timeout` reach the whole process
group); the API process drains requests, then sends `Shutdown`; a closed pipe also ends it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import queue
import signal
import sys
import threading

import msgspec
import structlog
from multiprocess.connection import Connection

from pypto_serving.messages.worker import (
    Idle,
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
    device_string,
)
from pypto_serving.telemetry.logs import capture_stray_output, configure_logging
from pypto_serving.telemetry.profiling import WorkerProfiler

log = structlog.get_logger()


def main() -> None:
    if sys.argv[1] == "--rank":
        _ignore_signals()
        start = msgspec.json.decode(sys.argv[2], type=RankStart)
        _die_with(start.parent_pid)
        follow(start)
        return
    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)  # a process the worker starts must not keep the pipe open
    conn = Connection(fd)
    # The server may start this process before it has a config to send (start_early_worker):
    # torch and the runner load while it reads the model's settings and builds the tokenizer.
    try:
        import pypto_serving.worker.model_runner  # noqa: F401
    except Exception:  # reported with the config's answer, when _build_runner imports it again
        pass
    try:
        config = conn.recv_bytes()
    except EOFError:  # the server went away before sending the config
        return
    worker_main(conn, config)


def worker_main(conn: object, config: bytes) -> None:
    """Entry point of the device-worker process: handshake, then one reply per request."""
    cfg = msgspec.msgpack.decode(config, type=WorkerConfig)
    _ignore_signals()
    restore = capture_stray_output() if cfg.log.format == "json" else None
    configure_logging(cfg.log.format, cfg.log.level)
    try:
        _run(conn, cfg)
    except Exception:
        log.exception("device worker failed", device=cfg.device.device)
    finally:
        if restore is not None:
            restore()


PR_SET_PDEATHSIG = 1  # prctl(2)
JOIN_FAILED = 3  # a rank's exit code when it could not reach its group's master (app/node.py)


def _die_with(parent: int) -> None:
    """SIGKILL for this process when `parent` ends (Linux), and at once if it has already:
    a rank whose node process was killed must not keep the group's collectives waiting."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != parent:
        os._exit(1)


def _ignore_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _run(conn: object, cfg: WorkerConfig) -> None:
    encoder = msgspec.msgpack.Encoder()
    try:
        runner = _build_runner(cfg)
    except Exception as exc:  # reported to the parent, which exits with the message
        conn.send_bytes(encoder.encode(WorkerFailed(f"{type(exc).__name__}: {exc}")))
        return
    freeze_loaded()
    conn.send_bytes(encoder.encode(
        WorkerReady(runner.num_blocks, runner.weight_bytes, runner.kv_cache_bytes, runner.kernels,
                    runner.activation_quantization, runner.budget.how, runner.graph_sizes)))
    from pypto_serving.backends import BACKENDS

    activities = BACKENDS[cfg.device.backend].profiler_activities
    _serve(conn, runner, encoder, WorkerProfiler(f"device-worker {cfg.device.device}", activities),
           cfg.parallel.tp)


def freeze_loaded() -> None:
    """What loading made (modules, the model) lives as long as the process: out of the cyclic
    collector's sight, a full collection during a step walks only what steps made (it took
    ~3% of a prefill's time walking torch's and the model's objects). The price: a frozen
    object that later becomes cyclic garbage is never freed; the runner keeps its model,
    caches and kernels for the process's life, so only load-time leftovers could be."""
    gc.collect()
    gc.freeze()


def _build_runner(cfg: WorkerConfig, rank: int = 0, device: str = "") -> object:
    """Rank 0 forms its group (if it has one) and hands the other ranks its config; another
    rank's group has formed already (`device`: its own)."""
    from pypto_serving.worker.model_runner import ModelRunner  # torch only in this process

    if cfg.parallel.tp == 1:
        return ModelRunner(cfg)
    from pypto_serving.parallel import channel, group

    if rank == 0:
        group.join(cfg.parallel, 0)
        channel.send(msgspec.msgpack.encode(cfg))
    ranks = group.RankGroup(cfg.parallel, rank, cfg.device.backend)
    return ModelRunner(cfg, ranks.tensor_parallel(), ranks.min, device)


def _on_this_node(cfg: WorkerConfig, start: RankStart) -> WorkerConfig:
    """Rank 0's config, with the model where this node has it."""
    if not start.model_path:
        return cfg
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=start.model_path))


def follow(start: RankStart) -> None:
    """A tensor-parallel rank other than 0: joins the group, takes rank 0's config, then runs
    every plan rank 0 hands on, until `Shutdown` or rank 0's end."""
    configure_logging(start.log.format, start.log.level)
    from pypto_serving.parallel import channel, group

    try:
        group.join(start.parallel, start.rank)
    except group.GroupError as exc:
        log.error("tensor-parallel rank could not join its group", rank=start.rank, error=str(exc))
        sys.exit(JOIN_FAILED)
    try:
        cfg = _on_this_node(msgspec.msgpack.decode(channel.receive(), type=WorkerConfig), start)
        runner = _build_runner(cfg, start.rank, device_string(cfg.device.backend,
                                                              start.parallel.device_of(start.rank)))
    except Exception as exc:  # rank 0 sees the group fail, and says so
        log.error("tensor-parallel rank could not start", rank=start.rank,
                  error=f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    freeze_loaded()
    decoder = msgspec.msgpack.Decoder(StepPlan | Idle | Shutdown)
    try:
        while not isinstance(msg := decoder.decode(channel.receive()), Shutdown):
            if isinstance(msg, Idle):
                runner.idle()
            else:
                runner.execute(msg)
    except Exception:  # a failed step (or rank 0 gone): this rank's end fails the group's collectives
        log.exception("tensor-parallel rank stopped", rank=start.rank)
        sys.exit(1)


IDLE_AFTER_S = 1.0  # a worker this long without a step plan counts as idle


def _serve(conn: object, runner: object, encoder: msgspec.msgpack.Encoder,
           profiler: WorkerProfiler, tp: int = 1) -> None:
    """`tp`: the ranks of this worker's tensor-parallel group (1: no group)."""
    inbox = _reader(conn)
    idle = True
    ranks = _Ranks(runner, encoder, tp)
    while True:
        try:
            msg = inbox.get(timeout=None if idle else IDLE_AFTER_S)
        except queue.Empty:
            runner.idle()  # no step for a while: hand back what the last ones kept
            ranks.hand_on(Idle())
            idle = True
            continue
        if msg is None:  # the parent is gone: leave no orphan behind
            ranks.hand_on(Shutdown())
            return
        if isinstance(msg, Exception):
            raise msg
        idle = idle and not isinstance(msg, StepPlan)
        match msg:
            case StepPlan():
                reply = _execute(runner, ranks.hand_on(msg), profiler)
            case StartProfile(levels, prefix):
                profiler.start(levels, prefix)
                continue
            case StopProfile():
                reply = ProfileStopped(profiler.stop())
            case Shutdown():
                ranks.hand_on(msg)
                return
            case _:
                raise TypeError(f"device worker cannot handle {type(msg).__name__}")
        try:
            conn.send_bytes(encoder.encode(reply))
        except OSError:
            return


class _Ranks:
    """The other ranks of rank 0's tensor-parallel group (none without one)."""

    def __init__(self, runner: object, encoder: msgspec.msgpack.Encoder, size: int) -> None:
        self.runner, self.encoder, self.size = runner, encoder, size

    def hand_on(self, msg: StepPlan | Idle | Shutdown) -> StepPlan | Idle | Shutdown:
        """`msg` to every other rank; a plan with its placeholders resolved first (they do not
        sample). A rank gone makes the step's collectives fail: the step reports it."""
        if self.size == 1:
            return msg
        from pypto_serving.parallel import channel

        if isinstance(msg, StepPlan):
            msg = self.runner.resolve(msg)
        try:
            channel.send(self.encoder.encode(msg))
        except RuntimeError as exc:
            log.error("a tensor-parallel rank is gone", error=str(exc))
        return msg


def _reader(conn: object) -> queue.SimpleQueue:
    """The parent's messages, read and decoded by a thread of their own as they come: with
    async scheduling the next plan arrives while a step runs, and a parent blocked writing a
    big plan must not wait for that step (nor, writing while this process writes a big
    result, deadlock with it). Ends after `Shutdown`; None once the pipe is closed, the
    exception when a message does not decode."""
    decoder = msgspec.msgpack.Decoder(StepPlan | Shutdown | StartProfile | StopProfile)
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        try:
            while not isinstance(msg := decoder.decode(conn.recv_bytes()), Shutdown):
                inbox.put(msg)
            inbox.put(msg)
        except (EOFError, OSError):
            inbox.put(None)
        except Exception as exc:  # an undecodable message: the serving loop raises it
            inbox.put(exc)

    threading.Thread(target=read, name="pipe-reader", daemon=True).start()
    return inbox


def _execute(runner: object, plan: StepPlan, profiler: WorkerProfiler) -> StepResult:
    tokens = sum(len(s.token_ids) for s in plan.seqs)
    try:
        with profiler.recorder.span("forward", "worker", step_id=plan.step_id,
                                    seqs=len(plan.seqs), tokens=tokens):
            return runner.execute(plan)
    except Exception as exc:
        log.exception("step failed", step_id=plan.step_id)
        return StepResult(plan.step_id, [], [], error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
