"""ReplicaSet: the data-parallel router, N replicas behind the one surface that http/, offline
mode, shutdown and the profiler use.

Each replica is an `Engine` with its own scheduler, block allocator, tokenizer actor, metrics
(`engine` label "0", "1", ...) and device group (`--dp` groups of `--tp` devices); they share
the tokenizer and the API process's span recorder. A request is routed when its stream is
first asked for an event, and the engine takes it into its count in that same step, so the
next request already sees it (`ChoiceStreams` makes every stream before it starts any). It
goes to a serving replica with the fewest pending tokens (`Engine.pending_tokens`: each held
sequence's uncomputed tokens plus the outputs it may still produce, and a guess for requests
still being tokenized); ties: the fewest requests in flight, then the replica that last took
a prompt beginning the same way (its prefix cache may still hold it), then the lowest index.
A replica that died (or restarts) is passed over while another serves: only its own requests
end with `error`. The set cannot serve (`dead_reason`, /health 503) only when no replica can.
One replica is exactly that engine.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass

from pypto_serving.actors.device_client import DeviceWorkerClient
from pypto_serving.actors.engine import Engine, EngineConfig, Event
from pypto_serving.actors.tokenizer import TokenizerActor
from pypto_serving.core.request import CHARS_PER_TOKEN, ChatInput, GenerateRequest
from pypto_serving.telemetry.metrics import ReplicaMetrics
from pypto_serving.telemetry.profiling import SpanRecorder
from pypto_serving.tokenizer.tokenizer import Tokenizer

AFFINITY_CHARS = 256  # the head of a prompt that keys prefix affinity (a few KV blocks)
AFFINITY_KEYS = 4096  # prompt heads remembered; the oldest is forgotten first


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    serving: bool
    pending_tokens: int
    in_flight: int


def pick_replica(loads: Sequence[ReplicaLoad], preferred: int | None = None) -> int:
    """The index of the replica a request goes to (the order is in the module docstring);
    with none serving, the same order over all (the request then ends as theirs do)."""
    candidates = [i for i, load in enumerate(loads) if load.serving] or range(len(loads))
    return min(candidates, key=lambda i: (loads[i].pending_tokens, loads[i].in_flight, i != preferred, i))


def prefix_key(request: GenerateRequest) -> Hashable:
    """What prompts that begin the same way have in common: their first characters, tokens
    or messages."""
    prompt = request.prompt
    if isinstance(prompt, ChatInput):
        return repr(prompt.messages)[:AFFINITY_CHARS]
    if isinstance(prompt, tuple):
        return prompt[:AFFINITY_CHARS // CHARS_PER_TOKEN]
    return prompt[:AFFINITY_CHARS]


class ReplicaSet:
    def __init__(self, engines: Sequence[Engine]):
        self.engines = list(engines)
        self.metrics = ReplicaMetrics([e.metrics for e in self.engines])
        self._affinity: OrderedDict[Hashable, int] = OrderedDict()  # prompt head -> replica

    def __len__(self) -> int:
        return len(self.engines)

    # -- what the replicas share: the model and its limits, the tokenizer, the recorder ------
    @property
    def config(self) -> EngineConfig:
        return self.engines[0].config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engines[0].tokenizer

    @property
    def recorder(self) -> SpanRecorder:
        return self.engines[0].recorder

    @property
    def tokenizer_actor(self) -> TokenizerActor:
        """A serving replica's (/tokenize, /detokenize)."""
        serving = [e for e in self.engines if e.dead_reason is None] or self.engines
        return serving[0].tokenizer_actor

    @property
    def workers(self) -> list[DeviceWorkerClient]:
        return [w for e in self.engines for w in e.workers]

    # -- health ------------------------------------------------------------------------
    def states(self) -> list[tuple[str, str | None]]:
        """(engine label, why it cannot serve or None) of each replica."""
        return [(e.metrics.engine, e.dead_reason) for e in self.engines]

    @property
    def dead_reason(self) -> str | None:
        """None while any replica can serve; else why not (one replica: its own reason)."""
        states = self.states()
        if any(why is None for _, why in states):
            return None
        if len(states) == 1:
            return states[0][1]
        return "no replica can serve: " + "; ".join(f"replica {label}: {why}" for label, why in states)

    # -- requests ----------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if len(self.engines) == 1:  # its stream as it is: one async generator less a token
            return self.engines[0].generate(request)
        return self._routed(request)  # routed when the stream starts, seeing earlier ones' load

    async def _routed(self, request: GenerateRequest) -> AsyncIterator[Event]:
        events = self.route(request).generate(request)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # a request closed early aborts its sequence now

    def route(self, request: GenerateRequest) -> Engine:
        if len(self.engines) == 1:
            return self.engines[0]
        loads = [ReplicaLoad(e.dead_reason is None, e.pending_tokens, e.num_in_flight)
                 for e in self.engines]
        key = prefix_key(request)
        index = pick_replica(loads, self._affinity.get(key))
        self._affinity[key] = index
        self._affinity.move_to_end(key)
        if len(self._affinity) > AFFINITY_KEYS:
            self._affinity.popitem(last=False)
        return self.engines[index]

    # -- start and shutdown --------------------------------------------------------------
    async def start(self, start_one: Callable[[int, Engine], Awaitable[object]] | None = None) -> None:
        """Starts every replica at once (`start_one(index, engine)`, by default
        `engine.start()`); when one cannot start, stops them all and raises its error."""
        start_one = start_one or (lambda _, engine: engine.start())
        results = await asyncio.gather(*(start_one(i, e) for i, e in enumerate(self.engines)),
                                       return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            await self.shutdown()
            raise failed

    @property
    def num_in_flight(self) -> int:
        return sum(e.num_in_flight for e in self.engines)

    async def drain(self, timeout: float) -> bool:
        """Waits until no request is in flight; False when `timeout` seconds were not enough."""
        return all(await asyncio.gather(*(e.drain(timeout) for e in self.engines)))

    def abort_all(self) -> None:
        for engine in self.engines:
            engine.abort_all()

    def kill(self) -> None:
        for engine in self.engines:
            engine.kill()

    async def shutdown(self) -> None:
        results = await asyncio.gather(*(e.shutdown() for e in self.engines), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
