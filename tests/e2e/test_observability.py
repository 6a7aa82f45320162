"""Metrics, JSON logs, profiles and a graceful shutdown, against one real server.

The module's server runs with `--log-format json --profile`; its tests run in file order
and the last one shuts it down, so the whole run's output can be checked line by line.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pypto_serving.telemetry.metrics import COUNTERS, GAUGES, HISTOGRAMS
from tests.e2e.ops_helpers import (
    BackgroundStream,
    assert_all_gone,
    children,
    idle,
    replica,
    wait_for,
)
from tests.e2e.server import ServerProcess

REQUEST_EVENTS = {"request received", "request finished", "request aborted"}


@pytest.fixture(scope="module")
def ops_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    out = tmp_path_factory.mktemp("profile")
    args = ["--log-format", "json", "--profile", "--profile-output", str(out),
            "--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--shutdown-timeout", "10"]
    with ServerProcess(args) as srv:
        srv.profile_dir = out
        yield srv


def records(server: ServerProcess, start: int = 0) -> list[dict]:
    return [json.loads(line) for line in server.lines[start:] if line.strip()]


def finished_lines(server: ServerProcess, start: int) -> dict[str, dict]:
    return {r["request_id"]: r for r in records(server, start) if r["event"] == "request finished"}


# -- startup -----------------------------------------------------------------------------


def test_startup_complete_means_the_socket_accepts(ops_server: ServerProcess):
    assert httpx.get(ops_server.url + "/health").json() == {"status": "ok"}  # no retry needed
    events = [r["event"] for r in records(ops_server)]
    assert events.count("Application startup complete") == 1
    summary = events[:events.index("Application startup complete")]
    expected = [f"Serving on http://127.0.0.1:{ops_server.port}", "Model: smollm2 (",
                "Platform: a2a3, backend cpu, device groups [[0]]", "Parallelism: replicas 1, dp 1, tp 1",
                "Max running requests: 16", "Max scheduled tokens per step: 512",
                "Prefill chunk size: 2048", "Prefix cache: enabled", "Chunked prefill: enabled",
                "KV cache: ", "Profiling: levels e2e,kernel"]
    for start in expected:
        assert any(e.startswith(start) for e in summary), start
    endpoints = next(e for e in summary if e.startswith("Endpoints: "))
    for route in ("GET /metrics", "GET /metrics/json", "POST /start_profile", "POST /stop_profile"):
        assert route in endpoints


def test_start_up_says_what_it_is_doing_from_the_first_line(ops_server: ServerProcess):
    """Each phase of start-up has its line, in order, the first before anything loads (the C
    kernels' compile line appears only on a run that compiles them; the weights come from the
    weight cache, or from the checkpoint, which then writes the cache entry)."""
    events = [r["event"] for r in records(ops_server)]
    assert events[0] == "starting"
    missed = ["weight cache miss: packing from the checkpoint", "loading weights done",
              "weight cache entry written"]
    loaded = ["weight cache hit"] if "weight cache hit" in events else missed
    phases = ["starting", *loaded, "allocating the KV cache", "model loaded", "Application startup complete"]
    assert [events.index(p) for p in phases] == sorted(events.index(p) for p in phases)
    kv = next(r for r in records(ops_server) if r["event"] == "allocating the KV cache")
    assert kv["blocks"] > 0 and kv["mib"] > 0 and kv["dtype"] == "float16"
    if "compiling the C kernels (once per version)" in events:
        assert events.index("C kernels compiled") < events.index(loaded[0])


# -- metrics -----------------------------------------------------------------------------


def run_workload(url: str) -> list[dict]:
    """Completed requests of every kind we can script; returns their response bodies."""
    bodies = []
    with httpx.Client(base_url=url, timeout=600) as http:
        for i, n in enumerate((3, 4, 5)):
            bodies.append(http.post("/v1/completions", json={"prompt": f"Fact {i}:", "max_tokens": n}).json())
        bodies.append(http.post("/v1/completions", json={
            "prompt": "1, 2, 3, 4,", "max_tokens": 12, "stop": [","]}).json())
        shared = "You are a terse assistant. Answer in one short sentence, please. " * 3
        for _ in range(2):  # the second reuses the first one's full prompt blocks
            bodies.append(http.post("/v1/completions", json={"prompt": shared, "max_tokens": 2}).json())
        bodies.append(http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}).json())
    stream = BackgroundStream(url, {"prompt": "Count to five:", "max_tokens": 4})
    stream.run()
    bodies.append({"id": stream.chunks()[0]["id"], "usage": stream.usage,
                   "choices": [{"finish_reason": stream.finish_reason}]})
    return bodies


def abandon_a_stream(url: str) -> None:
    """A client that goes away after the first event: the request ends as aborted."""
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break


def test_metric_arithmetic_after_a_scripted_workload(ops_server: ServerProcess):
    url, start = ops_server.url, len(ops_server.lines)
    before = replica(url)
    bodies = run_workload(url)
    abandon_a_stream(url)
    n = len(bodies) + 1
    wait_for(lambda: idle(url, before["counters"]["requests_finished"] + n), what="an idle engine")
    after = replica(url)
    delta = {k: after["counters"][k] - before["counters"][k] for k in after["counters"]}
    logged = finished_lines(ops_server, start)
    assert len(logged) == n
    for body in bodies:  # the finished log line of each request agrees with its usage
        line = logged.pop(body["id"])
        assert (line["prompt_tokens"], line["output_tokens"]) == (
            body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
    (aborted,) = logged.values()
    assert aborted["reason"] == "aborted" and aborted["output_tokens"] >= 1

    usage = [b["usage"] for b in bodies]
    prompt = sum(u["prompt_tokens"] for u in usage) + aborted["prompt_tokens"]
    generated = sum(u["completion_tokens"] for u in usage) + aborted["output_tokens"]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert (delta["prompt_tokens"], delta["generation_tokens"]) == (prompt, generated)
    assert cached > 0 and delta["prefix_cache_hits"] == cached
    assert delta["preemptions"] == 0 and delta["prefix_cache_queries"] == prompt
    assert delta["prefill_tokens"] == prompt - cached

    reasons = Counter(b["choices"][0]["finish_reason"] for b in bodies) + Counter(aborted=1)
    assert reasons["stop"] >= 1 and reasons["length"] >= 1
    assert {k: after["finish_reasons"][k] - before["finish_reasons"][k]
            for k in after["finish_reasons"]} == {k: reasons.get(k, 0) for k in after["finish_reasons"]}
    assert delta["requests_finished"] == n and delta["requests_aborted"] == 1

    hist = {k: after["histograms"][k]["count"] - before["histograms"][k]["count"]
            for k in after["histograms"]}
    assert hist["ttft"] == hist["e2e"] == hist["queue_time"] == hist["request_prompt_tokens"] == n
    assert hist["itl"] == generated - n  # one sample between each two tokens of a request
    phases = ("request_inference_time", "request_prefill_time", "request_decode_time",
              "request_num_preemptions", "request_prefill_kv_computed_tokens",
              "request_max_num_generation_tokens", "request_params_n")
    assert [hist[k] for k in phases] == [n] * len(phases)  # every request was scheduled and ended
    assert hist["iteration_tokens"] >= 1
    assert after["gauges"] == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}


def test_prometheus_text_parses_and_agrees_with_json(ops_server: ServerProcess):
    r = httpx.get(ops_server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    snapshot = replica(ops_server.url)
    for prefix in ("pypto:", "vllm:"):
        for key, (name, _) in COUNTERS.items():
            (sample,) = families[prefix + name.removesuffix("_total")].samples
            assert sample.labels == {"model_name": "smollm2", "engine": "0"}
            assert sample.value == snapshot["counters"][key], (prefix, key)
        for key, (name, _) in GAUGES.items():
            assert families[prefix + name].samples[0].value == snapshot["gauges"][key]
        for key, (name, _) in HISTOGRAMS.items():
            count = next(s for s in families[prefix + name].samples if s.name.endswith("_count"))
            assert count.value == snapshot["histograms"][key]["count"], (prefix, key)
        success = {s.labels["finished_reason"]: s.value
                   for s in families[prefix + "request_success"].samples}
        reasons = snapshot["finish_reasons"]
        if prefix == "vllm:":  # vLLM's values: tool calls end with stop, aborted is abort
            reasons = {"stop": reasons["stop"] + reasons["tool_calls"], "length": reasons["length"],
                       "abort": reasons["aborted"], "error": reasons["error"], "repetition": 0}
        assert success == reasons


# -- profiles ----------------------------------------------------------------------------


def test_profile_round_trip(ops_server: ServerProcess):
    url = ops_server.url
    r = httpx.post(url + "/stop_profile")
    assert r.status_code == 400 and "start_profile" in r.json()["message"]
    assert httpx.post(url + "/start_profile").status_code == 200
    r = httpx.post(url + "/start_profile")
    assert r.status_code == 400 and "stop_profile" in r.json()["message"]
    body = {"prompt": "Profile me", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body, timeout=600).status_code == 200
    r = httpx.post(url + "/stop_profile", timeout=600)
    assert r.status_code == 200, r.text
    trace = json.loads(Path(r.json()["trace"]).read_text())["traceEvents"]
    assert Path(r.json()["trace"]) == ops_server.profile_dir / "trace.json"
    assert all(Path(p).parent == ops_server.profile_dir / "fragments" for p in r.json()["fragments"])
    spans = [e for e in trace if e.get("ph") == "X"]
    names = {e["args"]["name"]: e["pid"] for e in trace if e.get("name") == "process_name"
             and "(pid " in e["args"]["name"]}
    api = next(pid for name, pid in names.items() if name.startswith("api-server"))
    worker = next(pid for name, pid in names.items() if name.startswith("device-worker"))
    api_names = {e["name"] for e in spans if e["pid"] == api}
    assert {"POST /v1/completions", "queue", "schedule", "step"} <= api_names
    assert "forward" in {e["name"] for e in spans if e["pid"] == worker}
    assert any(e.get("cat") == "cpu_op" and e["pid"] == worker for e in spans)  # kernel level
    assert httpx.post(url + "/start_profile").status_code == 200  # again: repeated sessions
    assert httpx.post(url + "/stop_profile", timeout=600).status_code == 200


def test_a_trace_that_cannot_be_written_is_a_json_500_and_profiling_goes_on(ops_server: ServerProcess):
    """The output was writable at start-up; a trace.json that has become a folder (or a full
    disk) fails the merge: /stop_profile says so as an OpenAI-style error, and the next
    recording works once the path is free."""
    url, trace = ops_server.url, ops_server.profile_dir / "trace.json"
    trace.unlink(missing_ok=True)
    trace.mkdir()
    try:
        assert httpx.post(url + "/start_profile").status_code == 200
        r = httpx.post(url + "/stop_profile", timeout=600)
        assert r.status_code == 500
        error = r.json()
        assert error["type"] == "server_error" and "could not be written" in error["message"], error
    finally:
        trace.rmdir()
    assert httpx.post(url + "/start_profile").status_code == 200
    assert httpx.post(url + "/stop_profile", timeout=600).status_code == 200


def test_scrapes_are_not_logged(ops_server: ServerProcess):
    start = len(ops_server.lines)
    for path in ("/metrics", "/metrics/json", "/health"):
        assert httpx.get(ops_server.url + path).status_code == 200
    time.sleep(0.5)
    lines = [json.dumps(r) for r in records(ops_server, start)]
    assert [line for line in lines if "/metrics" in line or "/health" in line] == []


# -- shutdown (last: it ends the server) ---------------------------------------------------


def test_graceful_shutdown_with_requests_in_flight_while_recording(ops_server: ServerProcess):
    url, proc = ops_server.url, ops_server.proc
    assert httpx.post(url + "/start_profile").status_code == 200
    # The short one needs one more token within --shutdown-timeout (10 s); the long one (eight
    # choices of 1000 tokens) would need 800 tokens/s under the kernel profiler while its KV
    # (~180 MiB, nearly three times the 64 MiB cache) churns through preemption: twice what
    # this server decodes on a 2-core CPU without the profiler (480 tokens made the same
    # demand at 384 tokens/s, which the CPU kernels began to reach).
    short = BackgroundStream(url, {"prompt": "Short one", "max_tokens": 2})
    long = BackgroundStream(url, {"prompt": "Long one", "max_tokens": 1000, "n": 8})
    for stream in (short, long):
        stream.start()
        assert stream.first.wait(300)
    procs = children(proc.pid)
    start = len(ops_server.lines)
    proc.send_signal(signal.SIGTERM)
    r = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
    assert r.status_code == 503 and "shutting down" in r.json()["message"]
    assert httpx.get(url + "/health").status_code == 503
    assert proc.wait(120) == 0
    short.join(10), long.join(10)
    assert (short.finish_reason, short.usage["completion_tokens"]) == ("length", 2)
    assert long.finish_reason == "aborted" and long.events[-1] == "[DONE]"
    assert_all_gone(procs)
    after = [r["event"] for r in records(ops_server, start)]
    assert after.index("shutdown requested") < after.index("profile written") < after.index(
        "shutdown complete")


def test_the_whole_run_logged_only_json(ops_server: ServerProcess):
    assert ops_server.proc.poll() is not None, "runs after the shutdown test"
    lines = [line for line in ops_server.lines if line.strip()]
    assert len(lines) > 30
    for line in lines:
        record = json.loads(line)
        assert {"event", "level", "timestamp"} <= record.keys(), line
        if record["event"] in REQUEST_EVENTS:
            assert record["request_id"], line
    events = Counter(json.loads(line)["event"] for line in lines)
    assert events["request received"] == events["request finished"] >= 10


# -- flags and the default server ------------------------------------------------------


@pytest.mark.parametrize("args, flag", [
    (["--profile-output", "x"], "--profile-output"),
    (["--profile-level", "e2e"], "--profile-level"),
    (["--profile", "--profile-level", "e2e,gpu"], "--profile-level"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
])
def test_profile_flags_are_checked(args: list[str], flag: str):
    out = subprocess.run([sys.executable, "-m", "pypto_serving", "--model", "/nonexistent", *args],
                         capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and flag in lines[0], out.stderr


def test_profile_endpoints_need_profile_and_metrics_parse(server: ServerProcess):
    for path in ("/start_profile", "/stop_profile"):
        assert httpx.post(server.url + path).status_code == 404
    families = {f.name for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    assert {"vllm:num_requests_running", "vllm:prompt_tokens", "vllm:time_to_first_token_seconds",
            "pypto:kv_cache_usage_perc", "pypto:request_success"} <= families
