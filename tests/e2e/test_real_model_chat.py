"""The served SmolLM2 GGUF answers chat prompts exactly as transformers does on the same file,
with float32 activations (`--activation-quantization none`; the CPU default quantizes them,
which moves logits slightly: tests/worker/test_real_model.py bounds that), and with the
default flags answers short factual questions as that exact path does."""

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


@pytest.fixture(scope="module")
def default_server() -> ServerProcess:
    with ServerProcess(["--max-model-len", "512", "--kv-cache-memory", "64MiB"]) as srv:
        yield srv


# int8 activations (llama.cpp's numerics, `--activation-quantization int8`) answer five of these
# otherwise: the first "L'Étoile, la Marseillaise, ..." (its top two first tokens are 0.09
# logits apart on the exact path), the others part from the exact text a few tokens in.
FACTS = ["What is the capital of France?", "What is the capital of Japan?", "Who wrote Romeo and Juliet?",
         "What is the chemical symbol for gold?", "What is 7 times 8?", "Who painted the Mona Lisa?",
         "How many days are in a week?"]


def test_the_default_answers_factual_questions_as_the_exact_path(exact_server: ServerProcess,
                                                                  default_server: ServerProcess):
    def answer(server: ServerProcess, question: str) -> str:
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": NEW_TOKENS,
                "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    exact = [answer(exact_server, q) for q in FACTS]
    assert exact[0] == "The capital of France is Paris."
    assert [answer(default_server, q) for q in FACTS] == exact
