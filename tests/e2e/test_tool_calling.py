"""Tool calling and constrained generation with the packaged Qwen2.5-Coder-0.5B-Instruct.

The model is small: with `auto` it writes its call as bare (often fenced) JSON, which the
Hermes parser accepts; `tool_choice` named/required and `response_format` are enforced by the
grammar mask in the device worker's sampler, so they hold with any sampling settings.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.api import openai_client, sse
from tests.e2e.server import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130}}}
# Sampling that, unconstrained, wanders off any format (free-length strings would ramble on
# until max_tokens at this temperature: the schemas above bound them).
WILD = {"temperature": 1.8, "top_p": 1.0, "max_tokens": 64}


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess(["--model", "qwen2.5-coder-0.5b", "--max-model-len", "1024",
                        "--kv-cache-memory", "256MiB"], startup_timeout=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_weather_call_without_streaming(client: openai.OpenAI):
    choice = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], temperature=0,
                                            max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_weather_call_streamed(client: openai.OpenAI, http: httpx.Client):
    stream = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], temperature=0,
                                            max_tokens=60, stream=True)
    name, arguments, ids, reasons = "", "", set(), []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for piece in choice.delta.tool_calls or []:
                assert piece.index == 0
                ids |= {piece.id} - {None}
                name += piece.function.name or ""
                arguments += piece.function.arguments or ""
    assert name == "get_weather" and len(ids) == 1
    assert json.loads(arguments) == {"city": "Paris"} and reasons[-1] == "tool_calls"


def test_tool_result_leads_to_a_text_answer(client: openai.OpenAI):
    first = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], temperature=0,
                                           max_tokens=60).choices[0].message
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                "content": json.dumps({"temperature_c": 21, "sky": "sunny"})},
               {"role": "user", "content": "So what is the weather like? Reply in one sentence."}]
    answer = client.chat.completions.create(model="m", messages=history, tools=[WEATHER],
                                            temperature=0, max_tokens=60).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "sunny" in answer.message.content.lower() and "21" in answer.message.content


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_named_tool_choice_forces_a_valid_call(client: openai.OpenAI, seed: int):
    ask = [{"role": "user", "content": "Tell me a joke about cats."}]  # nothing to do with tools
    choice = client.chat.completions.create(
        model="m", messages=ask, tools=[WEATHER, TIME], seed=seed, **WILD,
        tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_time" and isinstance(arguments["zone"], str)
    assert len(arguments["zone"]) <= 24 and choice.finish_reason == "tool_calls"


def test_required_tool_choice_calls_a_declared_tool(client: openai.OpenAI):
    choice = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice="required", temperature=0,
                                            max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name in ("get_weather", "get_time")


@pytest.mark.parametrize("sampling", [{"seed": 1, **WILD}, {"seed": 2, **WILD},
                                      {"seed": 3, "temperature": 1.0, "top_k": 5, "presence_penalty": 1.5}])
def test_json_schema_output_validates(http: httpx.Client, sampling: dict):
    body = {"messages": [{"role": "user", "content": "Describe a person called Ann, aged 31."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
            "max_tokens": 64, **sampling}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    person = json.loads(choice["message"]["content"])
    assert set(person) == {"name", "age"} and isinstance(person["name"], str)
    assert len(person["name"]) <= 16 and type(person["age"]) is int and 0 <= person["age"] <= 130


def test_json_object_streamed_on_completions(http: httpx.Client):
    body = {"prompt": "Here is a JSON object describing Paris:", "response_format": {"type": "json_object"},
            "max_tokens": 200, "stream": True, "seed": 5, "temperature": 1.0}
    events, last = sse(http.post("/v1/completions", json=body).text)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert isinstance(json.loads(text), dict) and last == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_bad_schema_is_a_400(http: httpx.Client):
    body = {"messages": ASK, "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": {"type": 5}}}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["param"] == "response_format", r.text
