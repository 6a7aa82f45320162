"""Request bodies to `GenerateRequest`: server defaults, precedence, validation messages."""

from __future__ import annotations

import json

import pytest

from pypto_serving.core.generate_config import GenerateDefaults
from pypto_serving.core.request import InvalidRequest
from pypto_serving.http import bodies, protocol

SERVER = GenerateDefaults(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3,
                          stop=["END"], stream=True, ignore_eos=True)
USER = [{"role": "user", "content": "hi"}]


def completion(defaults: GenerateDefaults = SERVER, **fields: object) -> protocol.Parsed:
    body = protocol.decode_body(json.dumps({"prompt": "x", **fields}).encode(), bodies.CompletionBody)
    return protocol.parse_completion(body, defaults)


def chat(defaults: GenerateDefaults = SERVER, **fields: object) -> protocol.Parsed:
    body = protocol.decode_body(json.dumps({"messages": USER, **fields}).encode(), bodies.ChatBody)
    return protocol.parse_chat(body, defaults)


def rejected(parse: object, *words: str, **fields: object) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(**fields)  # type: ignore[operator]
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value


def test_omitted_fields_inherit_the_server_defaults():
    parsed = completion()
    req = parsed.request
    assert (req.max_tokens, req.stop, parsed.stream, parsed.n) == (7, ("END",), True, 1)
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.5, 0.9, 5, 3)
    assert chat().request.ignore_eos is True


def test_present_fields_win_even_when_null_or_empty():
    parsed = completion(temperature=None, top_p=None, top_k=None, seed=None, stop=[], stream=None)
    s = parsed.request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (1.0, 1.0, 0, None)
    assert parsed.request.stop == () and parsed.stream is False
    assert completion(stop=None).request.stop == ()
    assert completion(stop="x").request.stop == ("x",)
    assert chat(ignore_eos=False).request.ignore_eos is False


def test_null_max_tokens_means_the_server_default():
    assert completion(max_tokens=None).request.max_tokens == 7
    assert completion(max_tokens=3).request.max_tokens == 3


def test_max_completion_tokens_takes_precedence_for_chat():
    assert chat(max_tokens=9, max_completion_tokens=4).request.max_tokens == 4
    assert chat(max_tokens=9, max_completion_tokens=None).request.max_tokens == 9
    rejected(chat, "max_completion_tokens", ">= 1", max_completion_tokens=0)
    rejected(chat, "max_tokens", ">= 1", max_tokens=-1)


def test_completions_always_ignore_eos():
    assert completion(defaults=GenerateDefaults()).request.ignore_eos is True
    assert chat(defaults=GenerateDefaults()).request.ignore_eos is False


def test_min_tokens_must_fit_the_selected_maximum():
    assert chat(min_tokens=7).request.sampling.min_tokens == 7
    err = rejected(chat, "min_tokens", "7", min_tokens=8)
    assert err.param == "min_tokens"
    rejected(chat, "min_tokens", max_tokens=20, max_completion_tokens=5, min_tokens=6)
    rejected(chat, "min_tokens", ">= 0", min_tokens=-1)


def test_top_k_0_and_minus_1_mean_no_cut_as_in_vllm():
    for value in (0, -1):
        assert completion(top_k=value).request.sampling.top_k == 0


@pytest.mark.parametrize("field, value, words", [
    ("temperature", -0.1, [">= 0.0"]),
    ("top_p", 0, ["> 0.0"]),
    ("top_p", 1.5, ["<= 1.0"]),
    ("top_k", -2, [">= -1"]),
    ("min_p", 2, ["<= 1.0"]),
    ("presence_penalty", 3, ["<= 2.0"]),
    ("frequency_penalty", -3, [">= -2.0"]),
    ("repetition_penalty", 0, ["> 0.0"]),
    ("seed", 2**64, ["<="]),
    ("n", 0, [">= 1"]),
    ("n", 17, ["<= 16"]),
    ("logprobs", 21, ["<= 20"]),
    ("stop", ["a"] * 33, ["length <= 32"]),
    ("stop", [""], ["length >= 1"]),
    ("stop_token_ids", [-1], [">= 0"]),
    ("max_tokens", "ten", ["int"]),
])
def test_bad_values_name_the_field_and_the_range(field: str, value: object, words: list[str]):
    err = rejected(completion, field, *words, **{field: value})
    assert err.param == field


