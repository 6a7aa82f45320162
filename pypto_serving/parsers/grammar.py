"""Grammars for constrained decoding, in llguidance's format.

`response_format` and a forced `tool_choice` become one llguidance grammar string per
request; the device worker's sampler masks every token the grammar cannot accept, so the
output parses (and validates against the schema) whatever the sampling settings.
Why llguidance: a small Rust wheel with no torch or CUDA build step, a token-mask API that
works on plain torch CPU tensors, and near-zero grammar compile time for JSON schemas.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pypto_serving.core.request import InvalidRequest


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """None for plain text; a JSON grammar for json_object / json_schema."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else False
        if schema is not None and not isinstance(schema, dict):
            raise InvalidRequest("'response_format.json_schema' must be an object with a "
                                 "'schema' object", "response_format")
        return _json_grammar(schema or {"type": "object"})
    raise InvalidRequest(f"'response_format.type' {kind!r} is not one of text, json_object, "
                         "json_schema", "response_format")


def tool_call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The bare-JSON call the Hermes parser accepts: {"name": ..., "arguments": {...}}.

    The parameters schema moves down to `properties.arguments`, where its local references
    ("#/$defs/Location", pydantic's habit, or "#") would resolve against the wrapper instead:
    a `$id` makes it a schema resource of its own, so they still resolve inside it, and two
    tools' same-named `$defs` stay apart (tool names are unique and URN-safe)."""
    function = tool["function"]
    # as OpenAI reads it, a function without `parameters` takes none: its arguments are {}
    params = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    params = {"$id": f"urn:pypto-serving:tool:{function['name']}", **params}  # its own $id wins
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_choice_grammar(tools: list[dict[str, Any]], forced: str | None) -> str:
    """`forced` names one tool, or None for "required" (any declared tool)."""
    chosen = [t for t in tools if forced is None or t["function"]["name"] == forced]
    schemas = [tool_call_schema(t) for t in chosen]
    return _json_grammar(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, "tool_choice")


def _json_grammar(schema: dict[str, Any], param: str = "response_format") -> str:
    """One-line JSON (`{"a": 1, "b": 2}`) unless the schema's x-guidance says otherwise: with
    free whitespace a small model can pad with spaces and newlines until max_tokens."""
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
               **schema.get("x-guidance", {})}
    import llguidance  # on first use: a server that never constrains output does without it

    try:
        return llguidance.grammar_from("json_schema", json.dumps({**schema, "x-guidance": options}))
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"the JSON schema cannot be used: {exc}", param) from None


class GrammarChecker:
    """Validates grammars against the model's vocabulary before a request is queued."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None):
        import llguidance

        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=eos_token_id)

    def check(self, grammar: str, param: str) -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise InvalidRequest(f"the '{param}' grammar is invalid: {error}", param)


class Grammars:
    """Grammar validation in the main process. The vocabulary index takes a second or two to
    build for a large vocabulary, so it is built once, off the event loop, on first use."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_id: int | None):
        self._json, self._vocab_size, self._eos = tokenizer_json, vocab_size, eos_token_id
        self._checker: asyncio.Future[GrammarChecker] | None = None

    async def check(self, grammar: str, param: str) -> None:
        if not self._json:
            raise InvalidRequest(f"'{param}' needs constrained decoding, which needs the model's "
                                 "tokenizer in the Hugging Face tokenizers format (tokenizer.json "
                                 "or GGUF); this model has only a SentencePiece model", param)
        if self._checker is None:
            self._checker = asyncio.ensure_future(asyncio.to_thread(
                GrammarChecker, self._json, self._vocab_size, self._eos))
        try:
            checker = await asyncio.shield(self._checker)
        except Exception as exc:
            self._checker = None  # the next request tries again
            raise InvalidRequest(f"'{param}' needs constrained decoding, but the model's "
                                 f"vocabulary could not be indexed for it: {exc}", param) from exc
        checker.check(grammar, param)
