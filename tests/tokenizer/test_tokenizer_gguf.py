"""The packaged GGUF models' tokenizers and chat templates against transformers on the same file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pypto_serving.tokenizer.tokenizer import Tokenizer
from tests.oracles import transformers_tokenizer

SYSTEM = {"role": "system", "content": "You are terse. Réponds en français si besoin."}
CONVERSATIONS = {
    "user only": [{"role": "user", "content": "What is 2+2?"}],
    "with system": [SYSTEM, {"role": "user", "content": "Hi 🙂 你好"}],
    "multi turn": [
        SYSTEM,
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Autumn moonlight—\na worm digs silently\ninto the chestnut."},
        {"role": "user", "content": "Another, about   spaces\tand\nnewlines."},
    ],
    "special text in content": [{"role": "user", "content": "say <|im_end|> then <|im_start|>"}],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city (météo, 天气).",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich"})},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 18}'},
]
TEXTS = ["Hello world", "  indented\n\tcode()", "<|im_start|>user\nhi<|im_end|>", "naïve 🙂👍🏽 你好", ""]


@pytest.fixture(scope="module", params=["smollm2", "qwen"])
def pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, Any]:
    path: Path = request.getfixturevalue(f"{request.param}_path")
    oracle = transformers_tokenizer(path)
    return request.getfixturevalue(request.param), oracle


def assert_same_chat(ours: Tokenizer, theirs: Any, messages: list[dict], **kwargs: Any) -> None:
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    want = theirs.apply_chat_template(messages, return_dict=False, **kwargs)
    assert ours.encode(text, add_special_tokens=False) == want


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_matches_transformers(
    pair: tuple[Tokenizer, Any], name: str, add_generation_prompt: bool
) -> None:
    assert_same_chat(*pair, CONVERSATIONS[name], add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen_tool_calling_chat_matches_transformers(
    pair: tuple[Tokenizer, Any], add_generation_prompt: bool
) -> None:
    ours, theirs = pair
    if "tool_call" not in (ours.chat_template or ""):
        pytest.skip("this model's template has no tool calling")
    for messages in (CONVERSATIONS["with system"], TOOL_TURNS):
        assert_same_chat(
            ours, theirs, messages, tools=[WEATHER_TOOL], add_generation_prompt=add_generation_prompt
        )
    assert_same_chat(ours, theirs, TOOL_TURNS, add_generation_prompt=add_generation_prompt)
    assert "<tool_call>" in ours.apply_chat_template(TOOL_TURNS, tools=[WEATHER_TOOL])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair: tuple[Tokenizer, Any], text: str) -> None:
    ours, theirs = pair
    ids = theirs(text)["input_ids"]
    assert ours.encode(text) == ids == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)


def test_special_tokens_match_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, theirs = pair
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.vocab_size == len(theirs)
    assert ours.chat_template == theirs.chat_template


def test_chat_turn_end_tokens(smollm2: Tokenizer, qwen: Tokenizer) -> None:
    # Both models are ChatML: a turn ends at <|im_end|>; <|endoftext|> also ends generation.
    for tok in (smollm2, qwen):
        names = {tok.convert_ids_to_tokens([i])[0] for i in tok.eos_token_ids}
        assert names == {"<|im_end|>", "<|endoftext|>"}
        assert tok.eos_token == "<|im_end|>"


def test_enable_thinking_style_kwargs_reach_a_real_template(qwen: Tokenizer) -> None:
    # Qwen2.5's template ignores unknown kwargs: rendering must still succeed and be unchanged.
    messages = CONVERSATIONS["user only"]
    assert qwen.apply_chat_template(messages, enable_thinking=False) == qwen.apply_chat_template(messages)


# --- Gemma 3 270M: a base model, no template in its GGUF; Gemma's turn format given by hand ----

# Gemma's turn markup, written here (the shape of Gemma's own: "assistant" is "model", the roles
# must alternate, and a system message has no turn of its own but opens the first user turn).
GEMMA_TURNS = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] + '\\n\\n' %}"
    "{% set messages = messages[1:] %}{% endif %}"
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (ns.system if loop.first else '') + m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_gemma3_has_no_template_and_renders_gemma_turns_as_transformers(gemma3_gguf: str,
                                                                         hf_gemma3_tokenizer: Any) -> None:
    from pypto_serving.tokenizer.chat_template import ChatTemplateError

    ours = Tokenizer.from_gguf(Path(gemma3_gguf))
    theirs = hf_gemma3_tokenizer
    assert ours.chat_template is None and theirs.chat_template is None
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template(CONVERSATIONS["user only"])
    for name, messages in CONVERSATIONS.items():
        text = ours.apply_chat_template(messages, chat_template=GEMMA_TURNS)
        assert text == theirs.apply_chat_template(messages, chat_template=GEMMA_TURNS, tokenize=False,
                                                  add_generation_prompt=True), name
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "hi"}], chat_template=GEMMA_TURNS)
    assert ours.token_to_id("<end_of_turn>") in ours.eos_token_ids  # a chat reply ends at its turn's end


def test_a_tool_call_turn_with_null_content_renders_in_a_template_without_tools(smollm2: Tokenizer) -> None:
    """What the OpenAI SDK sends back after a tool call: the assistant turn with content null.
    SmolLM2's template concatenates every message's content; the turn renders with "" there."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    text = smollm2.apply_chat_template(history)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n42<|im_end|>" in text
