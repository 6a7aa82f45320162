"""`--model gemma3-270m` (the packaged Gemma 3 270M Q4_K_M GGUF) on the exact path gives
transformers' greedy tokens when transformers loads the same file."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.app.model_source import resolve_model
from pypto_serving.messages.worker import ModelConfig, ModelFormat
from pypto_serving.tokenizer.tokenizer import Tokenizer
from pypto_serving.worker.model_runner import ModelRunner
from tests.worker.tiny_models import Driver, worker_config

NEW_TOKENS = 32
# The last is longer than the 512-token sliding window, so the sliding layers drop keys.
PROMPTS = {
    "capital": "The capital of France is",
    "code": "def fibonacci(n):\n    ",
    "long": " ".join(f"Fact {i}: {i} times {i} is {i * i}." for i in range(1, 50)) + " Fact 50:",
}


@pytest.fixture(scope="module")
def tokenizer(gemma3_gguf: str) -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_gguf)


@pytest.fixture(scope="module")
def ours(gemma3_gguf: str, tokenizer: Tokenizer) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, the three decoded side by side in one batch."""
    source = resolve_model("gemma3-270m")
    assert str(source.path) == gemma3_gguf
    model = ModelConfig(str(source.path), ModelFormat.GGUF, source.arch)
    d = Driver(ModelRunner(worker_config(model, max_num_blocks=512, kv_cache_bytes=1 << 26, max_num_seqs=3,
                                         max_model_len=1024, max_num_batched_tokens=1024)))
    prompts = {i: tokenizer.encode(text) for i, text in enumerate(PROMPTS.values())}
    d.step([d.add(i, prompt, chunk=len(prompt)) for i, prompt in prompts.items()])
    for _ in range(NEW_TOKENS - 1):
        d.step([d.next(i) for i in prompts])
    return {name: d.tokens[i][len(prompts[i]):] for i, name in enumerate(PROMPTS)}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_gemma3_greedy_tokens_equal_transformers(hf_gemma3, tokenizer: Tokenizer, ours: dict[str, list[int]],
                                                 name: str) -> None:
    prompt = tokenizer.encode(PROMPTS[name])
    assert (len(prompt) > 512) == (name == "long")
    with torch.no_grad():
        out = hf_gemma3.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    want = out[0, len(prompt):].tolist()
    assert tokenizer.decode(ours[name]) == tokenizer.decode(want)
    assert ours[name] == want
