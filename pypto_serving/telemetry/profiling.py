"""Profiling: Chrome trace-event spans per process, merged into one trace on stop.

Every process (the API process and each device worker) records its own `SpanRecorder` and,
at the kernel level, the worker runs the torch profiler. On stop each process writes a
fragment under `<output>/fragments/`; the API process merges them into
`<output>/trace.json` (openable in Perfetto or chrome://tracing), one process track per pid.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

log = structlog.get_logger()

DEFAULT_LEVELS = ("e2e", "kernel")
LANE_BASE = 100  # tids of per-request lanes; below that: fixed threads (1 engine loop, 2 tokens)
_THREADS = {1: "steps", 2: "tokens"}
_CLOCK_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def clock_us() -> float:
    """Monotonic within a process, aligned to wall time so processes line up in one trace."""
    return (time.monotonic_ns() + _CLOCK_OFFSET_NS) / 1000


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    output: str
    levels: tuple[str, ...] = DEFAULT_LEVELS


class ProfileError(RuntimeError):
    """Start while recording or stop while idle: a 400 whose message says what to do."""


class TraceNotWritten(RuntimeError):
    """The recording stopped but its trace could not be written (a full or vanished disk)."""


class SpanRecorder:
    """Complete ("X") and instant ("i") trace events of one process; free when not recording."""

    def __init__(self, process_name: str):
        self.process_name = process_name
        self.pid = os.getpid()
        self.events: list[dict[str, Any]] | None = None  # None: not recording
        self.verbose = False
        self._lanes: list[int] = []
        self._next_lane = LANE_BASE

    @property
    def active(self) -> bool:
        return self.events is not None

    def start(self, levels: Sequence[str]) -> None:
        self.events = [] if ("e2e" in levels or "verbose" in levels) else None
        self.verbose = "verbose" in levels

    def stop(self) -> list[dict[str, Any]]:
        """The recorded events with this process's name attached; recording ends."""
        events, self.events, self.verbose = self.events or [], None, False
        meta = [{"ph": "M", "pid": self.pid, "tid": 0, "name": "process_name",
                 "args": {"name": f"{self.process_name} (pid {self.pid})"}}]
        for tid in sorted({e["tid"] for e in events}):
            name = _THREADS.get(tid, f"request lane {tid - LANE_BASE}")
            meta.append({"ph": "M", "pid": self.pid, "tid": tid, "name": "thread_name",
                         "args": {"name": name}})
        return meta + events

    def complete(self, name: str, cat: str, start_us: float, end_us: float | None = None,
                 tid: int = 1, **args: Any) -> None:
        if self.events is None:
            return
        end = clock_us() if end_us is None else end_us
        self.events.append({"ph": "X", "name": name, "cat": cat, "pid": self.pid, "tid": tid,
                            "ts": start_us, "dur": max(end - start_us, 0.0), "args": args})

    def instant(self, name: str, cat: str, tid: int = 2, **args: Any) -> None:
        if self.events is not None:
            self.events.append({"ph": "i", "s": "t", "name": name, "cat": cat, "pid": self.pid,
                                "tid": tid, "ts": clock_us(), "args": args})

    @contextmanager
    def span(self, name: str, cat: str, tid: int = 1, **args: Any) -> Iterator[None]:
        start = clock_us()
        try:
            yield
        finally:
            self.complete(name, cat, start, tid=tid, **args)

    # Overlapping per-request spans each get a lane (tid) of their own, reused when free,
    # because "X" events on one thread must nest.
    def acquire_lane(self) -> int:
        if self._lanes:
            return heapq.heappop(self._lanes)
        self._next_lane += 1
        return self._next_lane - 1

    def release_lane(self, lane: int) -> None:
        heapq.heappush(self._lanes, lane)


