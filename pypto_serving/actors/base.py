"""The smallest actor: an asyncio task draining a mailbox, one message at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, NoReturn, TypeVar

import structlog

log = structlog.get_logger()

Msg = TypeVar("Msg")
# (actor, the message it failed on, the exception): the engine treats it as its death
FaultHandler = Callable[["Actor[Any]", object, Exception], None]


class _Stop:
    pass


def log_fault(actor: Actor[Any], msg: object, exc: Exception) -> None:
    """The fault handler of an actor that belongs to no engine (tests)."""
    log.error("actor failed on a message", actor=type(actor).__name__,
              message=type(msg).__name__, exc_info=exc)


class Actor(Generic[Msg]):
    """Subclasses implement `receive` with a single `match msg:` dispatch over `Msg`.

    `tell` never blocks and never waits for a reply; replies arrive as messages.
    An exception while handling a message is a fault: `on_fault` hears of it (the engine
    makes it engine death, which ends every request) and the actor goes on receiving, so
    whoever still tells it something gets an answer.
    """

    def __init__(self, on_fault: FaultHandler = log_fault) -> None:
        self._inbox: asyncio.Queue[Msg | _Stop] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.on_fault = on_fault

    def tell(self, msg: Msg) -> None:
        self._inbox.put_nowait(msg)

    @property
    def alive(self) -> bool:
        """Started and its loop still running."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=type(self).__name__)

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._inbox.put_nowait(_Stop())
            await self._task

    async def _run(self) -> None:
        while True:
            msg = await self._inbox.get()
            if isinstance(msg, _Stop):
                return
            try:
                await self.receive(msg)
                if self._inbox.empty():
                    self.drained()
            except Exception as exc:
                self.on_fault(self, msg, exc)

    async def receive(self, msg: Msg) -> None:
        raise NotImplementedError

    def drained(self) -> None:
        """Called when the mailbox has just been emptied: work that is best done once for
        everything that arrived together (a scheduler plans one step for a wave of requests)."""


def unknown(actor: object, msg: object) -> NoReturn:
    """The default branch of every dispatch: unknown messages fail loudly."""
    raise TypeError(f"{type(actor).__name__} cannot handle {type(msg).__name__}")
