"""Every generation field, end to end on the real server (SmolLM2): the openai client where
it can express the request, raw HTTP where it cannot. Each test fails if the field's
semantics break, not merely if the field is refused."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pypto_serving.app.packaged_models import smollm2_path
from pypto_serving.tokenizer.tokenizer import Tokenizer
from tests.e2e.api import COUNT, EOS_TEXT, SHORT_ANSWER, assert_error, openai_client, text_of
from tests.e2e.server import ServerProcess


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path())


def complete(http: httpx.Client, **body: object) -> dict:
    r = http.post("/v1/completions", json={"max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(http: httpx.Client, **body: object) -> dict:
    r = http.post("/v1/chat/completions",
                  json={"messages": SHORT_ANSWER, "max_tokens": 10, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def tokens(body: dict) -> list[str]:
    """The generated tokens, read from the chat logprobs."""
    return [e["token"] for e in body["choices"][0]["logprobs"]["content"]]


def test_model_is_only_the_response_label(http: httpx.Client, client: openai.OpenAI):
    assert complete(http, prompt="Hi", max_tokens=1)["model"] == "smollm2"
    assert chat(http, max_tokens=1)["model"] == "smollm2"
    out = client.chat.completions.create(model="any-label", messages=SHORT_ANSWER, max_tokens=1)
    assert out.model == "any-label"


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI, http: httpx.Client):
    out = client.chat.completions.create(model="m", messages=SHORT_ANSWER, max_tokens=6,
                                         max_completion_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2 and out.choices[0].finish_reason == "length"
    body = chat(http, max_tokens=3, max_completion_tokens=None, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path, field", [
    ("/v1/chat/completions", "max_tokens"), ("/v1/chat/completions", "max_completion_tokens"),
])
def test_token_limits_must_be_positive(http: httpx.Client, path: str, field: str):
    for value in (0, -5):
        body = {"prompt": "x", "messages": SHORT_ANSWER, field: value}
        assert assert_error(http.post(path, json=body), field, ">= 1")["param"] == field


def test_completion_max_tokens_is_positive_or_zero_with_echo(http: httpx.Client):
    zero = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert assert_error(zero, "max_tokens", "at least 1", "echo")["param"] == "max_tokens"
    negative = http.post("/v1/completions", json={"prompt": "x", "max_tokens": -5, "echo": True})
    assert assert_error(negative, "max_tokens", ">= 0")["param"] == "max_tokens"


def test_limit_above_the_context_room_is_capped_and_logged(http: httpx.Client, server: ServerProcess,
                                                           tokenizer: Tokenizer):
    prompt = tokenizer.encode(" hello", add_special_tokens=False) * 509  # 3 tokens of room left
    body = complete(http, prompt=prompt, max_tokens=50)
    assert body["usage"] == {"prompt_tokens": 509, "completion_tokens": 3, "total_tokens": 512,
                             "prompt_tokens_details": body["usage"]["prompt_tokens_details"]}
    assert body["choices"][0]["finish_reason"] == "length"
    assert re.search(r"max_tokens capped.*capped=3.*requested=50|requested=50.*capped=3", server.output())


def test_min_tokens_keeps_eos_from_being_sampled(http: httpx.Client):
    free = tokens(chat(http, ignore_eos=True, logprobs=True))
    assert EOS_TEXT in free[:9], free  # without min_tokens the model samples EOS early...
    held = tokens(chat(http, ignore_eos=True, logprobs=True, min_tokens=9))
    assert EOS_TEXT not in held[:9], held  # ...with it, EOS is masked (even with ignore_eos)
    stopped = chat(http, min_tokens=9)
    assert stopped["usage"]["completion_tokens"] >= 9
    assert_error(http.post("/v1/chat/completions",
                           json={"messages": SHORT_ANSWER, "max_tokens": 4, "min_tokens": 5}),
                 "min_tokens", "4")


def test_stop_token_ids_stop_and_are_masked_by_min_tokens(http: httpx.Client, tokenizer: Tokenizer):
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    body = complete(http, prompt=COUNT, stop_token_ids=[comma])
    assert body["choices"][0] == {"index": 0, "text": " 5,", "logprobs": None, "finish_reason": "stop"}
    held = complete(http, prompt=COUNT, stop_token_ids=[comma], min_tokens=4, logprobs=0)
    assert "," not in held["choices"][0]["logprobs"]["tokens"][:4]
    assert_error(http.post("/v1/completions", json={"prompt": "x", "stop_token_ids": [10**9]}),
                 "stop_token_ids", "vocabulary")


def test_ignore_eos_overrides_per_chat_request(http: httpx.Client):
    stops = chat(http)
    assert stops["choices"][0]["finish_reason"] == "stop" and stops["usage"]["completion_tokens"] < 10
    runs = chat(http, ignore_eos=True)
    assert runs["choices"][0]["finish_reason"] == "length" and runs["usage"]["completion_tokens"] == 10


def test_completions_always_run_through_eos(http: httpx.Client, tokenizer: Tokenizer):
    prompt = tokenizer.apply_chat_template(SHORT_ANSWER)
    body = complete(http, prompt=prompt, max_tokens=10, logprobs=0)
    assert body["usage"]["completion_tokens"] == 10 and body["choices"][0]["finish_reason"] == "length"
    assert EOS_TEXT in body["choices"][0]["logprobs"]["tokens"]  # sampled, and ignored


def test_stop_strings_cut_before_the_first_match(client: openai.OpenAI):
    def run(stop: object) -> openai.types.Completion:
        return client.completions.create(model="m", prompt="The capital of France is", max_tokens=6,
                                         temperature=0, stop=stop)

    full = run(None).choices[0].text
    assert full.startswith(" Paris.")
    inside = run(["ari"]).choices[0]  # "ari" is inside the single token " Paris"
    assert (inside.text, inside.finish_reason) == (" P", "stop")
    earliest = run([".", "Paris"]).choices[0]  # the earliest match wins, not the first listed
    assert earliest.text == " "
    assert run("\n").choices[0].text == " Paris."  # a single string works too


def test_stop_list_limits(http: httpx.Client):
    assert_error(http.post("/v1/completions", json={"prompt": "x", "stop": ["a"] * 33}), "stop", "32")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "stop": [""]}), "stop")


def test_same_seed_same_text_alone_and_in_any_batch(http: httpx.Client):
    def sample(seed: int) -> str:
        return text_of(complete(http, prompt="My favourite animal is", max_tokens=4, temperature=1.0,
                                seed=seed))

    alone = sample(7)
    with ThreadPoolExecutor(6) as pool:
        batch = list(pool.map(sample, [7, 8, 9, 7, 10, 11]))
    assert batch[0] == batch[3] == alone
    assert len(set(batch)) == 5  # different seeds, different text


def test_temperature_zero_is_greedy_and_cutoffs_are_applied(http: httpx.Client):
    prompt = {"prompt": "My favourite animal is", "max_tokens": 4}
    greedy = text_of(complete(http, **prompt))
    assert text_of(complete(http, **prompt)) == greedy
    hot = {"temperature": 1.5, "seed": 5, **prompt}
    assert text_of(complete(http, **hot)) != greedy  # this seed samples away from greedy...
    for cutoff in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert text_of(complete(http, **hot, **cutoff)) == greedy, cutoff  # ...which a cutoff prevents
    for field, value in (("temperature", -0.5), ("top_p", 0), ("top_p", 1.01), ("top_k", -2),
                         ("min_p", 1.5)):
        assert_error(http.post("/v1/completions", json={"prompt": "x", field: value}), field)
    complete(http, prompt="x", top_k=None, max_tokens=1)
    for no_cut in (0, -1):  # as vLLM takes them: the whole vocabulary
        assert text_of(complete(http, **hot, top_k=no_cut)) == text_of(complete(http, **hot)), no_cut


def test_penalties_change_what_repeats(http: httpx.Client):
    prompt = {"prompt": "a b a b a b a b", "max_tokens": 6}
    assert text_of(complete(http, **prompt)).startswith(" a b a b")
    for field in ("presence_penalty", "frequency_penalty"):
        text = text_of(complete(http, **prompt, **{field: 2.0}))
        assert text.count(" a") == 1, (field, text)  # used once, then penalized
    assert text_of(complete(http, **prompt, presence_penalty=-2.0)).startswith(" a a a")
    text = text_of(complete(http, **prompt, repetition_penalty=1.5))
    assert " a" not in text and " b" not in text, text  # the prompt's tokens count too
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("repetition_penalty", 0)):
        assert_error(http.post("/v1/completions", json={"prompt": "x", field: value}), field)


def test_n_choices_each_with_its_own_seed(client: openai.OpenAI):
    kwargs = dict(model="m", prompt="My favourite animal is", max_tokens=6, temperature=1.0)
    out = client.completions.create(n=3, seed=20, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) == 3
    single = client.completions.create(seed=21, **kwargs)
    assert single.choices[0].text == texts[1]  # choice i is seed + i
    assert out.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert out.usage.completion_tokens == 18 == out.usage.total_tokens - out.usage.prompt_tokens


def test_chat_logprobs(client: openai.OpenAI):
    out = client.chat.completions.create(model="m", messages=SHORT_ANSWER, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        # greedy: the chosen token is the most likely one
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
    text = bytes(b for e in content for b in e.bytes).decode()
    assert out.choices[0].message.content == text.replace(EOS_TEXT, "")


def test_completion_logprobs(client: openai.OpenAI, http: httpx.Client):
    out = client.completions.create(model="m", prompt=COUNT, max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.tokens) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and len(top) <= 3
    assert_error(http.post("/v1/completions", json={"prompt": "x", "logprobs": 21}), "logprobs", "20")
    assert_error(http.post("/v1/chat/completions", json={"messages": SHORT_ANSWER, "top_logprobs": 2}),
                 "top_logprobs", "logprobs")


def test_stream_options_include_usage(client: openai.OpenAI, http: httpx.Client):
    chunks = list(client.chat.completions.create(model="m", messages=SHORT_ANSWER, max_tokens=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    body = {"prompt": "x", "stream_options": {"include_usage": True}}
    assert_error(http.post("/v1/completions", json=body), "stream_options", "stream")


@pytest.mark.parametrize("field, value", [
    ("best_of", 3), ("logit_bias", {"42": 5}), ("suffix", "end"),
    ("use_beam_search", True), ("guided_regex", "a+"),
])
def test_known_fields_we_do_not_implement_are_refused(http: httpx.Client, field: str, value: object):
    body = assert_error(http.post("/v1/completions", json={"prompt": "x", field: value}), field)
    assert body["param"] == field


def test_unknown_fields_are_ignored(http: httpx.Client):
    assert complete(http, prompt="Hi", max_tokens=1, frobnicate={"x": 1}, user="u1")["usage"]


def test_usage_is_exact_and_reports_prefix_cache_hits(http: httpx.Client, tokenizer: Tokenizer):
    prompt = "A long shared preamble that fills a few KV blocks of sixteen tokens each. " * 3
    first = complete(http, prompt=prompt, max_tokens=2)["usage"]
    again = complete(http, prompt=prompt, max_tokens=2)["usage"]
    assert first["prompt_tokens"] == len(tokenizer.encode(prompt)) == again["prompt_tokens"]
    assert first["total_tokens"] == first["prompt_tokens"] + 2
    assert again["prompt_tokens_details"]["cached_tokens"] >= 32


def test_response_envelopes(http: httpx.Client):
    text = complete(http, prompt="Hi", max_tokens=1)
    assert text["id"].startswith("cmpl-") and text["object"] == "text_completion"
    assert isinstance(text["created"], int)
    body = chat(http, max_tokens=1)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_reasoning_effort_values(http: httpx.Client):
    assert chat(http, reasoning_effort="none", max_tokens=1)["usage"]["completion_tokens"] == 1
    body = assert_error(http.post("/v1/chat/completions",
                                  json={"messages": SHORT_ANSWER, "reasoning_effort": "extreme"}),
                        "reasoning_effort", "minimal", "xhigh")
    assert body["param"] == "reasoning_effort"


def test_message_fields(http: httpx.Client):
    history = [{"role": "system", "content": "Be brief.", "name": "rules"},
               {"role": "user", "content": None},
               {"role": "assistant", "content": "4", "reasoning": "2+2"},
               {"role": "user", "content": "Thanks"}]
    assert chat(http, messages=history, max_tokens=1)["usage"]["prompt_tokens"] > 10
    parts = [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]
    assert_error(http.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": parts}]}), "multimodal")
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}),
                 "role", "assistant")