def write_fragment(path: Path, events: list[dict[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def _load_fragment(path: str) -> list[dict[str, Any]]:
    """A fragment's events; torch's timestamps are shifted onto the wall clock."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    base_us = data.get("baseTimeNanoseconds", 0) / 1000 if isinstance(data, dict) else 0
    if base_us:
        for event in events:
            if "ts" in event:
                event["ts"] = float(event["ts"]) + base_us
    return events


def merge_fragments(paths: Sequence[str], out: Path) -> int:
    """Writes one Chrome trace of every fragment; returns the number of events.

    A process's own fragment comes before its torch fragment in `paths`, so its name wins
    over the torch profiler's generic "python" for the same pid.
    """
    events, named = [], set()
    for path in paths:
        if not Path(path).is_file():
            continue
        for event in _load_fragment(path):
            if event.get("ph") == "M" and event.get("name") == "process_name":
                if event.get("pid") in named:
                    continue
                named.add(event.get("pid"))
            events.append(event)
    origin = min((e["ts"] for e in events if e.get("ph") != "M" and "ts" in e), default=0.0)
    for event in events:
        if "ts" in event:  # small numbers read better than microseconds since 1970
            event["ts"] = max(float(event["ts"]) - origin, 0.0)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                               "otherData": {"origin_unix_us": origin}}))
    return len(events)


class ProfileTarget(Protocol):
    """A device worker as the profiler sees it (DeviceWorkerClient)."""

    def start_profile(self, levels: list[str], prefix: str) -> None: ...

    async def stop_profile(self) -> list[str]: ...


class Profiler:
    """Runs one recording session at a time across this process and every worker."""

    def __init__(self, config: ProfileConfig, recorder: SpanRecorder,
                 workers: Callable[[], Sequence[ProfileTarget]]):
        """`workers()`: the device workers now (a restarted engine has new ones)."""
        self.config = config
        self.recorder = recorder
        self._workers = workers
        self.state = "idle"  # idle | recording | writing
        self._session = 0

    @property
    def output(self) -> Path:
        return Path(self.config.output)

    def start(self) -> None:
        if self.state == "recording":
            raise ProfileError("the profiler is already recording: POST /stop_profile first")
        if self.state == "writing":
            raise ProfileError("the profiler is still writing the last trace: start again once "
                               "POST /stop_profile has answered")
        self._session += 1
        self.state = "recording"
        self.recorder.start(self.config.levels)
        prefix = str(self.output / "fragments" / f"{self._session:03d}-")
        for worker in self._workers():
            worker.start_profile(list(self.config.levels), prefix)
        log.info("profiling started", levels=",".join(self.config.levels), output=str(self.output))

    async def stop(self) -> dict[str, Any]:
        """Stops every recorder, waits for the workers' fragments and merges them."""
        if self.state != "recording":
            raise ProfileError(f"the profiler is {self.state}, not recording: "
                               "POST /start_profile first")
        self.state = "writing"
        try:
            return await self._write()
        except OSError as exc:
            raise TraceNotWritten(f"the recording stopped, but its trace could not be written under "
                                  f"{self.output}: {exc}") from exc
        finally:
            self.state = "idle"

    async def _write(self) -> dict[str, Any]:
        own = self.output / "fragments" / f"{self._session:03d}-api-{self.recorder.pid}.json"
        paths = [write_fragment(own, self.recorder.stop())]
        for worker in self._workers():
            paths += await worker.stop_profile()
        trace = self.output / "trace.json"
        loop = asyncio.get_running_loop()
        count = await loop.run_in_executor(None, merge_fragments, paths, trace)
        log.info("profile written", trace=str(trace), fragments=len(paths), events=count)
        return {"trace": str(trace), "fragments": paths, "events": count}


class WorkerProfiler:
    """The device worker's side: its span recorder plus, at kernel level, the torch profiler."""

    def __init__(self, process_name: str, activities: tuple[str, ...]):
        """`activities`: the torch profiler's, by name ("cpu", "cuda"): the backend's."""
        self.recorder = SpanRecorder(process_name)
        self.activities = activities
        self._torch = None
        self._prefix = ""

    def start(self, levels: list[str], prefix: str) -> None:
        self.stop()  # a new session replaces one the API process never stopped
        self._prefix = prefix
        self.recorder.start(levels)
        if "kernel" in levels or "verbose" in levels:
            self._torch = _torch_profiler(self.activities, verbose="verbose" in levels)
            self._torch.start()

    def stop(self) -> list[str]:
        if not self._prefix:
            return []
        base = Path(f"{self._prefix}worker-{self.recorder.pid}")
        paths = [write_fragment(base.with_name(base.name + ".json"), self.recorder.stop())]
        if self._torch is not None:
            paths += self._export_torch(base.with_name(base.name + "-torch.json"))
        self._prefix, self._torch = "", None
        return paths

    def _export_torch(self, path: Path) -> list[str]:
        try:
            self._torch.stop()
            self._torch.export_chrome_trace(str(path))
        except Exception:  # a failed kernel trace must not lose the e2e fragment
            log.exception("torch profiler export failed", path=str(path))
            return []
        return [str(path)]


def _torch_profiler(names: tuple[str, ...], verbose: bool) -> Any:
    import torch  # only device workers profile kernels

    activities = [getattr(torch.profiler.ProfilerActivity, name.upper()) for name in names]
    return torch.profiler.profile(activities=activities, record_shapes=verbose)
