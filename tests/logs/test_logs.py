"""JSON mode: every line a process writes is one JSON object, whoever wrote it."""

from __future__ import annotations

import json
import subprocess
import sys

from pypto_serving.telemetry.logs import as_json_line

SCRIPT = r'''
import logging, os, sys, threading, warnings
from pypto_serving.telemetry.logs import capture_stray_output, configure_logging
restore = capture_stray_output()
configure_logging("json", "info")
import structlog
structlog.get_logger().info("hello", request_id="r1")
structlog.get_logger().debug("hidden at info level")
logging.getLogger("aiohttp.server").error("Error handling request", exc_info=ValueError("x"))
warnings.warn("careful")
print("a stray print")
os.write(2, b"[W something.cpp:12] a C extension line\n")
thread = threading.Thread(target=lambda: 1 / 0)
thread.start()
thread.join()
class Noisy:
    def __del__(self):
        raise OSError("in __del__")
Noisy()
restore()
raise RuntimeError("uncaught")
'''


def test_every_line_is_json_with_event_level_timestamp():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    lines = (out.stdout + out.stderr).splitlines()
    records = [json.loads(line) for line in lines]  # raises on any non-JSON line
    assert all({"event", "level", "timestamp"} <= r.keys() for r in records), records
    events = [r["event"] for r in records]
    assert "hello" in events and "hidden at info level" not in events
    assert next(r for r in records if r["event"] == "hello")["request_id"] == "r1"
    aiohttp = next(r for r in records if r["event"] == "Error handling request")
    assert aiohttp["logger"] == "aiohttp.server" and "ValueError" in aiohttp["exception"]
    assert any("careful" in e for e in events)
    assert {"a stray print", "[W something.cpp:12] a C extension line"} <= set(events)
    assert any(r["event"] == "uncaught exception in a thread" for r in records)
    assert any("Noisy.__del__" in r["object"] for r in records if "object" in r)
    last = records[-1]
    assert last["event"] == "uncaught exception" and "RuntimeError" in last["exception"]
    assert out.returncode == 1


def test_as_json_line():
    assert as_json_line('{"event": "x"}\n', "stderr", "warning") == '{"event": "x"}\n'
    assert as_json_line("  \n", "stderr", "warning") == ""
    record = json.loads(as_json_line("plain text\r\n", "stdout", "info"))
    assert record["event"] == "plain text" and record["stream"] == "stdout" and record["level"] == "info"
