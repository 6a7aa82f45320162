"""The aiohttp application: JSON in, typed requests down, JSON or SSE out.

JSON never goes below this package: handlers decode bodies into `GenerateRequest`s and
render the engine's events.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import orjson
import structlog
from aiohttp import web

from pypto_serving.engine import Engine
from pypto_serving.generate_config import GenerateDefaults
from pypto_serving.http import protocol
from pypto_serving.http.render import Renderer, error_body
from pypto_serving.requests import Finished, GenerateRequest, InvalidRequest, Started, TextDelta

log = structlog.get_logger()


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _sse(body: object) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class Handlers:
    def __init__(self, engine: Engine, served_name: str, defaults: GenerateDefaults):
        self.engine = engine
        self.served_name = served_name
        self.defaults = defaults
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
        ]

    async def health(self, request: web.Request) -> web.Response:
        reason = self.engine.dead_reason
        if reason is not None:
            return json_response({"status": "error", "reason": reason}, 503)
        return json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.served_name, "object": "model", "created": self.created,
                "owned_by": "pypto-serving", "max_model_len": self.engine.config.limits.max_model_len}
        return json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.CompletionBody, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.ChatBody, chat=True)

    async def _generate(self, request: web.Request, body_type: type, chat: bool) -> web.StreamResponse:
        try:
            body = protocol.decode_body(await request.read(), body_type)
            build = protocol.chat_request if chat else protocol.completion_request
            gen = build(body, self.defaults)
            stream = protocol.wants_stream(body, self.defaults)
        except InvalidRequest as exc:
            return json_response(error_body(exc.message, exc.param), 400)
        renderer = Renderer(gen.request_id, body.model or self.served_name, chat)
        return await self._respond(request, gen, renderer, stream)

    async def _respond(self, request: web.Request, gen: GenerateRequest, renderer: Renderer,
                       stream: bool) -> web.StreamResponse:
        events = self.engine.generate(gen)
        try:
            started = await anext(events)
            assert isinstance(started, Started)
            log.info("request received", request_id=gen.request_id,
                     prompt_tokens=started.prompt_tokens, max_new_tokens=started.max_tokens)
            if stream:
                return await self._stream(request, events, renderer)
            return await self._collect(events, renderer)
        except InvalidRequest as exc:
            return json_response(error_body(exc.message, exc.param), 400)
        finally:
            await events.aclose()

    async def _collect(self, events: AsyncIterator, renderer: Renderer) -> web.Response:
        parts = []
        async for event in events:
            match event:
                case TextDelta(text):
                    parts.append(text)
                case Finished():
                    log_finished(renderer.request_id, event)
                    if event.finish_reason == "error" and not parts:
                        return json_response(error_body(event.error or "engine error",
                                                        kind="engine_error", code=500), 500)
                    return json_response(renderer.full("".join(parts), event))
        raise RuntimeError("request stream ended without a Finished event")

    async def _stream(self, request: web.Request, events: AsyncIterator,
                      renderer: Renderer) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        if renderer.chat:
            await response.write(_sse(renderer.chunk(text="", role=True)))
        async for event in events:
            match event:
                case TextDelta(text) if text:
                    await response.write(_sse(renderer.chunk(text)))
                case Finished():
                    log_finished(renderer.request_id, event)
                    await response.write(_sse(renderer.chunk(finish_reason=event.finish_reason)))
                    await response.write(_sse(renderer.usage_chunk(event)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def log_finished(request_id: str, done: Finished) -> None:
    log.info("request finished", request_id=request_id, prompt_tokens=done.prompt_tokens,
             output_tokens=done.completion_tokens, reason=done.finish_reason, error=done.error)


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    """Unknown paths and wrong methods get the same JSON error shape as bad bodies."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_response(error_body(f"{request.method} {request.path}: {exc.reason}",
                                        kind="not_found" if exc.status == 404 else "http_error",
                                        code=exc.status), exc.status)


def build_app(handlers: Handlers) -> web.Application:
    app = web.Application(middlewares=[errors_as_json], client_max_size=64 * 1024 * 1024)
    app.add_routes(handlers.routes())
    return app
