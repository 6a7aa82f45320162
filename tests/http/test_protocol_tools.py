"""Tool, tool_choice, response_format and history rules of chat requests."""

from __future__ import annotations

import json

import llguidance
import pytest

from pypto_serving.core.generate_config import GenerateDefaults
from pypto_serving.core.request import InvalidRequest
from pypto_serving.http import bodies, protocol
from pypto_serving.parsers import reasoning_parser_for, tool_parser_for

USER = [{"role": "user", "content": "Weather in Paris?"}]
QWEN = protocol.ModelParsers(reasoning_parser_for("qwen3"), tool_parser_for("qwen2"))


def tool(name: str = "get_weather", **function: object) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, **function}}


def chat(parsers: protocol.ModelParsers = QWEN, **fields: object) -> protocol.Parsed:
    raw = json.dumps({"messages": USER, **fields}).encode()
    return protocol.parse_chat(protocol.decode_body(raw, bodies.ChatBody), GenerateDefaults(), parsers)


def rejected(param: str, *words: str, **fields: object) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        chat(**fields)
    for word in words:
        assert word in info.value.message, info.value.message
    assert info.value.param == param
    return info.value


def _bytes_accept(grammar: str, text: str) -> bool:
    """Whether `grammar` accepts `text`, read byte by byte (no model vocabulary needed)."""
    tokenizer = llguidance.LLTokenizer("byte")
    m = llguidance.LLMatcher(tokenizer, grammar)
    ids = list(text.encode())
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_declared_tools_reach_the_template_and_the_parser():
    req = chat(tools=[tool(description="Current weather"), tool("get_time")]).request
    assert [t["function"]["name"] for t in req.prompt.tools] == ["get_weather", "get_time"]
    assert req.prompt.tools[0] == tool(description="Current weather")  # no nulls added
    assert req.reply.tool_names == {"get_weather", "get_time"}
    assert req.reply.tool_parser is not None and req.reply.parallel_tool_calls
    assert req.sampling.grammar is None  # auto: the model decides
    assert not chat(tools=[tool()], parallel_tool_calls=False).request.reply.parallel_tool_calls


@pytest.mark.parametrize("name", ["get weather", "x" * 65, "", "naïve", "a.b"])
def test_tool_names_must_match_the_pattern(name: str):
    rejected("tools", "tools", tools=[tool(name)])


def test_bad_tool_declarations_are_400s():
    rejected("tools", "more than once", tools=[tool(), tool()])
    rejected("tools", "function", tools=[{"type": "retrieval", "function": {"name": "f"}}])
    rejected("tool_choice", "not in 'tools'", tools=[tool()],
             tool_choice={"type": "function", "function": {"name": "get_time"}})
    rejected("tool_choice", "declares no tool", tool_choice="required")


def test_forced_tool_choice_becomes_a_grammar():
    named = chat(tools=[tool(), tool("get_time")],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}).request
    assert named.grammar_param == "tool_choice"
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert _bytes_accept(named.sampling.grammar, call)
    assert not _bytes_accept(named.sampling.grammar, call.replace("get_weather", "get_time"))
    assert not _bytes_accept(named.sampling.grammar, "Sunny in Paris")
    required = chat(tools=[tool(), tool("get_time")], tool_choice="required").request
    assert _bytes_accept(required.sampling.grammar, call.replace("get_weather", "get_time"))
    rejected("response_format", "tool_choice", tools=[tool()], tool_choice="required",
             response_format={"type": "json_object"})


def test_response_format_becomes_a_grammar():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = {"name": "n", "schema": schema}
    req = chat(response_format={"type": "json_schema", "json_schema": spec}).request
    assert req.grammar_param == "response_format"
    assert _bytes_accept(req.sampling.grammar, '{"n": 3}')
    assert not _bytes_accept(req.sampling.grammar, '{"n": "3"}')
    assert _bytes_accept(chat(response_format={"type": "json_object"}).request.sampling.grammar, '{"a": [1]}')
    assert chat(response_format={"type": "text"}).request.sampling.grammar is None
    rejected("response_format", "json_object", response_format={"type": "yaml"})
    rejected("response_format", "schema",
             response_format={"type": "json_schema", "json_schema": {"schema": 3}})


def test_history_tool_results_must_answer_earlier_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris"}'}}
    answered = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"}]
    messages = chat(messages=answered, tools=[tool()]).request.prompt.messages
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    rejected("messages", "call_2", messages=[*answered[:2], {**answered[2], "tool_call_id": "call_2"}])
    rejected("messages", "None", messages=[*answered[:2], {"role": "tool", "content": "Sunny"}])
    rejected("messages", "tool_call_id", messages=[*USER, answered[2]])  # before any call
    for arguments in ('{"city": ', '["Paris"]', "3"):
        bad = {**call, "function": {"name": "get_weather", "arguments": arguments}}
        rejected("messages", "JSON object", messages=[*USER, {"role": "assistant", "tool_calls": [bad]}])


def test_reasoning_settings_reach_the_reply_format():
    req = chat().request
    assert req.reply.reasoning is not None and req.reply.include_reasoning
    assert not chat(include_reasoning=False).request.reply.include_reasoning
    plain = chat(parsers=protocol.ModelParsers()).request.reply
    assert plain.reasoning is None and plain.tool_parser is None
