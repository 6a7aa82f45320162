"""The served SmolLM2 GGUF answers chat prompts exactly as transformers does on the same file,
with float32 activations (`--activation-quantization none`; the CPU default quantizes them to
int8 like llama.cpp, which moves logits slightly: tests/worker/test_real_model.py bounds that)."""

from __future__ import annotations

import httpx
import pytest
import torch

from pypto_serving.tokenizer.tokenizer import Tokenizer
from tests.e2e.server import ServerProcess


@pytest.fixture(scope="module")
def exact_server() -> ServerProcess:
    with ServerProcess(["--max-model-len", "512", "--kv-cache-memory", "64MiB",
                        "--activation-quantization", "none"]) as srv:
        yield srv

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Describe rain."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count to five."}],
]
NEW_TOKENS = 20


@pytest.mark.parametrize("messages", CHATS, ids=["question", "system", "multi-turn"])
def test_greedy_chat_equals_transformers(exact_server: ServerProcess, hf_smollm2, smollm2_gguf: str,
                                         messages: list[dict]):
    body = {"messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(exact_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ours = r.json()["choices"][0]["message"]["content"]
    tokenizer = Tokenizer.from_gguf(smollm2_gguf)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert ours == tokenizer.decode(hf_greedy(hf_smollm2, prompt, NEW_TOKENS))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain argmax decoding that never stops at EOS, like ignore_eos on our side."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
