"""The aiohttp application: JSON in, typed requests down, JSON or SSE out.

JSON never goes below this package: handlers decode bodies into `GenerateRequest`s and
render the engine's events.
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass

import msgspec
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from pypto_serving.actors.replicas import ReplicaSet
from pypto_serving.core.generate_config import GenerateDefaults
from pypto_serving.core.request import (
    INVALID_MODEL_OUTPUT,
    Echo,
    Finished,
    InvalidRequest,
    Refused,
    TextDelta,
    check_token_ids,
)
from pypto_serving.core.version import version
from pypto_serving.http import bodies, protocol
from pypto_serving.http import responses as r
from pypto_serving.http.choices import ChoiceStreams, choice_requests
from pypto_serving.http.edge import REQUEST_ID
from pypto_serving.http.openapi import openapi_json
from pypto_serving.http.render import (
    Choice,
    Renderer,
    engine_error,
    error_body,
    json_response,
    stream_error,
)
from pypto_serving.http.responses_api import ResponsesEndpoint
from pypto_serving.process.heap import trim_freed_memory
from pypto_serving.telemetry.metrics import EngineMetrics
from pypto_serving.tokenizer.chat_template import ChatTemplateError

log = structlog.get_logger()


def _sse(body: object) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


class Handlers:
    def __init__(self, engine: ReplicaSet, served_name: str, defaults: GenerateDefaults,
                 parsers: protocol.ModelParsers | None = None, responses_store_size: int = 1000):
        self.engine = engine
        self.served_name = served_name
        self.defaults = defaults
        self.parsers = parsers or protocol.ModelParsers()
        self.created = int(time.time())
        self.responses = ResponsesEndpoint(engine, served_name, defaults, self.parsers, responses_store_size)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),  # ids may hold "/" (org/name)
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/responses", self.responses.handle),
            web.get("/openapi.json", self.openapi),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/version", self.version),
        ]

    async def health(self, request: web.Request) -> web.Response:
        """503 only when no replica can serve; with several, each one's state."""
        reason = self.engine.dead_reason
        replicas = None if len(self.engine) == 1 else [
            r.ReplicaHealth(label, "ok" if why is None else "error", why)
            for label, why in self.engine.states()]
        body = r.Health("ok" if reason is None else "error", reason, replicas)
        return json_response(body, 200 if reason is None else 503)

    async def models(self, request: web.Request) -> web.Response:
        return json_response(r.ModelList("list", [self._card()]))

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve (`client.models.retrieve(id)`): the served model's card, else 404."""
        name = request.match_info["model"]
        if name != self.served_name:
            message = f"The model '{name}' does not exist: this server serves '{self.served_name}'"
            return json_response(error_body(message, "model", kind="not_found", code=404), 404)
        return json_response(self._card())

    def _card(self) -> r.ModelCard:
        permission = r.ModelPermission(f"modelperm-{self.served_name}", "model_permission", self.created)
        return r.ModelCard(self.served_name, "model", self.created, "pypto-serving",
                           self.engine.config.worker.model.path, None,
                           self.engine.config.limits.max_model_len, [permission])

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=openapi_json(self.served_name), content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
        if self.engine.dead_reason is not None:
            return _engine_unavailable(self.engine.dead_reason)
        try:
            body = protocol.decode_body(await request.read(), bodies.TokenizeBody)
            prompt, special = protocol.parse_tokenize(body)
            _, ids = await self.engine.tokenizer_actor.encode(prompt, special, bounded=False)
        except InvalidRequest as exc:
            return json_response(error_body(exc.message, exc.param), 400)
        except (ChatTemplateError, ValueError, TypeError, RecursionError) as exc:
            return json_response(error_body(f"cannot tokenize: {exc}", "messages"), 400)
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return json_response(r.Tokenized(len(ids), self.engine.config.limits.max_model_len, ids, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        if self.engine.dead_reason is not None:
            return _engine_unavailable(self.engine.dead_reason)
        try:
            body = protocol.decode_body(await request.read(), bodies.DetokenizeBody)
            check_token_ids(body.tokens, self.engine.tokenizer.vocab_size, "tokens")
        except InvalidRequest as exc:
            return json_response(error_body(exc.message, exc.param), 400)
        return json_response(r.Detokenized(await self.engine.tokenizer_actor.decode(body.tokens)))

    async def version(self, request: web.Request) -> web.Response:
        return json_response(r.Version(version()))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, bodies.CompletionBody, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, bodies.ChatBody, chat=True)

    async def _generate(self, request: web.Request, body_type: type, chat: bool) -> web.StreamResponse:
        try:
            body = protocol.decode_body(await request.read(), body_type)
            if chat:
                parsed = protocol.parse_chat(body, self.defaults, self.parsers)
            else:
                parsed = protocol.parse_completion(body, self.defaults)
        except InvalidRequest as exc:
            return json_response(error_body(exc.message, exc.param), 400)
        parsed = protocol.with_request_id(parsed, request.get(REQUEST_ID))
        gen = parsed.request
        self.engine.metrics.observe("request_params_n", parsed.n)
        renderer = Renderer(gen.request_id, body.model or self.served_name, chat, gen.sampling.logprobs,
                            running_usage=parsed.running_usage, echo=gen.echo,
                            prompt_logprobs=parsed.prompt_logprobs)
        choices = ChoiceStreams(self.engine, choice_requests(gen, parsed.n), parsed.echo_only)
        return await self._respond(request, choices, renderer, parsed)

    async def _respond(self, request: web.Request, choices: ChoiceStreams, renderer: Renderer,
                       parsed: protocol.Parsed) -> web.StreamResponse:
        try:
            starts = await choices.start()  # the engine logs each request's received/finished lines
            renderer.started(starts[0].prompt_tokens)
            if parsed.stream:
                return await self._stream(request, choices, renderer, parsed.final_usage)
            return await self._collect(choices, renderer)
        except InvalidRequest as exc:
            return json_response(error_body(exc.message, exc.param), 400)
        finally:
            await choices.close()  # aborts whatever has not finished (client gone)

    async def _collect(self, choices: ChoiceStreams, renderer: Renderer) -> web.Response:
        results = [Choice() for _ in range(len(choices))]
        async for index, event in choices.events():
            match event:
                case Echo():
                    results[index].echo = event
                case TextDelta():
                    results[index].add(event)
                case Finished():
                    results[index].done = event
        malformed = [c.done for c in results if c.done.error_type == INVALID_MODEL_OUTPUT]
        if malformed:
            return json_response(error_body(malformed[0].error, kind=INVALID_MODEL_OUTPUT), 400)
        if all(c.done.finish_reason == "error" and not "".join(c.text) for c in results):
            kind, status = engine_error(results[0].done)
            return json_response(error_body(results[0].done.error or "engine error",
                                            kind=kind, code=status), status)
        return json_response(renderer.full(results))

    async def _stream(self, request: web.Request, choices: ChoiceStreams, renderer: Renderer,
                      final_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            await self._stream_events(response, choices, renderer, final_usage)
        except ConnectionResetError:  # the client went away: its choices are aborted on close
            return response
        return response

    async def _stream_events(self, response: web.StreamResponse, choices: ChoiceStreams,
                             renderer: Renderer, final_usage: bool) -> None:
        n = len(choices)
        if renderer.chat:
            for index in range(n):
                await response.write(_sse(renderer.role_chunk(index)))
        held: list[list] = [[] for _ in range(n)]  # logprobs of tokens whose text is held back
        dones: list[Finished] = []
        async for index, event in choices.events():
            if isinstance(event, TextDelta):
                renderer.generated(index, len(event.token_ids))
            match event:
                case Echo():
                    if (chunk := renderer.echo_chunk(index, event)) is not None:
                        await response.write(_sse(chunk))
                case TextDelta() if event.text or event.reasoning or event.tool_calls:
                    logprobs, held[index] = held[index] + list(event.logprobs), []
                    await response.write(_sse(renderer.chunk(index, event.text, event.reasoning,
                                                             logprobs, tool_calls=event.tool_calls)))
                case TextDelta():
                    held[index].extend(event.logprobs)
                case Finished() if event.error_type == INVALID_MODEL_OUTPUT:
                    # The 200 is already out: the error is an event, and the stream ends.
                    await response.write(_sse(stream_error(event.error, INVALID_MODEL_OUTPUT)))
                    break
                case Finished():
                    dones.append(event)
                    await response.write(_sse(renderer.chunk(
                        index, logprobs=held[index], finish_reason=event.finish_reason)))
                    if event.finish_reason == "error":  # the engine's reason, as an event
                        await response.write(_sse(stream_error(event.error or "engine error",
                                                               *engine_error(event))))
        else:
            if final_usage:
                await response.write(_sse(renderer.usage_chunk(dones)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()


def _engine_unavailable(reason: str) -> web.Response:
    response = json_response(error_body(f"the engine cannot serve: {reason}", kind="unavailable",
                                        code=503), 503)
    response.headers["Retry-After"] = "1"
    return response


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    """Unknown paths, wrong methods and refused requests get the same JSON error shape as
    bad bodies; a 405 says which methods the path has."""
    try:
        return await handler(request)
    except Refused as exc:
        response = json_response(error_body(exc.message, kind=exc.kind, code=exc.status), exc.status)
        if exc.retry_after is not None:
            response.headers["Retry-After"] = str(exc.retry_after)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = json_response(error_body(f"{request.method} {request.path}: {exc.reason}",
                                            kind="not_found" if exc.status == 404 else "http_error",
                                            code=exc.status), exc.status)
        if isinstance(exc, web.HTTPMethodNotAllowed):
            response.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
        return response


BIG_BODY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_request_bytes: int = 8 << 20  # larger bodies get 413 before they are read
    body_timeout: float | None = 30.0  # seconds a request's body may take to arrive (then 408)
    keepalive_timeout: float = 15.0  # an idle connection, or one still sending headers, closes


def bounded_bodies(limits: HttpLimits, metrics: EngineMetrics | None = None) -> web.middleware:
    """Reads every body before its handler runs, within `limits`: a body declared or found
    larger than `max_request_bytes` gets 413 unread, one that does not arrive within
    `body_timeout` gets 408; both close the connection. Handlers then read it from memory."""
    release = _MemoryRelease()

    @web.middleware
    async def read_body(request: web.Request, handler) -> web.StreamResponse:
        if not request.body_exists:
            return await handler(request)
        size = request.content_length
        try:
            if size is not None and size > limits.max_request_bytes:
                raise web.HTTPRequestEntityTooLarge(limits.max_request_bytes, size)
            size = len(await asyncio.wait_for(request.read(), limits.body_timeout))
        except web.HTTPRequestEntityTooLarge:
            if metrics is not None:
                metrics.rejected("body_too_large")
            declared = f"has {size} bytes" if size is not None else "is larger than that"
            return _closing(413, f"the request body {declared}: at most {limits.max_request_bytes} "
                                 "bytes are accepted (--max-request-bytes)", "request_too_large")
        except TimeoutError:
            return _closing(408, f"the request body did not arrive within {limits.body_timeout:g} s",
                            "request_timeout")
        try:
            return await handler(request)
        finally:
            if size >= BIG_BODY_BYTES:
                release.soon()

    return read_body


class _MemoryRelease:
    """After a big body's request: its copies (decoded text, a rejected request's traceback
    frames) sit in reference cycles until the collector runs. Collecting, then trimming the
    heap, hands their megabytes back to the OS with the request rather than requests later;
    at most once per `interval` seconds, so a client looping big bodies cannot make the loop
    collect on every one of them."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self._pending: asyncio.TimerHandle | None = None
        self._last = 0.0

    def soon(self) -> None:
        if self._pending is not None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last + self.interval - loop.time())
        self._pending = loop.call_later(delay, self._run)

    def _run(self) -> None:
        self._pending = None
        self._last = asyncio.get_running_loop().time()
        gc.collect()
        trim_freed_memory()  # and the heap's free pages between live blocks too


def _closing(status: int, message: str, kind: str) -> web.Response:
    response = json_response(error_body(message, kind=kind, code=status), status)
    response.force_close()  # the rest of the body is never read
    return response


def build_app(handlers: Handlers, limits: HttpLimits = HttpLimits()) -> web.Application:
    metrics = handlers.engine.metrics
    app = web.Application(middlewares=[errors_as_json, bounded_bodies(limits, metrics)],
                          client_max_size=limits.max_request_bytes)
    app.add_routes(handlers.routes())
    return app


class _JsonErrorProtocol(RequestHandler):
    """aiohttp's connection handler, answering malformed HTTP with the JSON error shape (and
    a line at INFO: a client's garbage is not this server's error)."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not 400 <= status < 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        log.info("malformed HTTP request", status=status, error=message or str(exc),
                 client=request.remote)
        text = f"malformed HTTP request: {message or exc or 'cannot parse it'}"
        return _closing(status, text, "invalid_request_error")


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorProtocol(self, loop=self._loop, **self._kwargs)


class AppRunner(web.AppRunner):
    """web.AppRunner whose connections answer malformed HTTP in JSON (`_JsonErrorProtocol`)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # aiohttp's own, with every handler argument
        return _Server(server.request_handler, request_factory=server.request_factory,
                       handler_cancellation=server.handler_cancellation, loop=server._loop,
                       **server._kwargs)
