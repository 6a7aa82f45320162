"""POST /v1/responses: OpenAI's Responses API over the chat pipeline.

A request becomes a chat request: `instructions` a system message, the stored conversation
of `previous_response_id` (kept in memory, the newest `--responses-store-size`), then the
`input` items (messages, function calls and their outputs). The reply becomes `output`
items: a `reasoning` item (when the model thinks), a `message` with `output_text`, and one
`function_call` per call. `stream: true` sends the Responses event types
(`response.created`, `response.output_text.delta`, `response.completed`, ...).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
from aiohttp import web

from pypto_serving.actors.replicas import ReplicaSet
from pypto_serving.core.generate_config import GenerateDefaults
from pypto_serving.core.request import INVALID_MODEL_OUTPUT, Finished, InvalidRequest, TextDelta
from pypto_serving.http import bodies, protocol
from pypto_serving.http.choices import ChoiceStreams
from pypto_serving.http.edge import REQUEST_ID
from pypto_serving.http.render import engine_error, error_body, json_response

# -- the request -----------------------------------------------------------------------


class FunctionTool(msgspec.Struct, kw_only=True):
    """A Responses function tool: flat, where chat nests it under `function`."""

    type: Literal["function"]
    name: bodies.ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str


class ResponsesBody(msgspec.Struct, kw_only=True):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: bodies.Positive | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    ignore_eos: bool | None = None  # vLLM's extension (its benchmark client sends it)
    # known, not implemented: refused unless at a default (UNIMPLEMENTED)
    text: Any = None
    background: Any = None
    service_tier: Any = None
    include: Any = None
    top_logprobs: Any = None
    conversation: Any = None
    truncation: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    prompt: Any = None


# Values a known but unimplemented Responses field may take: the defaults, which ask for
# nothing this server lacks (as chat's and completions' bodies.UNIMPLEMENTED_DEFAULTS;
# protocol.refuse_unimplemented refuses the rest)
UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "text": (None, {"format": {"type": "text"}}), "background": (None, False),
    "service_tier": (None, "auto", "default"), "include": (None, []), "top_logprobs": (None, 0),
    "conversation": (None,), "truncation": (None, "disabled"), "reasoning": (None,),
    "max_tool_calls": (None,), "prompt": (None,),
}


# -- the response ----------------------------------------------------------------------


class OutputText(msgspec.Struct):
    text: str
    type: Literal["output_text"] = "output_text"
    annotations: list[Any] = []


class ReasoningText(msgspec.Struct):
    text: str
    type: Literal["reasoning_text"] = "reasoning_text"


class MessageItem(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = []


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0  # what the prompt put into the prefix cache


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponsesUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class Response(msgspec.Struct):
    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[OutputItem]
    tools: list[FunctionTool]
    tool_choice: Any
    parallel_tool_calls: bool
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    usage: ResponsesUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    object: Literal["response"] = "response"


# -- from Responses input to chat messages -----------------------------------------------


def _part_text(i: int, part: Any) -> str:
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text") \
            and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequest(f"input[{i}] has a {kind!r} content part: only text parts are supported "
                         "by this text-only model", "input")


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(f"input[{i}] has role {role!r}: expected user, system, developer or "
                             "assistant", "input")
    if isinstance(content, list):
        content = "\n".join(_part_text(i, p) for p in content)
    if not isinstance(content, str):
        raise InvalidRequest(f"input[{i}].content must be a string or a list of text parts", "input")
    return {"role": role, "content": content}


def _function_call(i: int, item: dict[str, Any]) -> dict[str, Any]:
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise InvalidRequest(f"input[{i}] is a function_call without string call_id, name and "
                             "arguments", "input")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(i: int, item: dict[str, Any]) -> dict[str, Any]:
    output = item.get("output")
    if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
        raise InvalidRequest(f"input[{i}] is a function_call_output without string call_id and "
                             "output", "input")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def input_messages(items: str | list[dict[str, Any]], calls: set[str] | None = None) -> list[dict[str, Any]]:
    """The chat messages of a Responses `input`; consecutive function calls are one turn.
    `calls` (None: not checked): the call ids of the stored conversation it continues; each
    function_call_output must answer one of them or an earlier function_call of the input
    (refused in the input's terms here, not in those of the chat request it becomes)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    known = None if calls is None else set(calls)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(i, item))
        elif kind == "function_call":
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                last = {"role": "assistant", "content": None, "tool_calls": []}
                out.append(last)
            last["tool_calls"].append(_function_call(i, item))
            if known is not None:
                known.add(item["call_id"])
        elif kind == "function_call_output":
            out.append(_call_output(i, item))
            if known is not None and item["call_id"] not in known:
                raise InvalidRequest(f"input[{i}] is a function_call_output whose call_id "
                                     f"{item['call_id']!r} answers no earlier function_call", "input")
        else:
            raise InvalidRequest(f"input[{i}] is a {kind!r} item: expected message, function_call "
                                 "or function_call_output", "input")
    return out


def _function(tool: FunctionTool) -> dict[str, Any]:
    """A flat Responses tool as chat's nested `function` (everything but its `type`)."""
    return {k: v for k, v in msgspec.to_builtins(tool).items() if k != "type"}


def chat_body(body: ResponsesBody, history: list[dict[str, Any]]) -> bodies.ChatBody:
    """The chat request that answers `body` after the stored `history`."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else [])
    stored_calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    messages += history + input_messages(body.input, stored_calls)
    fields: dict[str, Any] = {
        "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls, "ignore_eos": body.ignore_eos,
        "tools": [{"type": "function", "function": _function(t)} for t in body.tools] if body.tools else None,
        "tool_choice": ({"type": "function", "function": {"name": body.tool_choice.name}}
                        if isinstance(body.tool_choice, NamedFunction) else body.tool_choice),
    }
    try:  # fields left unset take the server's defaults, as an omitted chat field does
        return msgspec.convert({k: v for k, v in fields.items() if v is not None}, bodies.ChatBody)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}", "input") from None


# -- the store ---------------------------------------------------------------------------


class ResponseStore:
    """The conversations of the newest `size` stored responses, for `previous_response_id`."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def history(self, response_id: str | None) -> list[dict[str, Any]]:
        if response_id is None:
            return []
        if response_id not in self._items:
            raise InvalidRequest(f"previous response {response_id!r} is not stored here (the newest "
                                 f"{self.size} are)", "previous_response_id")
        return list(self._items[response_id])

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        if self.size <= 0:
            return
        self._items[response_id] = conversation
        while len(self._items) > self.size:
            self._items.popitem(last=False)


# -- building the response -----------------------------------------------------------------


class ResponseBuilder:
    """One response: its items as the events come, and the conversation to store.

    Items keep the order in which they began (`order`): the reasoning, the message and each
    call as its first text or its name came, so a stream can announce each at its final index.
    A call that max_output_tokens cut off stays an item, `incomplete`, once its name came
    (as streamed); cut before that, its text ends the message, as in a chat reply. A call of
    a `strict` tool is held until it is complete (clients parse its arguments as JSON: the
    OpenAI SDK's `parse` does), and comes after the other items; cut, its text ends the
    message."""

    def __init__(self, body: ResponsesBody, model: str):
        self.body = body
        self.id = f"resp_{uuid.uuid4().hex}"
        self.model = model
        self.created_at = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[list[str]] = []  # by index: call id, name, then argument fragments
        self.order: list[str | int] = []  # "reasoning", "message", a call's index
        self.strict = {t.name for t in body.tools or () if t.strict}
        self.held: set[int] = set()  # the calls of strict tools
        self.done: Finished | None = None

    def add(self, event: TextDelta | Finished) -> None:
        if not isinstance(event, TextDelta):
            self.done = event
            return
        for key, text, parts in (("reasoning", event.reasoning, self.reasoning),
                                 ("message", event.text, self.text)):
            if text:
                if not parts:
                    self.order.append(key)
                parts.append(text)
        for call in event.tool_calls:
            if call.index == len(self.calls):  # its first delta: id and name
                self.calls.append([call.id or "", call.name or ""])
                if call.name in self.strict:
                    self.held.add(call.index)
                else:
                    self.order.append(call.index)
            if call.arguments:
                self.calls[call.index].append(call.arguments)

    def item_id(self, key: str | int) -> str:
        if key == "reasoning":
            return self.reasoning_id
        if key == "message":
            return self.message_id
        return "fc_" + self.calls[key][0].removeprefix("call_")

    def message_text(self) -> str:
        """The reply's text, and the text of a call cut before its name came."""
        cut = self.done.cut_call if self.done is not None and not self._cut_item() else ""
        return "".join(self.text) + cut

    def items(self) -> list[OutputItem]:
        complete = len(self.done.tool_calls) if self.done is not None else 0
        keys = self.order + sorted(i for i in self.held if i < complete)
        calls = [k for k in keys if isinstance(k, int)]
        if "message" not in keys and (self.message_text() or not calls):
            keys.append("message")
        return [self._item(key) for key in keys]

    def _item(self, key: str | int) -> OutputItem:
        if key == "reasoning":
            return ReasoningItem(self.reasoning_id, [ReasoningText("".join(self.reasoning))])
        if key == "message":
            status = "incomplete" if self._incomplete() else "completed"
            return MessageItem(self.message_id, [OutputText(self.message_text())], status)
        complete = self.done.tool_calls if self.done is not None else ()
        if key < len(complete):
            call = complete[key]
            return FunctionCallItem(self.item_id(key), call.id, call.name, call.arguments)
        call_id, name, *arguments = self.calls[key]
        return FunctionCallItem(self.item_id(key), call_id, name, "".join(arguments), "incomplete")

    def _cut_item(self) -> bool:
        """Whether a call was cut after its name came and streamed (an incomplete item, not
        message text)."""
        done = self.done
        return done is not None and len(self.calls) > len(done.tool_calls) \
            and len(done.tool_calls) not in self.held

    def _incomplete(self) -> bool:
        """Cut off: by max_output_tokens, or by the server (a shutdown's drain timeout)."""
        return self.done is not None and self.done.finish_reason in ("length", "aborted")

    def response(self, status: str | None = None) -> Response:
        done, body = self.done, self.body
        usage = None
        if done is not None:
            usage = ResponsesUsage(done.prompt_tokens, done.completion_tokens,
                                   done.prompt_tokens + done.completion_tokens,
                                   InputTokensDetails(done.cached_tokens, done.cache_writes))
        status = status or ("incomplete" if self._incomplete() else "completed")
        return Response(
            self.id, self.created_at, self.model, status, self.items() if done else [],
            list(body.tools or []), body.tool_choice or "auto", body.parallel_tool_calls is not False,
            body.instructions, body.max_output_tokens, body.previous_response_id, body.temperature,
            body.top_p, usage,
            IncompleteDetails("max_output_tokens") if done and done.finish_reason == "length" else None)

    def conversation(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What a later request continuing this one reads before its own input: the complete
        calls as calls, a cut one as the text it was (as a chat reply gives it)."""
        done = self.done
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) + done.cut_call}
        if done.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in done.tool_calls]
        return history + input_messages(self.body.input) + [turn]


# -- streaming -------------------------------------------------------------------------------

Send = Callable[[str, dict[str, Any]], Awaitable[None]]


class EventWriter:
    """The Responses stream's events, numbered in order. Each item is announced at the index
    it has in the final `output` (the order in which the items began)."""

    def __init__(self, send: Send, builder: ResponseBuilder):
        self.send, self.builder = send, builder
        self.sequence = 0
        self.streamed: dict[str, int] = {}  # announced items: characters of text sent

    async def event(self, kind: str, **fields: Any) -> None:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        await self.send(kind, payload)

    async def start(self) -> None:
        response = msgspec.to_builtins(self.builder.response("in_progress"))
        await self.event("response.created", response=response)
        await self.event("response.in_progress", response=response)

    async def delta(self, event: TextDelta) -> None:
        """After `builder.add(event)`: its text, reasoning and call arguments."""
        builder = self.builder
        if event.reasoning:
            await self._text("reasoning", "reasoning_text", event.reasoning)
        if event.text:
            await self._text("message", "output_text", event.text)
        for call in event.tool_calls:
            if call.index in builder.held:  # announced whole once complete (finish)
                continue
            call_id, name = builder.calls[call.index][:2]
            await self._arguments(builder.item_id(call.index), builder.order.index(call.index), call_id,
                                  name, call.arguments)

    async def _arguments(self, item_id: str, index: int, call_id: str, name: str, fragment: str) -> None:
        """A fragment of a call's arguments, announcing the call first."""
        if item_id not in self.streamed:
            self.streamed[item_id] = 0
            item = FunctionCallItem(item_id, call_id, name, "", "in_progress")
            await self.event("response.output_item.added", output_index=index, item=msgspec.to_builtins(item))
        if fragment:
            await self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                             delta=fragment)

    async def _text(self, key: str, kind: str, text: str, index: int | None = None) -> None:
        """`text` of the reasoning or the message, announcing the item first."""
        item_id = self.builder.item_id(key)
        index = self.builder.order.index(key) if index is None else index
        if item_id not in self.streamed:
            self.streamed[item_id] = 0
            reasoning = key == "reasoning"
            item = ReasoningItem(item_id, []) if reasoning else MessageItem(item_id, [], "in_progress")
            part = ReasoningText("") if reasoning else OutputText("")
            await self.event("response.output_item.added", output_index=index, item=msgspec.to_builtins(item))
            await self.event("response.content_part.added", item_id=item_id, output_index=index,
                             content_index=0, part=msgspec.to_builtins(part))
        if text:
            self.streamed[item_id] += len(text)
            await self.event(f"response.{kind}.delta", item_id=item_id, output_index=index,
                             content_index=0, delta=text, **_no_logprobs(kind))

    async def finish(self) -> None:
        response = self.builder.response()
        for index, item in enumerate(response.output):
            data = msgspec.to_builtins(item)
            if isinstance(item, FunctionCallItem):
                if item.id not in self.streamed:  # a strict tool's call, held until complete
                    await self._arguments(item.id, index, item.call_id, item.name, item.arguments)
                await self.event("response.function_call_arguments.done", item_id=item.id,
                                 output_index=index, arguments=item.arguments)
            else:
                key, kind = (("message", "output_text") if isinstance(item, MessageItem)
                             else ("reasoning", "reasoning_text"))
                text = item.content[0].text
                # what was not streamed: a cut call's text, or an empty message's announcement
                await self._text(key, kind, text[self.streamed.get(item.id, 0):], index)
                await self.event(f"response.{kind}.done", item_id=item.id, output_index=index,
                                 content_index=0, text=text, **_no_logprobs(kind))
                await self.event("response.content_part.done", item_id=item.id, output_index=index,
                                 content_index=0, part=data["content"][0])
            await self.event("response.output_item.done", output_index=index, item=data)
        # response.completed even when cut off (its status says so): the SDKs wait for it
        await self.event("response.completed", response=msgspec.to_builtins(response))


def _no_logprobs(kind: str) -> dict[str, list]:
    """The output text events' `logprobs` (a required field of OpenAI's; empty: the
    `message.output_text.logprobs` include is refused)."""
    return {"logprobs": []} if kind == "output_text" else {}


# -- the endpoint ------------------------------------------------------------------------------


class ResponsesEndpoint:
    """POST /v1/responses over the engine, with its store of conversations."""

    def __init__(self, engine: ReplicaSet, served_name: str, defaults: GenerateDefaults,
                 parsers: protocol.ModelParsers, store_size: int):
        self.engine, self.served_name = engine, served_name
        self.defaults, self.parsers = defaults, parsers
        self.store = ResponseStore(store_size)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = protocol.decode_body(await request.read(), ResponsesBody)
            protocol.refuse_unimplemented(body, UNIMPLEMENTED)
            history = self.store.history(body.previous_response_id)
            parsed = protocol.with_request_id(protocol.parse_chat(chat_body(body, history), self.defaults,
                                                                  self.parsers), request.get(REQUEST_ID))
        except InvalidRequest as exc:
            return json_response(error_body(exc.message, exc.param), 400)
        builder = ResponseBuilder(body, body.model or self.served_name)
        choices = ChoiceStreams(self.engine, [parsed.request])
        try:
            await choices.start()
            if body.stream:
                return await self._stream(request, choices, builder, history)
            async for _, event in choices.events():
                builder.add(event)
        except InvalidRequest as exc:
            return json_response(error_body(exc.message, exc.param), 400)
        finally:
            await choices.close()
        return self._answer(builder, history)

    def _answer(self, builder: ResponseBuilder, history: list[dict[str, Any]]) -> web.Response:
        done = builder.done
        if done.error_type == INVALID_MODEL_OUTPUT:
            return json_response(error_body(done.error, kind=INVALID_MODEL_OUTPUT), 400)
        if done.finish_reason == "error":
            kind, status = engine_error(done)
            return json_response(error_body(done.error or "engine error", kind=kind, code=status), status)
        self._keep(builder, history)
        return json_response(builder.response())

    def _keep(self, builder: ResponseBuilder, history: list[dict[str, Any]]) -> None:
        if builder.body.store:
            self.store.put(builder.id, builder.conversation(history))

    async def _stream(self, request: web.Request, choices: ChoiceStreams, builder: ResponseBuilder,
                      history: list[dict[str, Any]]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(kind: str, payload: dict[str, Any]) -> None:
            await response.write(f"event: {kind}\ndata: ".encode() + msgspec.json.encode(payload) + b"\n\n")

        try:
            await self._stream_events(send, choices, builder, history)
        except ConnectionResetError:  # the client went away: the choice is aborted on close
            return response
        await response.write_eof()
        return response

    async def _stream_events(self, send, choices: ChoiceStreams, builder: ResponseBuilder,
                             history: list[dict[str, Any]]) -> None:
        events = EventWriter(send, builder)
        await events.start()
        async for _, event in choices.events():
            builder.add(event)
            if isinstance(event, TextDelta):
                await events.delta(event)
        done = builder.done
        if done.finish_reason == "error" or done.error_type == INVALID_MODEL_OUTPUT:
            kind = INVALID_MODEL_OUTPUT if done.error_type == INVALID_MODEL_OUTPUT else engine_error(done)[0]
            await send("error", {"type": "error", "sequence_number": events.sequence,
                                 "message": done.error or "engine error", "code": kind})
        else:
            await events.finish()
            self._keep(builder, history)
