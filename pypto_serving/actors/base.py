"""The smallest actor: an asyncio task draining a mailbox, one message at a time."""

from __future__ import annotations

import asyncio

import structlog

log = structlog.get_logger()


class _Stop:
    pass


class Actor:
    """Subclasses implement `receive` with a single `match msg:` dispatch.

    `tell` never blocks and never waits for a reply; replies arrive as messages.
    An exception while handling one message is logged and does not stop the actor.
    """

    def __init__(self) -> None:
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    def tell(self, msg: object) -> None:
        self._inbox.put_nowait(msg)

    @property
    def alive(self) -> bool:
        """Started and its loop still running."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=type(self).__name__)

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self.tell(_Stop())
            await self._task

    async def _run(self) -> None:
        while True:
            msg = await self._inbox.get()
            if isinstance(msg, _Stop):
                return
            try:
                await self.receive(msg)
            except Exception:
                log.exception("actor failed on a message", actor=type(self).__name__,
                              message=type(msg).__name__)

    async def receive(self, msg: object) -> None:
        raise NotImplementedError


def unknown(actor: object, msg: object) -> None:
    """The default branch of every dispatch: unknown messages fail loudly."""
    raise TypeError(f"{type(actor).__name__} cannot handle {type(msg).__name__}")
