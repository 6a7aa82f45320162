"""Graceful shutdown on SIGTERM/SIGINT; a second signal exits at once.

Order: stop taking requests (503), let in-flight ones finish within the timeout, abort the
rest (finish reason `aborted`), stop and merge a running profile, close the HTTP server,
stop the actors and the device workers (which leaves no child process behind).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import structlog
from aiohttp import web

from pypto_serving.actors.replicas import ReplicaSet
from pypto_serving.http.ops import Ops

log = structlog.get_logger()
ABORT_GRACE_S = 10.0  # aborted streams still send their last chunk


class ShutdownSignals:
    """Installed on the running loop; `on_force` runs before a second signal's exit."""

    def __init__(self, on_force: Callable[[], None]):
        self.on_force = on_force
        self._event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._received, sig)

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()

    def _received(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if not self._event.is_set():
            log.info("shutdown requested", signal=name)
            self._event.set()
            return
        log.warning("second signal: exiting now", signal=name)
        self.on_force()
        os._exit(128 + sig)


async def graceful_shutdown(engine: ReplicaSet, ops: Ops, runner: web.AppRunner, timeout: float) -> None:
    ops.draining = True
    log.info("shutting down: draining in-flight requests", in_flight=engine.num_in_flight,
             timeout_s=timeout)
    if not await engine.drain(timeout):
        log.warning("shutdown timeout: aborting in-flight requests", in_flight=engine.num_in_flight)
        engine.abort_all()
        await engine.drain(ABORT_GRACE_S)
    await ops.stop_recording()
    await runner.cleanup()
    await engine.shutdown()
    log.info("shutdown complete")
