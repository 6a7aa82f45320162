"""Access control, CORS, the access log, request ids and --log-requests, against one real
server started as an operator would (keys from a file, JSON logs); and a second server on
the same port fails at once, before any model loads."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess

ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("# rotated monthly\nfirst-key\n\nsecond-key\n")
    args = ["--max-model-len", "256", "--kv-cache-memory", "64MiB", "--api-key", f"@{keys}",
            "--allowed-origins", ORIGIN, "--log-requests", "--max-log-len", "12",
            "--log-format", "json"]
    with ServerProcess(args) as server:
        yield server


def wait_for_record(server: ServerProcess, match, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in server.json_records() if match(r)]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError("no such log line")


def test_keys_guard_the_api_but_not_health_or_metrics(keyed: ServerProcess):
    body = {"prompt": "Hi", "max_tokens": 2}
    missing = httpx.post(keyed.url + "/v1/completions", json=body)
    wrong = httpx.post(keyed.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["type"] == "authentication_error"
    assert "Bearer" in missing.headers["WWW-Authenticate"]
    assert httpx.post(keyed.url + "/tokenize", json={"prompt": "Hi"}).status_code == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(keyed.url + path).status_code == 200
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="second-key", max_retries=0)
    done = client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert done.usage.completion_tokens == 2


def test_cors_preflight_and_headers(keyed: ServerProcess):
    pre = httpx.options(keyed.url + "/v1/chat/completions",
                        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204 and pre.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "authorization" in pre.headers["Access-Control-Allow-Headers"].lower()
    r = httpx.get(keyed.url + "/health", headers={"Origin": ORIGIN})
    assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
    other = httpx.get(keyed.url + "/health", headers={"Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in other.headers


def test_request_ids_access_log_and_logged_requests(keyed: ServerProcess):
    headers = {"Authorization": "Bearer first-key", "X-Request-Id": "trace-42"}
    with httpx.stream("POST", keyed.url + "/v1/completions", headers=headers,
                      json={"prompt": "Once upon a time there was", "max_tokens": 4, "stream": True}) as r:
        assert r.headers["X-Request-Id"] == "trace-42"
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    first = json.loads(lines[0][6:])
    assert first["id"] == "cmpl-trace-42"
    access = wait_for_record(keyed, lambda e: e.get("event") == "http request"
                             and e.get("request_id") == "trace-42")
    assert access["status"] == 200 and access["path"] == "/v1/completions" and access["bytes"] > 0
    assert access["method"] == "POST" and access["client"] == "127.0.0.1" and access["duration_ms"] > 0
    received = wait_for_record(keyed, lambda e: e.get("event") == "request received"
                               and e.get("request_id") == "cmpl-trace-42")
    assert received["prompt"] == "Once upon a ..."
    finished = wait_for_record(keyed, lambda e: e.get("event") == "request finished"
                               and e.get("request_id") == "cmpl-trace-42")
    assert "output" in finished and len(finished["output"]) <= 15
    bad = httpx.post(keyed.url + "/v1/completions", headers=headers, json={"prompt": 5})
    assert bad.status_code == 400
    metrics = httpx.get(keyed.url + "/metrics").text
    assert 'pypto:http_requests_total{method="POST",path="/v1/completions",status="400"}' in metrics
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="4xx"}' in metrics


def test_responses_and_chat_request_lines_carry_the_client_request_id(keyed: ServerProcess):
    headers = {"Authorization": "Bearer first-key", "X-Request-Id": "trace-43"}
    r = httpx.post(keyed.url + "/v1/responses", headers=headers, json={"input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "trace-43"
    received = wait_for_record(keyed, lambda e: e.get("event") == "request received"
                               and e.get("request_id") == "chatcmpl-trace-43")
    assert received["prompt"].startswith('[{"role":')  # a chat's messages, as JSON
    wait_for_record(keyed, lambda e: e.get("event") == "request finished"
                    and e.get("request_id") == "chatcmpl-trace-43")


def test_a_port_in_use_fails_before_the_model_loads(keyed: ServerProcess):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pypto_serving", "--host", "127.0.0.1",
                           "--port", str(keyed.port)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and time.monotonic() - t0 < 20
    assert "cannot listen on 127.0.0.1:" in proc.stderr and "in use" in proc.stderr
    assert "starting" not in proc.stderr + proc.stdout  # nothing was loaded


def test_unwritable_paths_and_bad_keys_fail_at_once(tmp_path: Path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [(["--profile", "--profile-output", str(a_file / "out")], "is not a directory"),
             (["--api-key", f"@{tmp_path / 'missing'}"], "--api-key"),
             (["--metrics-require-auth"], "--metrics-require-auth needs --api-key"),
             (["--allowed-origins", "app.example/path"], "--allowed-origins")]
    for flags, expected in cases:
        proc = subprocess.run([sys.executable, "-m", "pypto_serving", *flags], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and expected in proc.stderr, (flags, proc.stderr)
