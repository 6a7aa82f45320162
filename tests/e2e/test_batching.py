"""Continuous batching must not change anybody's greedy output."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.e2e.server import ServerProcess

PROMPTS = [f"Write a sentence about the number {i}." for i in range(8)] + [
    "The quick brown fox", "In 1492, Columbus", "def fibonacci(n):", "Dear diary, today",
    "The recipe needs flour,", "Rain in the mountains", "import numpy as np\n", "Once upon a time,",
]


def _complete(url: str, prompt: str) -> list:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_sixteen_concurrent_greedy_requests_match_alone(server: ServerProcess):
    alone = [_complete(server.url, p) for p in PROMPTS]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: _complete(server.url, p), PROMPTS))
    assert together == alone


def test_shared_prefix_requests_match_uncached(server: ServerProcess):
    system = "You are a terse assistant. Answer in one short sentence. " * 6
    prompts = [system + f"Question {i}: what is {i} plus {i}?" for i in range(4)]
    first = [_complete(server.url, p) for p in prompts]  # later ones hit the prefix cache
    again = [_complete(server.url, p) for p in prompts]  # all hit
    assert first == again
