"""What clients get when the model thinks or calls tools, end to end over HTTP.

The model is scripted (tests/replies/scripted.py) because a tiny random checkpoint cannot
think or call tools on purpose; the tokens are the real Qwen2.5-Coder tokenizer's.
"""

from __future__ import annotations

import json

import pytest

from pypto_serving.app.packaged_models import qwen_coder_path
from tests.replies.scripted import ScriptedServer

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
THOUGHT = "<think>\nThe user wants the weather.\nI should answer.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TAGS = ("<think", "</think", "think>", "<tool_call", "</tool_call")


@pytest.fixture
def qwen() -> ScriptedServer:
    return ScriptedServer(str(qwen_coder_path()), "--reasoning-parser", "qwen3")


async def post(client, **body: object) -> dict:
    r = await client.post("/v1/chat/completions", json={"messages": USER, **body})
    assert r.status == 200, await r.text()
    return await r.json()


async def stream(client, **body: object) -> tuple[list[dict], str]:
    r = await client.post("/v1/chat/completions", json={"messages": USER, "stream": True, **body})
    assert r.status == 200
    raw = (await r.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.strip().split("\n\n")]
    return [json.loads(e) for e in events[:-1]], events[-1]


def deltas(events: list[dict], field: str) -> list:
    return [e["choices"][0]["delta"][field] for e in events
            if e.get("choices") and field in e["choices"][0]["delta"]]


async def test_reasoning_and_content_are_separate(qwen: ScriptedServer):
    qwen.say(THOUGHT + "It is sunny in Paris.")
    async with qwen as client:
        message = (await post(client))["choices"][0]["message"]
        assert message["reasoning"] == "The user wants the weather.\nI should answer."
        assert message["content"] == "It is sunny in Paris."
        events, last = await stream(client)
    reasoning, content = deltas(events, "reasoning"), deltas(events, "content")
    assert len(reasoning) > 1 and len(content) > 1  # streamed as it came, not at the end
    assert "".join(reasoning) == message["reasoning"] and "".join(content) == message["content"]
    assert not any(tag in piece for piece in reasoning + content for tag in TAGS)
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and last == "[DONE]"


async def test_include_reasoning_false_and_thinking_cut_by_length(qwen: ScriptedServer):
    qwen.say(THOUGHT + "It is sunny in Paris.")
    async with qwen as client:
        message = (await post(client, include_reasoning=False))["choices"][0]["message"]
        assert "reasoning" not in message and message["content"] == "It is sunny in Paris."
        cut = (await post(client, max_tokens=6))["choices"][0]
    assert cut["finish_reason"] == "length"
    assert cut["message"]["content"] == "" and "The user wants" in cut["message"]["reasoning"]


