"""A tool's parameters schema with local references ($defs/$ref, as pydantic emits it) is
usable in every tool_choice mode: the forced-call grammar keeps the references resolvable."""

from __future__ import annotations

import json

import llguidance
import pydantic
import pytest

from pypto_serving.core.generate_config import GenerateDefaults
from pypto_serving.http import bodies, protocol
from pypto_serving.parsers import reasoning_parser_for, tool_parser_for

QWEN = protocol.ModelParsers(reasoning_parser_for("qwen3"), tool_parser_for("qwen2"))
BYTES = llguidance.LLTokenizer("byte")
HOME = '{"city": "Paris", "country": "FR"}'


class Location(pydantic.BaseModel):
    city: str
    country: str


class Trip(pydantic.BaseModel):
    home: Location
    stops: list[Location]


class Parcel(pydantic.BaseModel):  # its Location differs from Trip's: the names collide
    class Location(pydantic.BaseModel):
        zip: int

    to: Location


class Tree(pydantic.BaseModel):  # refers to itself through "#/$defs/Tree"
    value: int
    children: list[Tree] = []


def tool(name: str, model: type[pydantic.BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}


TOOLS = [tool("plan_trip", Trip), tool("send_parcel", Parcel), tool("grow", Tree)]


def chat(tool_choice: object) -> protocol.Parsed:
    raw = json.dumps({"messages": [{"role": "user", "content": "Go"}], "tools": TOOLS,
                      "tool_choice": tool_choice}).encode()
    return protocol.parse_chat(protocol.decode_body(raw, bodies.ChatBody), GenerateDefaults(), QWEN)


def accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar)
    assert not matcher.is_error(), matcher.get_error()
    ids = list(text.encode())
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def call(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "arguments": {arguments}}}'


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_the_schemas_have_references():
    assert "$defs" in Trip.model_json_schema() and "$defs" in Parcel.model_json_schema()


@pytest.mark.parametrize("choice", ["required", named("plan_trip")])
def test_forced_call_grammar_resolves_defs(choice: object):
    grammar = chat(choice).request.sampling.grammar
    assert llguidance.LLMatcher.validate_grammar(grammar, BYTES) == ""
    assert accepts(grammar, call("plan_trip", f'{{"home": {HOME}, "stops": [{HOME}]}}'))
    assert not accepts(grammar, call("plan_trip", '{"home": {"city": "Paris"}, "stops": []}'))


def test_colliding_defs_of_two_tools_stay_apart():
    grammar = chat("required").request.sampling.grammar
    assert accepts(grammar, call("send_parcel", '{"to": {"zip": 75001}}'))
    assert not accepts(grammar, call("send_parcel", f'{{"to": {HOME}}}'))
    assert not accepts(grammar, call("plan_trip", '{"home": {"zip": 75001}, "stops": []}'))


def test_recursive_reference_resolves_inside_the_arguments():
    grammar = chat(named("grow")).request.sampling.grammar
    assert accepts(grammar, call("grow", '{"value": 1, "children": [{"value": 2, "children": []}]}'))
    assert not accepts(grammar, call("grow", '{"value": 1, "children": [{"value": "x"}]}'))


def test_auto_sends_the_schemas_unchanged_and_forces_nothing():
    request = chat("auto").request
    assert request.sampling.grammar is None
    assert [t["function"]["parameters"] for t in request.prompt.tools] == [
        t["function"]["parameters"] for t in TOOLS]
