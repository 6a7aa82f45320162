"""A dead device worker and a second shutdown signal, each against its own real server."""

from __future__ import annotations

import signal

import httpx

from tests.e2e.ops_helpers import (
    BackgroundStream,
    assert_all_gone,
    children,
    replica,
    wait_for,
    worker_process,
)
from tests.e2e.server import ServerProcess

ARGS = ["--max-model-len", "512", "--kv-cache-memory", "64MiB"]


def test_worker_death_turns_health_503_and_errors_requests():
    with ServerProcess(ARGS) as server:
        url = server.url
        assert httpx.get(url + "/health").status_code == 200
        before = replica(url)
        stream = BackgroundStream(url, {"prompt": "Tell me a long story.", "max_tokens": 480})
        stream.start()
        assert stream.first.wait(300)
        procs = children(server.proc.pid)
        worker_process(server.proc.pid).kill()
        stream.join(120)
        assert stream.finish_reason == "error" and stream.events[-1] == "[DONE]"
        wait_for(lambda: httpx.get(url + "/health").status_code == 503, what="health 503")
        health = httpx.get(url + "/health").json()
        assert health["status"] == "error" and "died" in health["reason"]
        late = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert late.status_code == 500 and "died" in late.json()["message"]
        after = replica(url)
        assert after["finish_reasons"]["error"] - before["finish_reasons"]["error"] == 2
        assert after["counters"]["requests_error"] - before["counters"]["requests_error"] == 2
        assert after["gauges"] == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
        assert server.stop() == 0
        assert_all_gone(procs)


def test_a_second_signal_exits_at_once():
    with ServerProcess([*ARGS, "--shutdown-timeout", "600"]) as server:
        stream = BackgroundStream(server.url, {"prompt": "Tell me a long story.", "max_tokens": 480})
        stream.start()
        assert stream.first.wait(300)
        procs = children(server.proc.pid)
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining in-flight requests" in server.output(), what="draining")
        assert httpx.get(server.url + "/health").status_code == 503
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 128 + signal.SIGINT
        assert_all_gone(procs)
        assert "second signal: exiting now" in server.output()


def test_the_server_runs_its_worker_and_no_other_process(server: ServerProcess):
    """No multiprocess resource tracker (a ~17 MiB interpreter guarding semaphores and shared
    memory the worker never uses) beside the one device worker."""
    assert [p.pid for p in children(server.proc.pid)] == [worker_process(server.proc.pid).pid]