def test_enum_errors_list_the_allowed_values():
    rejected(chat, "reasoning_effort", "none, minimal, low, medium, high, xhigh, max",
             reasoning_effort="huge")
    body = json.dumps({"messages": [{"role": "bot", "content": "x"}]}).encode()
    with pytest.raises(InvalidRequest, match="system, developer, user, assistant, tool"):
        protocol.decode_body(body, bodies.ChatBody)


def test_sampling_fields_reach_sampling_params():
    s = completion(min_p=0.2, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3,
                   min_tokens=2, logprobs=3, top_k=2**40).request.sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.2, 0.5, -0.5, 1.3)
    assert (s.min_tokens, s.logprobs, s.top_k) == (2, 3, protocol.TOP_K_CAP)
    assert completion(temperature=1e-9).request.sampling.greedy
    assert completion(stop_token_ids=[5, 6]).request.stop_token_ids == (5, 6)


def test_chat_logprobs_and_top_logprobs():
    assert chat().request.sampling.logprobs is None
    assert chat(logprobs=True).request.sampling.logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).request.sampling.logprobs == 4
    rejected(chat, "top_logprobs", "logprobs", top_logprobs=2)
    rejected(chat, "top_logprobs", "<= 20", logprobs=True, top_logprobs=21)


def test_n_best_of_and_stream_options():
    assert completion(n=3, best_of=3).n == 3
    rejected(completion, "best_of", n=2, best_of=4)
    rejected(completion, "stream_options", "stream", stream=False, stream_options={"include_usage": True})
    parsed = completion(stream=True, stream_options={"include_usage": False})
    assert parsed.stream and not parsed.final_usage and not parsed.running_usage
    assert completion(stream=True).final_usage  # the usage event is the default
    assert completion(stream=True, stream_options={"include_usage": None}).final_usage
    running = chat(stream=True, stream_options={"continuous_usage_stats": True})
    assert running.final_usage and running.running_usage


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"5": 1}), ("use_beam_search", True), ("guided_json", {}),
    ("skip_special_tokens", False), ("suffix", "x"),
])
def test_known_unimplemented_fields_are_refused_unless_default(field: str, value: object):
    err = rejected(completion, field, "not supported", **{field: value})
    assert err.param == field


def test_echo_is_a_completions_field_only():
    assert rejected(chat, "echo", "not supported", echo=True).param == "echo"
    assert completion(echo=True).request.echo


def test_prompt_scoring_options():
    scored = completion(echo=True, max_tokens=0, logprobs=2)
    assert scored.echo_only and scored.request.max_tokens == 1  # one token sampled, then dropped
    assert scored.request.sampling.prompt_logprobs == 2  # echo's logprobs cover the prompt
    asked = completion(echo=True, logprobs=1, prompt_logprobs=4, stream=False)
    assert asked.request.sampling.prompt_logprobs == 4 and asked.prompt_logprobs == 4
    assert completion(logprobs=1).request.sampling.prompt_logprobs is None  # no echo: outputs only
    assert chat(prompt_logprobs=0, stream=False).prompt_logprobs == 0
    rejected(completion, "max_tokens", "echo", max_tokens=0)
    rejected(completion, "prompt_logprobs", "stream", stream=True, prompt_logprobs=1)
    rejected(chat, "prompt_logprobs", "stream", stream=True, prompt_logprobs=1)
    rejected(completion, "prompt_logprobs", prompt_logprobs=21)


