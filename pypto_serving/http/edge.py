"""The server's edge: request ids, the access log, HTTP metrics, CORS and API keys.

Wiring, once, before the app is frozen (before `AppRunner.setup()` / `run_app`):

    http_metrics = HttpMetrics()
    install_edge(app, EdgeConfig(api_keys=load_api_keys(flag_values), ...), http_metrics)
    # /metrics: engine families + http_metrics.families(); /metrics/json: + http_metrics.snapshot()
    # AppRunner(app, access_log=None): this module writes the access log

`install_edge` puts its middlewares in front of the app's own, outermost first, so it sees the
final status of every request (404/405 JSON answers, 503 while draining included):
1. `observe`: request id, one access-log line and the HTTP metrics per request, timed until
   the handler returns. `bytes`: a plain response's body length; for a response the handler
   prepared (a stream), what its writer sent so far, headers and chunk framing included (as
   aiohttp's `body_length`). A client gone mid-response (the handler cancelled, or a write
   raising `ConnectionError` on a closing transport) is status 499 (nginx's "client closed
   request") at INFO, not aiohttp's ERROR traceback. Answered polls of /health and /metrics
   are logged at DEBUG (a scraper every few seconds is noise); their failures at INFO.
2. `preflight` (only with `allowed_origins`): a CORS preflight (`OPTIONS` with
   `Access-Control-Request-Method`) on any path is answered 204 here, before any key check;
   403 when its origin is not allowed.
3. `authenticate` (only with `api_keys`): deny by default. Open without a key: the routes
   `/health`, `/version`, `/openapi.json`, and `/metrics`, `/metrics/json` unless
   `metrics_require_auth`. Everything else (`/v1/*`, `/tokenize`, `/detokenize`, the profile
   routes, unknown paths) needs `Authorization: Bearer <key>`, compared in constant time with
   every key; else a 401 in the usual error shape with `WWW-Authenticate: Bearer`.
Headers go on in an `on_response_prepare` hook (installed by `install_edge` too), so streams
a handler prepares itself get them: `X-Request-Id` always; with CORS, `Vary: Origin` and, for
an allowed `Origin`, `Access-Control-Allow-Origin` (`*` when `*` is allowed, else the origin)
and `Access-Control-Expose-Headers: X-Request-Id`.

The request id is the client's `X-Request-Id` when it is printable ASCII of at most 128
characters, else a fresh uuid4 hex; handlers read it with `request_id_of(request)` (stored
under the `REQUEST_ID` request key).
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from aiohttp import web

from pypto_serving.http.render import error_body, json_response
from pypto_serving.telemetry.http_metrics import UNMATCHED, HttpMetrics

log = structlog.get_logger()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID_HEADER = "X-Request-Id"
# aiohttp >= 3.13 warns on plain string keys in a request's storage
REQUEST_ID = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "request_id"
CLIENT_CLOSED = 499
OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json"})
METRICS_PATHS = frozenset({"/metrics", "/metrics/json"})
SCRAPED_PATHS = METRICS_PATHS | {"/health"}  # logged at DEBUG when they succeed
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
ALLOW_METHODS = "GET, HEAD, POST, OPTIONS"
DEFAULT_ALLOW_HEADERS = f"Authorization, Content-Type, {REQUEST_ID_HEADER}"
PREFLIGHT_MAX_AGE_S = 600
_MAX_REQUEST_ID = 128
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """`api_keys`: empty means no auth; `allowed_origins`: empty means no CORS, `*` any."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)  # secrets stay out of logs
    metrics_require_auth: bool = False
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if any(not key or any(c.isspace() for c in key) for key in self.api_keys):
            raise ValueError("an API key is empty or contains whitespace")
        for origin in self.allowed_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"allowed origin {origin!r}: give `*` or scheme://host[:port], "
                                 "without a path or trailing slash")


def load_api_keys(values: Iterable[str]) -> tuple[str, ...]:
    """Flag values to keys: each value is a key or `@path`, a file of one key per line (blank
    lines and `#` comments skipped). No values: no keys (auth off). Raises ValueError for an
    unreadable or keyless file; EdgeConfig rejects empty keys."""
    keys: list[str] = []
    for value in values:
        keys += _read_key_file(value[1:]) if value.startswith("@") else [value.strip()]
    return tuple(dict.fromkeys(keys))


def _read_key_file(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"API key file {path!r} cannot be read: {exc}") from exc
    lines = (line.strip() for line in text.splitlines())
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise ValueError(f"API key file {path!r} has no key: one key per line, "
                         "blank lines and # comments are skipped")
    return keys


def install_edge(app: web.Application, config: EdgeConfig, metrics: HttpMetrics) -> None:
    edge = _Edge(config, metrics)
    middlewares = [edge.observe]
    if config.allowed_origins:
        middlewares.append(edge.preflight)
    if config.api_keys:
        middlewares.append(edge.authenticate)
    for middleware in reversed(middlewares):
        app.middlewares.insert(0, middleware)
    app.on_response_prepare.append(edge.on_prepare)


