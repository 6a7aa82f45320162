"""The edge as a client meets it: keys, CORS, request ids, the access log and HTTP metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from pypto_serving.http import edge
from pypto_serving.http.edge import EdgeConfig, install_edge, load_api_keys
from pypto_serving.http.server import errors_as_json
from pypto_serving.telemetry.http_metrics import HttpMetrics
from pypto_serving.telemetry.metrics import render_families

KEY = "sk-test-123"
ORIGIN = "https://ui.example"
AUTH = {"Authorization": f"Bearer {KEY}"}


async def echo(request: web.Request) -> web.Response:
    return web.json_response({"request_id": edge.request_id_of(request)})


async def stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(3):
        await response.write(f"data: {i}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def endless(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    while True:  # until the client goes
        await response.write(b"data: tick\n\n")
        await asyncio.sleep(0.01)


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def make_app(config: EdgeConfig, metrics: HttpMetrics | None = None) -> web.Application:
    app = web.Application(middlewares=[errors_as_json])  # the server's own, as in build_app
    app.add_routes([web.post("/v1/echo", echo), web.get("/v1/stream", stream),
                    web.get("/v1/endless", endless), web.get("/v1/items/{item}", echo),
                    web.get("/health", ok), web.get("/metrics", ok)])
    install_edge(app, config, metrics or HttpMetrics())
    return app


class UncancelledServer(TestServer):
    """Handlers keep running when their client goes (aiohttp's default outside tests): the
    next write raises ConnectionResetError instead of the handler being cancelled."""

    async def _make_runner(self, **kwargs: object) -> web.AppRunner:
        return await super()._make_runner(**{**kwargs, "handler_cancellation": False})


@asynccontextmanager
async def serve(config: EdgeConfig | None = None, metrics: HttpMetrics | None = None,
                server: type[TestServer] = TestServer) -> AsyncIterator[TestClient]:
    async with TestClient(server(make_app(config or EdgeConfig(), metrics))) as client:
        yield client


def access_lines(logs: list[dict]) -> list[dict]:
    return [entry for entry in logs if entry["event"] == "http request"]


# -- API keys ------------------------------------------------------------------------


async def test_missing_or_wrong_key_is_a_401_with_json_body_and_challenge():
    async with serve(EdgeConfig(api_keys=(KEY,))) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"}):
            response = await client.post("/v1/echo", headers=headers)
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            body = await response.json()
            assert (body["object"], body["type"], body["code"]) == ("error", "authentication_error", 401)
            assert "API key" in body["message"]


async def test_right_key_passes_and_open_routes_need_none():
    async with serve(EdgeConfig(api_keys=("other", KEY))) as client:
        assert (await client.post("/v1/echo", headers=AUTH)).status == 200
        assert (await client.post("/v1/echo", headers={"Authorization": f"bearer {KEY}"})).status == 200
        assert (await client.get("/health")).status == 200
        assert (await client.get("/metrics")).status == 200
        assert (await client.get("/v1/nowhere")).status == 401  # unknown paths are not open


async def test_metrics_require_auth_closes_metrics_but_not_health():
    async with serve(EdgeConfig(api_keys=(KEY,), metrics_require_auth=True)) as client:
        assert (await client.get("/metrics")).status == 401
        assert (await client.get("/metrics", headers=AUTH)).status == 200
        assert (await client.get("/health")).status == 200


async def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch):
    calls = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append(b)
        return a == b

    monkeypatch.setattr(hmac, "compare_digest", spy)
    async with serve(EdgeConfig(api_keys=(KEY, "second"))) as client:
        assert (await client.post("/v1/echo", headers=AUTH)).status == 200
    assert calls == [KEY.encode(), b"second"]  # no early exit on the first match


def test_keys_from_values_and_files(tmp_path: Path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\n\nfile-key-1\n  file-key-2  \n# old: gone\n")
    assert load_api_keys([]) == ()
    assert load_api_keys(["inline", f"@{keys}", "file-key-1"]) == ("inline", "file-key-1", "file-key-2")


def test_unreadable_or_keyless_key_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot be read"):
        load_api_keys([f"@{tmp_path / 'missing.txt'}"])
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="has no key"):
        load_api_keys([f"@{empty}"])
    with pytest.raises(ValueError, match="empty"):
        EdgeConfig(api_keys=load_api_keys([""]))


def test_config_rejects_origins_with_paths_and_hides_keys():
    with pytest.raises(ValueError, match="trailing slash"):
        EdgeConfig(allowed_origins=("https://ui.example/",))
    assert KEY not in repr(EdgeConfig(api_keys=(KEY,)))


# -- CORS ------------------------------------------------------------------------------


async def test_preflight_is_answered_without_a_key():
    async with serve(EdgeConfig(api_keys=(KEY,), allowed_origins=(ORIGIN,))) as client:
        response = await client.options("/v1/echo", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert response.status == 204
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "POST" in response.headers["Access-Control-Allow-Methods"]
        assert response.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert int(response.headers["Access-Control-Max-Age"]) > 0
        denied = await client.post("/v1/echo", headers={"Origin": ORIGIN})
        assert denied.status == 401
        assert denied.headers["Access-Control-Allow-Origin"] == ORIGIN  # the browser may read why


async def test_disallowed_origin_gets_no_allow_origin():
    async with serve(EdgeConfig(allowed_origins=(ORIGIN,))) as client:
        preflight = await client.options("/v1/echo", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert preflight.status == 403
        assert "Access-Control-Allow-Origin" not in preflight.headers
        plain = await client.post("/v1/echo", headers={"Origin": "https://evil.example"})
        assert plain.status == 200
        assert "Access-Control-Allow-Origin" not in plain.headers
        assert "Origin" in plain.headers["Vary"]


async def test_allowed_origin_on_json_and_wildcard():
    async with serve(EdgeConfig(allowed_origins=(ORIGIN,))) as client:
        response = await client.post("/v1/echo", headers={"Origin": ORIGIN})
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert response.headers["Vary"] == "Origin"
        assert "X-Request-Id" in response.headers["Access-Control-Expose-Headers"]
    async with serve(EdgeConfig(allowed_origins=("*",))) as client:
        response = await client.post("/v1/echo", headers={"Origin": "https://any.example"})
        assert response.headers["Access-Control-Allow-Origin"] == "*"


async def test_cors_off_by_default():
    async with serve() as client:
        response = await client.post("/v1/echo", headers={"Origin": ORIGIN})
        assert "Access-Control-Allow-Origin" not in response.headers
        preflight = await client.options("/v1/echo", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert preflight.status == 405


async def test_stream_carries_request_id_and_allow_origin():
    async with serve(EdgeConfig(allowed_origins=(ORIGIN,))) as client:
        response = await client.get("/v1/stream", headers={"Origin": ORIGIN, "X-Request-Id": "abc-1"})
        assert response.status == 200
        assert response.headers["X-Request-Id"] == "abc-1"
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert (await response.text()).endswith("data: [DONE]\n\n")


# -- request ids -----------------------------------------------------------------------


async def test_request_id_is_echoed_generated_or_replaced():
    async with serve() as client:
        given = await client.post("/v1/echo", headers={"X-Request-Id": "client-42"})
        assert given.headers["X-Request-Id"] == "client-42"
        assert (await given.json())["request_id"] == "client-42"  # the handler sees the same id
        fresh = await client.post("/v1/echo")
        assert len(fresh.headers["X-Request-Id"]) == 32
        assert (await fresh.json())["request_id"] == fresh.headers["X-Request-Id"]
        long = await client.post("/v1/echo", headers={"X-Request-Id": "x" * 129})
        assert long.headers["X-Request-Id"] != "x" * 129
        assert len(long.headers["X-Request-Id"]) == 32
        assert edge.accept_request_id("caf\u00e9") != "caf\u00e9"  # printable ASCII only


async def test_the_edge_sees_the_apps_own_error_answers():
    with capture_logs() as logs:
        async with serve(EdgeConfig(api_keys=(KEY,))) as client:
            response = await client.get("/nowhere", headers=AUTH)
            assert response.status == 404
            assert (await response.json())["type"] == "not_found"  # errors_as_json ran inside
            assert len(response.headers["X-Request-Id"]) == 32
    [line] = access_lines(logs)
    assert (line["status"], line["request_id"]) == (404, response.headers["X-Request-Id"])


# -- access log ------------------------------------------------------------------------


async def test_one_access_line_per_request_with_its_fields():
    with capture_logs() as logs:
        async with serve() as client:
            response = await client.post("/v1/echo", headers={"X-Request-Id": "log-1"})
            await response.read()
            await (await client.get("/v1/stream")).read()
            await (await client.get("/nowhere")).read()
    lines = access_lines(logs)
    assert [(e["method"], e["path"], e["status"]) for e in lines] == [
        ("POST", "/v1/echo", 200), ("GET", "/v1/stream", 200), ("GET", "/nowhere", 404)]
    first = lines[0]
    assert first["log_level"] == "info"
    assert first["request_id"] == "log-1"
    assert first["client"] == "127.0.0.1"
    assert first["bytes"] >= len(b'{"request_id": "log-1"}')
    assert first["duration_ms"] >= 0
    assert lines[1]["bytes"] >= len(b"data: 0\n\n" * 3 + b"data: [DONE]\n\n")


@pytest.mark.parametrize("server", [TestServer, UncancelledServer], ids=["cancelled", "write-fails"])
async def test_client_disconnect_mid_stream_is_499_at_info(server: type[TestServer],
                                                           caplog: pytest.LogCaptureFixture):
    with capture_logs() as logs, caplog.at_level(logging.DEBUG):
        async with serve(server=server) as client:
            response = await client.get("/v1/endless")
            await response.content.readuntil(b"\n\n")
            response.close()  # drops the connection
            for _ in range(200):
                if access_lines(logs):
                    break
                await asyncio.sleep(0.01)
    [line] = access_lines(logs)
    assert (line["status"], line["log_level"]) == (499, "info")
    assert line["bytes"] > 0
    assert not [e for e in logs if e["log_level"] in ("error", "critical")]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# -- HTTP metrics ----------------------------------------------------------------------


def scrape(metrics: HttpMetrics) -> dict[tuple[str, frozenset], float]:
    text = render_families(metrics.families()).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def counted(samples: dict[tuple[str, frozenset], float], method: str, path: str, status: str) -> float:
    """pypto:http_requests_total's sample for the labels."""
    labels = frozenset({"method": method, "path": path, "status": status}.items())
    return samples.get(("pypto:http_requests_total", labels), 0)


async def test_requests_are_counted_by_route_and_status():
    metrics = HttpMetrics()
    async with serve(EdgeConfig(api_keys=(KEY,)), metrics) as client:
        for _ in range(2):
            await client.post("/v1/echo", headers=AUTH)
        await client.post("/v1/echo")
        await client.get("/v1/items/1", headers=AUTH)
        await client.get("/v1/items/2", headers=AUTH)
        for i in range(3):
            await client.get(f"/random-{i}", headers=AUTH)
    samples = scrape(metrics)
    assert counted(samples, "POST", "/v1/echo", "200") == 2
    assert counted(samples, "POST", "/v1/echo", "401") == 1
    assert counted(samples, "GET", "/v1/items/{item}", "200") == 2  # the route, not each path
    assert counted(samples, "GET", "unmatched", "404") == 3
    vllm = frozenset({"handler": "/v1/echo", "method": "POST", "status": "4xx"}.items())
    assert samples[("http_requests_total", vllm)] == 1
    none = frozenset({"handler": "none", "method": "GET", "status": "4xx"}.items())
    assert samples[("http_requests_total", none)] == 3
    count = frozenset({"method": "POST", "path": "/v1/echo"}.items())
    assert samples[("pypto:http_request_duration_seconds_count", count)] == 3
    handler = frozenset({"handler": "/v1/echo", "method": "POST"}.items())
    assert samples[("http_request_duration_seconds_count", handler)] == 3
    assert metrics.snapshot()["by_status"] == {"200": 4, "401": 1, "404": 3}


async def test_a_wrong_method_counts_under_its_route():
    metrics = HttpMetrics()
    async with serve(EdgeConfig(), metrics) as client:
        assert (await client.get("/v1/echo")).status == 405
        assert (await client.post("/v1/items/7")).status == 405
        assert (await client.post("/nowhere")).status == 404
    samples = scrape(metrics)
    assert counted(samples, "GET", "/v1/echo", "405") == 1
    assert counted(samples, "POST", "/v1/items/{item}", "405") == 1
    assert counted(samples, "POST", "unmatched", "404") == 1


def test_snapshot_lists_requests_and_durations():
    metrics = HttpMetrics()
    metrics.observe("GET", "/health", 200, 0.002)
    metrics.observe("POST", "/v1/completions", 400, 0.02)
    snap = metrics.snapshot()
    assert snap["requests"] == [{"method": "GET", "path": "/health", "status": 200, "count": 1},
                                {"method": "POST", "path": "/v1/completions", "status": 400, "count": 1}]
    assert snap["by_status"] == {"200": 1, "400": 1}
    [health, _] = snap["durations"]
    assert (health["count"], health["buckets"][-1]) == (1, {"le": "+Inf", "count": 1})