def test_unimplemented_fields_at_their_defaults_and_unknown_fields_pass():
    completion(echo=False, logit_bias={}, response_format={"type": "text"}, best_of=1,
               skip_special_tokens=True, some_future_field=[1, 2])
    chat(modalities=["text"], parallel_tool_calls=True, tool_choice="none", user="u", include_reasoning=False)


def test_openai_fields_that_ask_for_what_this_server_lacks_are_400s():
    chat(store=False, service_tier="auto", verbosity="medium")
    chat(service_tier="default")
    for field, value in (("store", True), ("service_tier", "priority"), ("verbosity", "high")):
        assert rejected(chat, field, "not supported", **{field: value}).param == field


def test_tools_need_a_parser():
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    rejected(chat, "tool-call parser", tools=[tool])
    rejected(chat, "tool_choice", tool_choice="required")
    chat(tools=[], tool_choice="auto")
    plain = chat(tools=[tool], tool_choice="none").request  # nothing to parse: allowed
    assert [t["function"]["name"] for t in plain.prompt.tools] == ["f"]  # seen, as on vLLM
    assert plain.reply.tool_parser is None  # and never parsed for calls
    fields = {"messages": USER, "tools": [tool], "tool_choice": "none"}
    body = protocol.decode_body(json.dumps(fields).encode(), bodies.ChatBody)
    excluded = protocol.parse_chat(body, SERVER, protocol.ModelParsers(exclude_tools_when_none=True))
    assert excluded.request.prompt.tools is None and excluded.request.reply.tool_parser is None


def test_reasoning_effort_and_template_kwargs_reach_the_template():
    kwargs = chat(reasoning_effort="none").request.prompt.template_kwargs
    assert kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    override = chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert override.request.prompt.template_kwargs["enable_thinking"] is True
    assert chat(reasoning_effort="high").request.prompt.template_kwargs == {"reasoning_effort": "high"}
    assert chat(chat_template_kwargs={"x": 1}).request.prompt.template_kwargs == {"x": 1}
    rejected(chat, "chat_template_kwargs", "messages", chat_template_kwargs={"messages": []})


def test_messages_keep_their_fields():
    history = [
        {"role": "user", "content": None},
        {"role": "assistant", "content": None, "reasoning": "think",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    messages = chat(messages=history).request.prompt.messages
    assert messages[0] == {"role": "user", "content": ""}
    # templates write the arguments with tojson: they get the object, not its text
    assert messages[1]["tool_calls"][0] == {"id": "c1", "type": "function",
                                            "function": {"name": "f", "arguments": {}}}
    assert messages[1]["reasoning"] == "think" and messages[1]["content"] is None
    assert messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


def test_multimodal_parts_are_refused():
    parts = [{"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": "data:"}}]
    error = rejected(chat, "multimodal", "'image_url'", "content[1]",
                     messages=[{"role": "user", "content": parts}])
    assert error.param == "messages"
    rejected(chat, "without a 'text'", messages=[{"role": "user", "content": [{"type": "text"}]}])


def test_text_parts_are_joined_as_vllm_joins_them():
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    messages = chat(messages=[{"role": "user", "content": parts}]).request.prompt.messages
    assert messages == ({"role": "user", "content": "Hello\nworld"},)


def test_prompt_batches_are_refused():
    rejected(completion, "batches", prompt=["a", "b"])
    assert completion(prompt=[1, 2]).request.prompt == (1, 2)


def test_a_missing_required_field_is_named():
    with pytest.raises(InvalidRequest, match="messages") as info:
        protocol.decode_body(b"{}", bodies.ChatBody)
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequest) as info:
        protocol.decode_body(b'{"messages": [{"content": "x"}]}', bodies.ChatBody)
    assert info.value.param == "messages" and "role" in info.value.message


def test_not_json_and_not_an_object():
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        protocol.decode_body(b"{", bodies.CompletionBody)
    with pytest.raises(InvalidRequest, match="object"):
        protocol.decode_body(b"[1]", bodies.CompletionBody)