def request_id_of(request: web.BaseRequest) -> str:
    """The id `observe` gave this request (for handlers: ids in bodies, log lines)."""
    return request[REQUEST_ID]


def accept_request_id(given: str | None) -> str:
    """The client's id when it is safe to log and echo, else a fresh one."""
    if given and len(given) <= _MAX_REQUEST_ID and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


def route_path(request: web.BaseRequest) -> str:
    """The matched route's canonical path: a bounded metric label, unlike `request.path`. A
    wrong method on a known path (405) counts under that path's route too."""
    route = getattr(request.match_info, "route", None)
    resource = getattr(route, "resource", None)
    if resource is not None:
        return resource.canonical
    if not isinstance(getattr(request.match_info, "http_exception", None), web.HTTPMethodNotAllowed):
        return UNMATCHED
    path = request.path
    for known in request.app.router.resources():
        info = known.get_info()
        if info.get("path") == path or ("pattern" in info and info["pattern"].fullmatch(path)):
            return known.canonical
    return UNMATCHED


def key_matches(token: str, keys: tuple[bytes, ...]) -> bool:
    """Constant time in the keys and their contents: every key is compared, no early exit."""
    given = token.encode("utf-8", "surrogateescape")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


def bearer_token(header: str | None) -> str | None:
    scheme, _, token = (header or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class _Edge:
    """The middlewares and the prepare hook of one app, sharing its config and metrics."""

    def __init__(self, config: EdgeConfig, metrics: HttpMetrics):
        self.metrics = metrics
        self.origins = tuple(o.lower() for o in config.allowed_origins)
        self.keys = tuple(key.encode() for key in config.api_keys)
        self.open_paths = OPEN_PATHS if config.metrics_require_auth else OPEN_PATHS | METRICS_PATHS

    @web.middleware
    async def observe(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        request[REQUEST_ID] = accept_request_id(request.headers.get(REQUEST_ID_HEADER))
        start, status, response = time.perf_counter(), 500, None
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status, response = exc.status, exc
            raise
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        except ConnectionError:
            if not _client_gone(request):
                raise
            status = CLIENT_CLOSED
            return web.Response(status=CLIENT_CLOSED)  # unsendable; aiohttp drops it quietly
        finally:
            self._record(request, status, response, time.perf_counter() - start)

    def _record(self, request: web.Request, status: int, response: web.StreamResponse | None,
                seconds: float) -> None:
        method = request.method if request.method in METHODS else "other"
        path = route_path(request)
        self.metrics.observe(method, path, status, seconds)
        # a scraper's or a load balancer's answered poll every few seconds is noise at INFO
        polled = path in SCRAPED_PATHS and status < 400
        (log.debug if polled else log.info)(
            "http request", method=request.method, path=request.path, status=status,
            bytes=_bytes_sent(request, response), duration_ms=round(seconds * 1000, 3),
            request_id=request[REQUEST_ID], client=request.remote)

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        origin = request.headers.get("Origin")
        if self.allow_origin(origin) is None:
            return json_response(error_body(f"origin {origin!r} is not allowed (CORS)",
                                            kind="http_error", code=403), 403)
        asked = request.headers.get("Access-Control-Request-Headers")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Allow-Headers": asked or DEFAULT_ALLOW_HEADERS,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if route_path(request) in self.open_paths:
            return await handler(request)
        token = bearer_token(request.headers.get("Authorization"))
        if token is None:
            return _unauthorized("missing API key: send the header `Authorization: Bearer <key>`",
                                 "Bearer")
        if not key_matches(token, self.keys):
            return _unauthorized("invalid API key", 'Bearer error="invalid_token"')
        return await handler(request)

    async def on_prepare(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        rid = request.get(REQUEST_ID)
        if rid is not None:
            response.headers[REQUEST_ID_HEADER] = rid
        if not self.origins:
            return
        _add_vary(response, "Origin")
        allow = self.allow_origin(request.headers.get("Origin"))
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
            response.headers["Access-Control-Expose-Headers"] = REQUEST_ID_HEADER

    def allow_origin(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for `origin`, None when it is not allowed."""
        if not origin:
            return None
        if "*" in self.origins:
            return "*"
        return origin if origin.lower() in self.origins else None


def _unauthorized(message: str, challenge: str) -> web.Response:
    response = json_response(error_body(message, kind="authentication_error", code=401), 401)
    response.headers["WWW-Authenticate"] = challenge
    return response


def _client_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _bytes_sent(request: web.BaseRequest, response: web.StreamResponse | None) -> int:
    if response is not None and not response.prepared:  # aiohttp sends it after us
        return response.content_length or 0
    return request.writer.output_size


def _add_vary(response: web.StreamResponse, header: str) -> None:
    present = [v.strip().lower() for v in response.headers.get("Vary", "").split(",") if v.strip()]
    if header.lower() not in present and "*" not in present:
        current = response.headers.get("Vary")
        response.headers["Vary"] = f"{current}, {header}" if current else header
