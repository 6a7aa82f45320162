"""llguidance grammars built from request fields accept exactly the allowed outputs."""

from __future__ import annotations

import llguidance
import pytest

from pypto_serving.core.request import InvalidRequest
from pypto_serving.parsers.grammar import (
    GrammarChecker,
    response_format_grammar,
    tool_choice_grammar,
)
from pypto_serving.tokenizer.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: str) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


def accepts(tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    lltok = llguidance.LLTokenizer(tokenizer._backend._tok.to_str(), n_vocab=tokenizer.vocab_size)
    matcher = llguidance.LLMatcher(lltok, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_json_object_accepts_objects_only(tokenizer: Tokenizer):
    grammar = response_format_grammar({"type": "json_object"})
    assert accepts(tokenizer, grammar, '{"a": 1}')
    assert not accepts(tokenizer, grammar, "hello")
    assert response_format_grammar({"type": "text"}) is None


def test_json_schema_is_enforced(tokenizer: Tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"schema": schema}})
    assert accepts(tokenizer, grammar, '{"n": 3}')
    assert not accepts(tokenizer, grammar, '{"n": "three"}')


def test_forced_tool_call_shape(tokenizer: Tokenizer):
    grammar = tool_choice_grammar([WEATHER], "get_weather")
    assert accepts(tokenizer, grammar, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert not accepts(tokenizer, grammar, '{"name": "other", "arguments": {}}')


def test_a_function_without_parameters_takes_no_arguments(tokenizer: Tokenizer):
    ping = {"type": "function", "function": {"name": "ping", "description": "Ping the server"}}
    for grammar in (tool_choice_grammar([ping], "ping"), tool_choice_grammar([ping, WEATHER], None)):
        assert accepts(tokenizer, grammar, '{"name": "ping", "arguments": {}}')
        assert not accepts(tokenizer, grammar, '{"name": "ping", "arguments": {"city": "Paris"}}')


def test_bad_formats_are_400s(tokenizer: Tokenizer):
    with pytest.raises(InvalidRequest, match="response_format.type"):
        response_format_grammar({"type": "xml"})
    checker = GrammarChecker(tokenizer._backend._tok.to_str(), tokenizer.vocab_size,
                             tokenizer.eos_token_id)
    bad = response_format_grammar({"type": "json_schema", "json_schema": {"schema": {"type": 5}}})
    with pytest.raises(InvalidRequest, match="grammar is invalid"):
        checker.check(bad, "response_format")
