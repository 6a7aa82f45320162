"""The official openai client against the real server on the default model."""

from __future__ import annotations

import openai
import pytest

from pypto_serving.app.packaged_models import smollm2_path
from pypto_serving.tokenizer.tokenizer import Tokenizer
from tests.e2e.server import ServerProcess


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client: openai.OpenAI):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2"]
    assert models[0].object == "model" and models[0].owned_by


def test_completion(client: openai.OpenAI):
    out = client.completions.create(model="label", prompt="The capital of France is",
                                    max_tokens=8, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.model == "label"
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text.strip()
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_answers(client: openai.OpenAI):
    # SmolLM2-135M is on a knife's edge for some phrasings: for "What is the capital of
    # France?" the exact path's top two first tokens are 0.09 logits apart, for "Which city
    # is the capital of France?" 0.03, so int8 activations (ours, llama.cpp's) may start
    # "L'Etoile" or "Le Grand Chateau" instead. This phrasing leads by 1.1 logits on every
    # path and gets "The capital of France is Paris."
    question = "What is the capital of France? Answer with the city name."
    out = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason in ("stop", "length")


def test_chat_stops_at_eos(client: openai.OpenAI):
    out = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=200,
        temperature=0)
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 200
    assert "<|im_end|>" not in out.choices[0].message.content


def test_streamed_chat_equals_non_streamed(client: openai.OpenAI):
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "Name three colors."}],
                  max_tokens=32, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI):
    kwargs = dict(model="smollm2", prompt="Once upon a time", max_tokens=20, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 20


def test_token_id_prompt_equals_text_prompt(client: openai.OpenAI):
    by_text = client.completions.create(model="m", prompt="Hello there", max_tokens=6, temperature=0)
    ids = Tokenizer.from_gguf(smollm2_path()).encode("Hello there")
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.usage.prompt_tokens == 2 == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stop_string_cuts_text(client: openai.OpenAI):
    base = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
    text = base.choices[0].text
    assert " 6" in text, text
    cut = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0,
                                    stop=[" 6"])
    assert cut.choices[0].text == text[:text.index(" 6")]
    assert cut.choices[0].finish_reason == "stop"


def test_seed_reproducible_and_sampling_params(client: openai.OpenAI):
    kwargs = dict(model="m", prompt="My favourite animal is", max_tokens=16, temperature=1.0,
                  top_p=0.9, extra_body={"top_k": 40})
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    b = client.completions.create(seed=7, **kwargs).choices[0].text
    c = client.completions.create(seed=8, **kwargs).choices[0].text
    assert a == b
    assert a != c


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI):
    # SmolLM2's template ignores unknown kwargs: the request must still succeed.
    out = client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}],
        max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.usage.completion_tokens >= 1