async def test_a_tool_call_without_streaming(qwen: ScriptedServer):
    qwen.say("Let me check.\n" + CALL)
    async with qwen as client:
        choice = (await post(client, tools=[WEATHER]))["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "C"}


async def test_streamed_parallel_calls_assemble_exactly(qwen: ScriptedServer):
    qwen.say(THOUGHT + CALL + "\n" + CALL.replace("Paris", "Rome"))
    async with qwen as client:
        whole = (await post(client, tools=[WEATHER]))["choices"][0]["message"]
        events, _ = await stream(client, tools=[WEATHER])
        (single,) = (await post(client, tools=[WEATHER], parallel_tool_calls=False))["choices"][0][
            "message"]["tool_calls"]
    chunks = deltas(events, "tool_calls")
    assert all(len({c["index"] for c in chunk}) == len(chunk) for chunk in chunks)  # one entry per call
    pieces = [c for chunk in chunks for c in chunk]
    firsts = [p for p in pieces if "id" in p]
    assert [p["index"] for p in firsts] == [0, 1]
    assert all(p["type"] == "function" and p["function"]["name"] == "get_weather" for p in firsts)
    for i, call in enumerate(whole["tool_calls"]):
        fragments = "".join(p["function"].get("arguments", "") for p in pieces if p["index"] == i)
        assert fragments == call["function"]["arguments"]
    assert len({p["id"] for p in firsts}) == 2
    assert len([p for p in pieces if p["index"] == 0]) > 2  # arguments arrive in fragments
    assert json.loads(single["function"]["arguments"])["city"] == "Paris"
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(deltas(events, "reasoning")) == whole["reasoning"]


async def test_a_call_cut_by_length_is_not_a_call(qwen: ScriptedServer):
    qwen.say(CALL + "\n" + CALL.replace("Paris", "Rome"))
    async with qwen as client:
        cut = (await post(client, tools=[WEATHER], max_tokens=12))["choices"][0]
        second_cut = (await post(client, tools=[WEATHER], max_tokens=40))["choices"][0]
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
    # the complete first call is reported; the reply still ended by length
    assert second_cut["finish_reason"] == "length"
    (call,) = second_cut["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] == "Paris"


async def test_a_call_cut_by_length_comes_back_as_content(qwen: ScriptedServer):
    """Not streamed, the text of a call max_tokens cut off is the reply's content (a client
    sees what the tokens it paid for said); after a complete call too."""
    qwen.say(CALL + "\n" + CALL.replace("Paris", "Rome"))
    tokens = qwen.tokenizer.encode(CALL, add_special_tokens=False)
    async with qwen as client:
        cut = (await post(client, tools=[WEATHER], max_tokens=12))["choices"][0]
        second_cut = (await post(client, tools=[WEATHER], max_tokens=len(tokens) + 8))["choices"][0]
    assert cut["message"]["content"] == qwen.tokenizer.decode(tokens[:12])
    assert cut["message"]["content"].startswith('<tool_call>\n{"name": "get_weather", "arguments"')
    assert len(second_cut["message"]["tool_calls"]) == 1 and second_cut["finish_reason"] == "length"
    rest = second_cut["message"]["content"]  # the second call, as far as it came
    assert CALL.startswith(rest) and len(rest) > len("<tool_call>\n{")


async def test_tool_choice_none_leaves_the_text_alone(qwen: ScriptedServer):
    qwen.say(CALL)
    async with qwen as client:
        choice = (await post(client, tools=[WEATHER], tool_choice="none"))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == CALL


async def test_tool_choice_none_still_shows_the_tools_unless_the_server_excludes_them():
    """As on vLLM: the prompt renders the tools (a turn that may call them shares its prefix);
    --exclude-tools-when-tool-choice-none leaves them out."""
    prompts = {}
    for flags in ((), ("--exclude-tools-when-tool-choice-none",)):
        server = ScriptedServer(str(qwen_coder_path()), *flags)
        server.say("Sunny.")
        async with server as client:
            prompts[flags] = [(await post(client, **body))["usage"]["prompt_tokens"] for body in (
                {}, {"tools": [WEATHER], "tool_choice": "none"}, {"tools": [WEATHER]})]
    bare, none, auto = prompts[()]
    assert none == auto > bare + 20  # the tools' declaration is in the prompt
    assert prompts[("--exclude-tools-when-tool-choice-none",)] == [bare, bare, auto]


async def test_malformed_call_is_an_error_event_after_the_headers(qwen: ScriptedServer):
    qwen.say('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>')
    async with qwen as client:
        events, last = await stream(client, tools=[WEATHER])
        r = await client.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})
        body = await r.json()
        assert (await post(client))["choices"][0]["finish_reason"] == "stop"  # still serving
    assert events[-1]["error"]["type"] == "invalid_model_output" and events[-1]["error"]["code"] == 400
    assert last == "[DONE]"
    assert "".join(deltas(events, "content")) == "Checking."
    assert r.status == 400 and body["type"] == "invalid_model_output"


async def test_a_device_failure_inside_a_call_is_an_engine_error(qwen: ScriptedServer):
    qwen.say("Checking." + CALL)
    qwen.worker.fail_at = 12  # inside the call's JSON
    async with qwen as client:
        r = await client.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})
        body = await r.json()
    assert r.status == 200 and body["choices"][0]["finish_reason"] == "error"  # text came first
    assert body["choices"][0]["message"]["content"] == "Checking."
    assert "tool_calls" not in body["choices"][0]["message"]
