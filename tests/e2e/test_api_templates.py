"""reasoning_effort, chat_template_kwargs and the message fields reach the chat template.

A tiny random Qwen3 checkpoint whose template writes each of them into the prompt serves the
requests; the prompt token counts the server reports must equal those of rendering the same
inputs locally, and differ from the plain rendering.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pypto_serving.tokenizer.tokenizer import Tokenizer
from tests.e2e.server import ServerProcess

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments }}</call>"
    "{% endfor %}{% if m.tool_call_id %}<result of {{ m.tool_call_id }}>{% endif %}{% endfor %}"
    "{% if reasoning_effort is defined %}<effort: {{ reasoning_effort }}>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def save_checkpoint(path: Path) -> None:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEMPLATE, "What is the weather in Paris? Sunny, 20 degrees."] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=256))
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("templated")
    save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def http(checkpoint: Path) -> httpx.Client:
    args = ["--model", str(checkpoint), "--max-model-len", "256", "--kv-cache-memory", "8MiB"]
    with ServerProcess(args) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def local(checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_hf_dir(checkpoint)


def prompt_tokens(http: httpx.Client, **body: object) -> int:
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def rendered(local: Tokenizer, messages: list[dict] = USER, **kwargs: object) -> int:
    return len(local.encode(local.apply_chat_template(messages, **kwargs), add_special_tokens=False))


def test_reasoning_effort_none_turns_thinking_off(http: httpx.Client, local: Tokenizer):
    plain = prompt_tokens(http)
    assert plain == rendered(local)
    off = prompt_tokens(http, reasoning_effort="none")
    assert off == rendered(local, reasoning_effort="none", enable_thinking=False) != plain
    high = prompt_tokens(http, reasoning_effort="high")
    assert high == rendered(local, reasoning_effort="high") != off


def test_chat_template_kwargs_reach_the_template_and_win(http: httpx.Client, local: Tokenizer):
    off = prompt_tokens(http, chat_template_kwargs={"enable_thinking": False})
    assert off == rendered(local, enable_thinking=False) != rendered(local)
    kept = prompt_tokens(http, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert kept == rendered(local, reasoning_effort="none", enable_thinking=True)


def test_reasoning_tool_calls_and_tool_results_reach_the_template(http: httpx.Client, local: Tokenizer):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    history = USER + [
        {"role": "assistant", "content": None, "reasoning": "Look it up.", "tool_calls": [call]},
        {"role": "tool", "content": "Sunny, 20 degrees.", "tool_call_id": "call_1"},
    ]
    got = prompt_tokens(http, messages=history)
    messages = [USER[0], {"role": "assistant", "reasoning_content": "Look it up.", "tool_calls": [call]},
                {"role": "tool", "content": "Sunny, 20 degrees.", "tool_call_id": "call_1"}]
    assert got == rendered(local, messages)
    bare = [USER[0], {"role": "assistant", "content": ""}, {"role": "tool", "content": "Sunny, 20 degrees."}]
    assert got > rendered(local, bare)
