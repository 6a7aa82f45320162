"""Operations routes: /metrics, /metrics/json and, with --profile, /start_profile and
/stop_profile; plus the middleware that answers 503 while the server drains and records an
"http" trace span per request while a profile is recording.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import orjson
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pypto_serving.actors.replicas import ReplicaSet
from pypto_serving.http.render import error_body
from pypto_serving.telemetry.http_metrics import HttpMetrics
from pypto_serving.telemetry.metrics import render_families
from pypto_serving.telemetry.profiling import ProfileError, Profiler, TraceNotWritten, clock_us

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# still answered while draining: scrapers and the profile may outlive the last request
DRAIN_RETRY_AFTER_S = 5  # a draining server is about to go: another instance may answer
_OPS_PATHS = frozenset({"/metrics", "/metrics/json", "/start_profile", "/stop_profile"})

log = structlog.get_logger()


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


class Ops:
    def __init__(self, engine: ReplicaSet, profiler: Profiler | None,
                 http_metrics: HttpMetrics | None = None):
        self.engine = engine
        self.profiler = profiler
        self.http_metrics = http_metrics or HttpMetrics()  # the edge's (http/edge.py)
        self.draining = False

    def install(self, app: web.Application) -> None:
        app.add_routes(self.routes())
        app.middlewares.append(self.middleware())

    def endpoints(self) -> list[str]:
        return [f"{r.method} {r.path}" for r in self.routes()]

    def routes(self) -> list[web.RouteDef]:
        routes = [web.get("/metrics", self.metrics), web.get("/metrics/json", self.metrics_json)]
        if self.profiler is not None:
            routes += [web.post("/start_profile", self.start_profile),
                       web.post("/stop_profile", self.stop_profile)]
        return routes

    async def metrics(self, request: web.Request) -> web.Response:
        # read here: the actors run on this loop
        families = self.engine.metrics.families() + self.http_metrics.families()
        body = await asyncio.get_running_loop().run_in_executor(None, render_families, families)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def metrics_json(self, request: web.Request) -> web.Response:
        return _json({**self.engine.metrics.snapshot(), "http": self.http_metrics.snapshot()})

    async def start_profile(self, request: web.Request) -> web.Response:
        try:
            self.profiler.start()
        except ProfileError as exc:
            return _json(error_body(str(exc)), 400)
        return _json({"status": "recording", "levels": list(self.profiler.config.levels),
                      "output": str(self.profiler.output)})

    async def stop_profile(self, request: web.Request) -> web.Response:
        try:
            written = await self.profiler.stop()
        except ProfileError as exc:
            return _json(error_body(str(exc)), 400)
        except TraceNotWritten as exc:
            log.error("profile not written", error=str(exc))
            return _json(error_body(str(exc), kind="server_error", code=500), 500)
        return _json({"status": "stopped", **written})

    async def stop_recording(self) -> None:
        """Shutdown: stop a recording and merge what exists."""
        if self.profiler is not None and self.profiler.state == "recording":
            await self.profiler.stop()

    def middleware(self) -> Callable:
        @web.middleware
        async def draining_and_spans(request: web.Request, handler: Handler) -> web.StreamResponse:
            if self.draining and request.path not in _OPS_PATHS:
                return _unavailable(request)
            recorder = self.engine.recorder
            if not recorder.active:
                return await handler(request)
            lane, start = recorder.acquire_lane(), clock_us()
            try:
                return await handler(request)
            finally:
                recorder.complete(f"{request.method} {request.path}", "http", start, tid=lane)
                recorder.release_lane(lane)

        return draining_and_spans


def _unavailable(request: web.Request) -> web.Response:
    message = "the server is shutting down"
    body = {"status": "error", "reason": message} if request.path == "/health" else \
        error_body(message, kind="unavailable", code=503)
    response = _json(body, 503)
    response.headers["Retry-After"] = str(DRAIN_RETRY_AFTER_S)
    return response
