"""A tiny random DeepSeek V4 checkpoint served over HTTP: detected from its config.json, and
concurrent greedy completions (sharing steps, so compressed state of several sequences in one
batch) give transformers' greedy text."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer

from tests.e2e.ops_helpers import save_bpe_tokenizer
from tests.e2e.server import ServerProcess
from tests.worker.test_deepseek_v4_vs_transformers import CHECKPOINTS, TINY

TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time a dragon counted 1, 2, 3."
PROMPTS = [f"Story {i}: the fox and the dragon {'counted ' * i}" for i in range(4)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-deepseek-v4")
    save_bpe_tokenizer(path, [TEXT] * 20)
    config = transformers.DeepseekV4Config(**(TINY | CHECKPOINTS["deepseek_v4_sparse"]
                                              | dict(vocab_size=320, bos_token_id=0, eos_token_id=1)))
    torch.manual_seed(0)
    transformers.DeepseekV4ForCausalLM(config).save_pretrained(path)
    return path


def expected_text(path: Path, prompt: str) -> str:
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(path).eval()
    ids = tok.encode(prompt).ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False)
    return tok.decode(out[0, len(ids):].tolist())


async def complete_all(url: str) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json={
            "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}) for p in PROMPTS))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    return [r.json() for r in replies]


def test_concurrent_greedy_completions_are_transformers_text(checkpoint: Path) -> None:
    args = ["--model", str(checkpoint), "--quantization", "none", "--max-model-len", "128",
            "--kv-cache-memory", "8MiB", "--no-weight-cache"]
    with ServerProcess(args) as server:
        replies = asyncio.run(complete_all(server.url))
        models_list = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert models_list["data"][0]["id"]
    for prompt, body in zip(PROMPTS, replies, strict=True):
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert body["choices"][0]["text"] == expected_text(checkpoint, prompt), prompt
