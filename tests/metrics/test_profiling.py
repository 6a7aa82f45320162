"""Span recording, fragment merging and the start/stop state machine, without a server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pypto_serving.telemetry.profiling import (
    LANE_BASE,
    ProfileConfig,
    ProfileError,
    Profiler,
    SpanRecorder,
    TraceNotWritten,
    clock_us,
    merge_fragments,
    write_fragment,
)


def test_recorder_is_free_when_idle_and_names_its_process():
    recorder = SpanRecorder("api-server")
    with recorder.span("idle", "engine"):
        pass
    recorder.start(["e2e"])
    with recorder.span("step", "engine", step_id=1):
        pass
    recorder.instant("token", "request")  # verbose only in spirit; recorded when active
    events = recorder.stop()
    names = [e["name"] for e in events]
    assert "idle" not in names and "step" in names
    assert events[0]["name"] == "process_name" and "api-server" in events[0]["args"]["name"]
    step = next(e for e in events if e["name"] == "step")
    assert step["ph"] == "X" and step["dur"] >= 0 and step["args"] == {"step_id": 1}
    assert not recorder.active


def test_kernel_only_level_records_no_spans():
    recorder = SpanRecorder("w")
    recorder.start(["kernel"])
    assert not recorder.active


def test_lanes_are_reused_lowest_first():
    recorder = SpanRecorder("api")
    a, b, c = (recorder.acquire_lane() for _ in range(3))
    assert (a, b, c) == (LANE_BASE, LANE_BASE + 1, LANE_BASE + 2)
    recorder.release_lane(b)
    recorder.release_lane(a)
    assert recorder.acquire_lane() == a


def test_merge_aligns_torch_timestamps_and_keeps_our_process_names(tmp_path: Path):
    now = clock_us()
    ours = [{"ph": "M", "pid": 7, "tid": 0, "name": "process_name", "args": {"name": "worker (pid 7)"}},
            {"ph": "X", "pid": 7, "tid": 1, "name": "forward", "ts": now, "dur": 10.0}]
    base_ns = int(now * 1000) - 5_000_000  # torch: ts relative to baseTimeNanoseconds
    torch_trace = {"baseTimeNanoseconds": base_ns, "traceEvents": [
        {"ph": "M", "pid": 7, "tid": 0, "name": "process_name", "args": {"name": "python"}},
        {"ph": "X", "pid": 7, "tid": 7, "name": "aten::mm", "ts": 5_001.0, "dur": 2.0}]}
    api = [{"ph": "X", "pid": 3, "tid": 1, "name": "step", "ts": now - 100, "dur": 200.0}]
    paths = [write_fragment(tmp_path / "api.json", api), write_fragment(tmp_path / "w.json", ours)]
    (tmp_path / "w-torch.json").write_text(json.dumps(torch_trace))
    out = tmp_path / "trace.json"
    assert merge_fragments([*paths, str(tmp_path / "w-torch.json"), "/missing.json"], out) == 4
    events = json.loads(out.read_text())["traceEvents"]
    by_name = {e["name"]: e for e in events if e["ph"] != "M"}
    assert by_name["step"]["ts"] == 0.0  # the earliest event starts the trace
    assert by_name["forward"]["ts"] == pytest.approx(100.0)
    assert by_name["aten::mm"]["ts"] == pytest.approx(by_name["forward"]["ts"] + 1.0, abs=1.0)
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == ["worker (pid 7)"]


class FakeWorker:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.started: list[tuple[list[str], str]] = []

    def start_profile(self, levels: list[str], prefix: str) -> None:
        self.started.append((levels, prefix))

    async def stop_profile(self) -> list[str]:
        event = {"ph": "X", "pid": 99, "tid": 1, "name": "forward", "ts": clock_us(), "dur": 1.0}
        return [write_fragment(Path(self.started[-1][1] + "worker-99.json"), [event])]


async def test_profiler_state_machine_and_round_trip(tmp_path: Path):
    worker = FakeWorker(tmp_path)
    recorder = SpanRecorder("api-server")
    profiler = Profiler(ProfileConfig(str(tmp_path / "out"), ("e2e",)), recorder, lambda: [worker])
    with pytest.raises(ProfileError, match="start_profile"):
        await profiler.stop()
    profiler.start()
    with pytest.raises(ProfileError, match="stop_profile"):
        profiler.start()
    with recorder.span("step", "engine"):
        pass
    written = await profiler.stop()
    trace = json.loads(Path(written["trace"]).read_text())["traceEvents"]
    assert {e["pid"] for e in trace if e["ph"] == "X"} == {recorder.pid, 99}
    assert worker.started[0][1].endswith("fragments/001-")
    profiler.start()  # repeated sessions are safe and get their own fragments
    await profiler.stop()
    assert worker.started[1][1].endswith("fragments/002-")


async def test_a_trace_that_cannot_be_written_is_a_server_error_and_the_profiler_recovers(tmp_path: Path):
    """The output checked at start-up can vanish or fill up later: stopping then says so (the
    ops endpoint answers 500 with it) and leaves the profiler able to record again."""
    worker = FakeWorker(tmp_path)
    profiler = Profiler(ProfileConfig(str(tmp_path / "out"), ("e2e",)), SpanRecorder("api-server"),
                        lambda: [worker])
    profiler.start()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "fragments").write_text("a file where the fragments' folder goes")
    with pytest.raises(TraceNotWritten, match="trace could not be written under .*out"):
        await profiler.stop()
    assert profiler.state == "idle"
    (tmp_path / "out" / "fragments").unlink()
    profiler.start()
    assert Path((await profiler.stop())["trace"]).is_file()
