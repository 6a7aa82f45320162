"""The aiohttp application: JSON in, typed requests down, JSON or SSE out.

JSON never goes below this package: handlers decode bodies into `GenerateRequest`s and
render the engine's events.
"""

from __future__ import annotations

import importlib.metadata
import time

import msgspec
import structlog
from aiohttp import web

from pypto_serving.actors.engine import Engine
from pypto_serving.core.generate_config import GenerateDefaults
from pypto_serving.core.request import (
    INVALID_MODEL_OUTPUT,
    Finished,
    InvalidRequest,
    TextDelta,
    check_token_ids,
)
from pypto_serving.http import bodies, protocol
from pypto_serving.http import responses as r
from pypto_serving.http.choices import ChoiceStreams, choice_requests
from pypto_serving.http.openapi import openapi_json
from pypto_serving.http.render import Choice, Renderer, error_body, json_response, stream_error
from pypto_serving.http.responses_api import ResponsesEndpoint
from pypto_serving.tokenizer.chat_template import ChatTemplateError

log = structlog.get_logger()


def _sse(body: object) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


class Handlers:
    def __init__(self, engine: Engine, served_name: str, defaults: GenerateDefaults,
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
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/responses", self.responses.handle),
            web.get("/openapi.json", self.openapi),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/version", self.version),
        ]

    async def health(self, request: web.Request) -> web.Response:
        reason = self.engine.dead_reason
        if reason is not None:
            return json_response({"status": "error", "reason": reason}, 503)
        return json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        permission = r.ModelPermission(f"modelperm-{self.served_name}", "model_permission", self.created)
        card = r.ModelCard(self.served_name, "model", self.created, "pypto-serving",
                           self.engine.config.worker.model.path, None,
                           self.engine.config.limits.max_model_len, [permission])
        return json_response(r.ModelList("list", [card]))

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=openapi_json(), content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
        try:
            body = protocol.decode_body(await request.read(), bodies.TokenizeBody)
            prompt, special = protocol.parse_tokenize(body)
            _, ids = await self.engine.tokenizer_actor.encode(prompt, special)
        except InvalidRequest as exc:
            return json_response(error_body(exc.message, exc.param), 400)
        except (ChatTemplateError, ValueError, TypeError, RecursionError) as exc:
            return json_response(error_body(f"cannot tokenize: {exc}", "messages"), 400)
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return json_response(r.Tokenized(len(ids), self.engine.config.limits.max_model_len, ids, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = protocol.decode_body(await request.read(), bodies.DetokenizeBody)
            check_token_ids(body.tokens, self.engine.tokenizer.vocab_size, "tokens")
        except InvalidRequest as exc:
            return json_response(error_body(exc.message, exc.param), 400)
        return json_response(r.Detokenized(await self.engine.tokenizer_actor.decode(body.tokens)))

    async def version(self, request: web.Request) -> web.Response:
        return json_response(r.Version(importlib.metadata.version("pypto-serving")))

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
        gen = parsed.request
        self.engine.metrics.observe("request_params_n", parsed.n)
        renderer = Renderer(gen.request_id, body.model or self.served_name, chat, gen.sampling.logprobs,
                            running_usage=parsed.running_usage)
        choices = ChoiceStreams(self.engine, choice_requests(gen, parsed.n))
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
                case TextDelta():
                    results[index].add(event)
                case Finished():
                    results[index].done = event
        malformed = [c.done for c in results if c.done.error_type == INVALID_MODEL_OUTPUT]
        if malformed:
            return json_response(error_body(malformed[0].error, kind=INVALID_MODEL_OUTPUT), 400)
        if all(c.done.finish_reason == "error" and not "".join(c.text) for c in results):
            return json_response(error_body(results[0].done.error or "engine error",
                                            kind="engine_error", code=500), 500)
        return json_response(renderer.full(results))

    async def _stream(self, request: web.Request, choices: ChoiceStreams, renderer: Renderer,
                      final_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
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
                                                               "engine_error", 500)))
        else:
            if final_usage:
                await response.write(_sse(renderer.usage_chunk(dones)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


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
