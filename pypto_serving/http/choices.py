"""`n` choices: one engine stream per choice, merged into one stream of (index, event).

Above the engine on purpose: each choice is an ordinary request with its own sequence, so
batching, preemption and aborts need nothing new. With a seed, choice i uses seed + i, so
every choice is reproducible on its own and the choices differ from one another. A request
that only scores its prompt (`echo` with max_tokens 0) still samples one token per choice;
its streams drop it here.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

import msgspec

from pypto_serving.actors.replicas import ReplicaSet
from pypto_serving.core.request import Echo, Finished, GenerateRequest, Started, TextDelta

Event = Started | Echo | TextDelta | Finished
_SEED_SPACE = 1 << 64  # torch generators take seeds modulo 2**64


def choice_requests(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    if n == 1:
        return [request]
    return [_choice(request, i) for i in range(n)]


def _choice(request: GenerateRequest, i: int) -> GenerateRequest:
    seed = request.sampling.seed
    sampling = request.sampling if seed is None else msgspec.structs.replace(
        request.sampling, seed=(seed + i) % _SEED_SPACE)
    return dataclasses.replace(request, request_id=f"{request.request_id}-{i}", sampling=sampling)


class ChoiceStreams:
    """The event streams of one request's choices. `close()` must follow, whatever happens:
    it aborts every choice that has not finished, which frees its KV blocks."""

    def __init__(self, engine: ReplicaSet, requests: Sequence[GenerateRequest], echo_only: bool = False):
        self._streams = [engine.generate(r) for r in requests]
        self._echo_only = echo_only
        self._queue: asyncio.Queue[tuple[int, Event | BaseException]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []

    def __len__(self) -> int:
        return len(self._streams)

    async def start(self) -> list[Started]:
        """Every choice's `Started`; raises the first `InvalidRequest` if one cannot run."""
        results = await asyncio.gather(*(anext(s) for s in self._streams), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    async def events(self) -> AsyncIterator[tuple[int, Echo | TextDelta | Finished]]:
        """Events of all choices as they come, until every choice has finished."""
        loop = asyncio.get_running_loop()
        self._pumps = [loop.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        running = len(self._streams)
        while running:
            index, event = await self._queue.get()
            if isinstance(event, BaseException):
                raise event
            running -= isinstance(event, Finished)
            if self._echo_only and isinstance(event, TextDelta):
                continue
            if self._echo_only and isinstance(event, Finished) and event.finish_reason != "error":
                event = dataclasses.replace(event, finish_reason="length", completion_tokens=0)
            yield index, event

    async def _pump(self, index: int, stream: AsyncIterator[Event]) -> None:
        try:
            async for event in stream:
                self._queue.put_nowait((index, event))
        except Exception as exc:  # surfaces in events(), which would otherwise wait forever
            self._queue.put_nowait((index, exc))

    async def close(self) -> None:
        for task in self._pumps:
            task.cancel()  # a choice cancelled mid-generation aborts its sequence
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()  # the rest: those never pumped, or stopped at `Started`
