"""/v1/responses with a model that thinks and calls tools (scripted, as in
test_scripted_replies.py): reasoning, message and function_call items, whole and streamed,
and a conversation continued with previous_response_id and a function_call_output."""

from __future__ import annotations

import json

import pytest

from pypto_serving.app.packaged_models import qwen_coder_path
from tests.replies.scripted import ScriptedServer
from tests.replies.test_scripted_replies import CALL, THOUGHT

TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def qwen() -> ScriptedServer:
    return ScriptedServer(str(qwen_coder_path()), "--reasoning-parser", "qwen3")


async def respond(client, **body: object) -> dict:
    r = await client.post("/v1/responses", json=body)
    assert r.status == 200, await r.text()
    return await r.json()


async def events(client, **body: object) -> list[dict]:
    r = await client.post("/v1/responses", json={**body, "stream": True})
    assert r.status == 200
    lines = (await r.text()).splitlines()
    kinds = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert kinds == [d["type"] for d in data]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    return data


async def test_a_call_is_a_function_call_item_after_the_reasoning(qwen: ScriptedServer):
    qwen.say(THOUGHT + CALL)
    async with qwen as client:
        body = await respond(client, input="What is the weather in Paris?", tools=[TOOL])
    reasoning, call = body["output"]
    assert reasoning["type"] == "reasoning" and "weather" in reasoning["content"][0]["text"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris", "unit": "C"}
    assert call["call_id"].startswith("call_") and body["status"] == "completed"


async def test_the_stream_carries_the_same_items(qwen: ScriptedServer):
    qwen.say(THOUGHT + "It is sunny.")
    async with qwen as client:
        data = await events(client, input="Weather?")
    kinds = [d["type"] for d in data]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    final = data[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    text = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    thought = "".join(d["delta"] for d in data if d["type"] == "response.reasoning_text.delta")
    assert text == final["output"][1]["content"][0]["text"] == "It is sunny."
    texts = [d for d in data if d["type"] in ("response.output_text.delta", "response.output_text.done")]
    assert texts and all(d["logprobs"] == [] for d in texts)  # required by OpenAI's event types
    assert thought == final["output"][0]["content"][0]["text"]
    for d in data:  # every item event names the index the item has in the final output
        if "item_id" in d:
            assert final["output"][d["output_index"]]["id"] == d["item_id"]


async def test_a_function_output_continues_the_stored_conversation(qwen: ScriptedServer):
    qwen.say(CALL)
    async with qwen as client:
        first = await respond(client, input="What is the weather in Paris?", tools=[TOOL])
        call = first["output"][0]
        qwen.say("It is 21 degrees in Paris.")
        second = await respond(client, previous_response_id=first["id"], tools=[TOOL], input=[
            {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"}])
        missing = await client.post("/v1/responses", json={"input": "Hi", "previous_response_id": "resp_x"})
        missing_body = await missing.json()
    assert second["output"][0]["content"][0]["text"] == "It is 21 degrees in Paris."
    # the second prompt holds the first exchange: question, call and its output
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert missing.status == 400 and missing_body["param"] == "previous_response_id"


async def test_usage_counts_the_prompt_tokens_read_from_and_written_to_the_prefix_cache(qwen: ScriptedServer):
    question = "Which tool tells the weather? Answer in one word, after thinking it over. " * 3
    async with qwen as client:
        qwen.say("A tool.")
        first = (await respond(client, input=question))["usage"]["input_tokens_details"]
        qwen.say("A tool.")
        again = (await respond(client, input=question))["usage"]["input_tokens_details"]
    # the first request computed the prompt and left its full blocks for the next one
    assert first["cached_tokens"] == 0 and first["cache_write_tokens"] >= again["cached_tokens"] > 0
    assert again["cache_write_tokens"] == 0


async def test_fields_that_ask_for_what_is_not_implemented_are_400s(qwen: ScriptedServer):
    qwen.say("Hello.")
    schema = {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}}
    async with qwen as client:
        await respond(client, input="Hi", text={"format": {"type": "text"}}, background=False,
                      service_tier="auto", include=[], truncation="disabled")
        for field, value in (("text", schema), ("background", True), ("service_tier", "flex"),
                             ("include", ["message.output_text.logprobs"]), ("top_logprobs", 3),
                             ("truncation", "auto"), ("reasoning", {"effort": "high"}),
                             ("max_tool_calls", 1)):
            r = await client.post("/v1/responses", json={"input": "Hi", field: value})
            body = await r.json()
            assert r.status == 400 and body["param"] == field and "not supported" in body["message"], field


async def test_an_unanswerable_call_output_is_named_in_the_inputs_terms(qwen: ScriptedServer):
    qwen.say("Hello.")
    stray = [{"role": "user", "content": "Hi"},
             {"type": "function_call_output", "call_id": "zzz", "output": "x"}]
    async with qwen as client:
        r = await client.post("/v1/responses", json={"input": stray})
        body = await r.json()
    assert r.status == 400 and body["param"] == "input"
    assert "input[1]" in body["message"] and "call_id 'zzz'" in body["message"]


async def test_a_streamed_call_sends_its_arguments_as_they_come(qwen: ScriptedServer):
    qwen.say(THOUGHT + CALL)
    async with qwen as client:
        data = await events(client, input="What is the weather in Paris?", tools=[TOOL])
        whole = await respond(client, input="What is the weather in Paris?", tools=[TOOL])
    final = data[-1]["response"]
    assert [i["type"] for i in final["output"]] == [i["type"] for i in whole["output"]] == [
        "reasoning", "function_call"]
    call = final["output"][1]
    added = [d for d in data if d["type"] == "response.output_item.added"]
    assert added[1]["output_index"] == 1
    assert added[1]["item"] == {**call, "arguments": "", "status": "in_progress"}
    deltas = [d for d in data if d["type"] == "response.function_call_arguments.delta"]
    kinds = [d["type"] for d in data]  # fragments as the model writes them, then the whole
    assert len(deltas) > 1 and data.index(deltas[-1]) < kinds.index("response.function_call_arguments.done")
    assert "".join(d["delta"] for d in deltas) == call["arguments"]
    assert json.loads(call["arguments"]) == {"city": "Paris", "unit": "C"} and call["status"] == "completed"
    done = [d for d in data if d["type"] == "response.output_item.done"]
    assert [d["item"] for d in done] == final["output"]
    for d in data:
        if "item_id" in d:
            assert final["output"][d["output_index"]]["id"] == d["item_id"]


async def test_a_call_cut_by_max_output_tokens_stays_an_incomplete_item(qwen: ScriptedServer):
    """Cut after its name came (streamed as an item): an `incomplete` function_call, whole and
    streamed alike; cut before it, its text ends the message, as a chat reply gives it."""
    qwen.say(CALL)
    tokens = qwen.tokenizer.encode(CALL, add_special_tokens=False)
    body = {"input": "What is the weather in Paris?", "tools": [TOOL]}
    async with qwen as client:
        whole = await respond(client, **body, max_output_tokens=len(tokens) - 6)
        data = await events(client, **body, max_output_tokens=len(tokens) - 6)
        early = await respond(client, **body, max_output_tokens=3)
        early_events = await events(client, **body, max_output_tokens=3)
    final = data[-1]["response"]
    for response in (whole, final):
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        [call] = response["output"]
        assert call["type"] == "function_call" and call["status"] == "incomplete"
        assert call["name"] == "get_weather" and '{"city": "Paris"'.startswith(call["arguments"][:10])
    assert whole["output"][0]["arguments"] == final["output"][0]["arguments"]
    assert "".join(d["delta"] for d in data if d["type"] == "response.function_call_arguments.delta") \
        == final["output"][0]["arguments"]
    cut_text = qwen.tokenizer.decode(tokens[:3])
    for response in (early, early_events[-1]["response"]):
        [message] = response["output"]
        assert message["type"] == "message" and message["status"] == "incomplete"
        assert message["content"][0]["text"] == cut_text
    streamed = "".join(d["delta"] for d in early_events if d["type"] == "response.output_text.delta")
    assert streamed == cut_text


async def test_a_strict_tools_call_comes_whole_and_only_when_complete(qwen: ScriptedServer):
    """Clients parse a strict tool's arguments as JSON (the OpenAI SDK's `parse` does): its call
    is held until complete, then sent whole; cut off, its text ends the message instead."""
    strict = {**TOOL, "strict": True}
    qwen.say("Let me check." + CALL)
    tokens = qwen.tokenizer.encode("Let me check." + CALL, add_special_tokens=False)
    body = {"input": "What is the weather in Paris?", "tools": [strict]}
    async with qwen as client:
        data = await events(client, **body)
        cut = await events(client, **body, max_output_tokens=len(tokens) - 6)
    final = data[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    call = final["output"][1]
    deltas = [d["delta"] for d in data if d["type"] == "response.function_call_arguments.delta"]
    assert deltas == [call["arguments"]] and json.loads(call["arguments"])["city"] == "Paris"
    announced = next(i for i, d in enumerate(data) if d["type"] == "response.output_item.added"
                     and d["item"]["type"] == "function_call")
    assert all(i < announced for i, d in enumerate(data) if d["type"] == "response.output_text.delta")
    cut_final = cut[-1]["response"]
    [message] = cut_final["output"]
    assert cut_final["status"] == "incomplete" and message["status"] == "incomplete"
    assert message["content"][0]["text"] == qwen.tokenizer.decode(tokens[:len(tokens) - 6])
    assert not [d for d in cut if "function_call" in d["type"]]
    streamed = "".join(d["delta"] for d in cut if d["type"] == "response.output_text.delta")
    assert streamed == message["content"][0]["text"]
