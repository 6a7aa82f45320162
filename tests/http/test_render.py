"""Response and chunk shapes (OpenAI's), logprobs in both endpoints' formats, usage over n."""

from __future__ import annotations

import msgspec

from pypto_serving.core.request import Candidate, Finished, TextDelta, TokenLogprob
from pypto_serving.http.render import Choice, Renderer, chat_logprobs, completion_logprobs, usage


def cand(text: str, logprob: float, token_id: int = 0) -> Candidate:
    return Candidate(token_id, text, text.encode(), logprob)


def entry(text: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(cand(text, logprob), tuple(cand(t, lp) for t, lp in top))


def as_json(body: object) -> dict:
    return msgspec.json.decode(msgspec.json.encode(body))


def choice(text: str, reason: str = "length", tokens: int = 2, logprobs: tuple = ()) -> Choice:
    c = Choice()
    c.add(TextDelta(text, tuple(range(tokens)), logprobs))
    c.done = Finished(reason, prompt_tokens=5, completion_tokens=tokens, cached_tokens=4)
    return c


def test_usage_counts_the_prompt_once_and_sums_choices():
    dones = [Finished("length", 5, 3, 2), Finished("eos", 5, 4, 2)]
    assert as_json(usage(dones)) == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                                     "prompt_tokens_details": {"cached_tokens": 2}}


def test_full_chat_response():
    body = as_json(Renderer("chatcmpl-1", "m", chat=True).full([choice("a"), choice("b", "eos")]))
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1" and body["model"] == "m"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][1] == {"index": 1, "message": {"role": "assistant", "content": "b"},
                                  "logprobs": None, "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == 4


def test_full_text_completion_response():
    body = as_json(Renderer("cmpl-1", "m", chat=False).full([choice("hello")]))
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}]


def test_chat_logprobs_shape():
    lp = as_json(chat_logprobs([entry(" a", -0.5, (" a", -0.5), ("b", -1.0))]))
    top = [{"token": " a", "logprob": -0.5, "bytes": [32, 97]},
           {"token": "b", "logprob": -1.0, "bytes": [98]}]
    assert lp == {"content": [{"token": " a", "logprob": -0.5, "bytes": [32, 97], "top_logprobs": top}]}


def test_completion_logprobs_shape_and_offsets():
    lp = as_json(completion_logprobs([entry("ab", -0.1, ("ab", -0.1)), entry("c", -2.0, ("d", -1.0))], 3))
    assert lp == {"tokens": ["ab", "c"], "token_logprobs": [-0.1, -2.0],
                  "top_logprobs": [{"ab": -0.1}, {"d": -1.0, "c": -2.0}], "text_offset": [3, 5]}


def test_streamed_completion_offsets_continue_across_chunks():
    renderer = Renderer("cmpl-1", "m", chat=False, logprobs=0)
    first = as_json(renderer.chunk(0, "ab", logprobs=[entry("ab", -0.1)]))
    second = as_json(renderer.chunk(0, "c", logprobs=[entry("c", -0.2)]))
    other = as_json(renderer.chunk(1, "x", logprobs=[entry("x", -0.3)]))
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]
    assert other["choices"][0]["logprobs"]["text_offset"] == [0]


def test_chat_chunks():
    renderer = Renderer("chatcmpl-1", "m", chat=True, logprobs=1)
    role = as_json(renderer.role_chunk(1))
    assert role["choices"] == [{"index": 1, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]
    assert "usage" not in role
    text = as_json(renderer.chunk(0, "hi", logprobs=[entry("hi", -0.1)]))["choices"][0]
    assert text["delta"] == {"content": "hi"} and len(text["logprobs"]["content"]) == 1
    end = as_json(renderer.chunk(0, finish_reason="eos"))["choices"][0]
    assert end == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    last = as_json(renderer.usage_chunk([Finished("eos", 3, 1)]))
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 4
    assert last["object"] == "chat.completion.chunk"


def test_reasoning_is_rendered_apart_from_content():
    c = Choice()
    c.add(TextDelta("", (1,), reasoning="think"))
    c.add(TextDelta("answer", (2,)))
    c.done = Finished("eos", 1, 2)
    message = as_json(Renderer("c", "m", chat=True).full([c]))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "answer", "reasoning": "think"}
    delta = as_json(Renderer("c", "m", chat=True).chunk(0, "", "think"))["choices"][0]["delta"]
    assert delta == {"reasoning": "think"}
