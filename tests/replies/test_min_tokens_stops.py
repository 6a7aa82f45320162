"""min_tokens holds back stop strings as vLLM does: none ends a reply in its first min_tokens
tokens (EOS and stop_token_ids are masked in sampling: tests/e2e/test_api_fields.py)."""

from __future__ import annotations

import json

import pytest

from pypto_serving.app.packaged_models import smollm2_path
from tests.replies.scripted import ScriptedServer

SCRIPT = "one. two. three. four. five."


@pytest.fixture
def smollm2() -> ScriptedServer:
    return ScriptedServer(str(smollm2_path()))


async def complete(client, **body: object) -> dict:
    r = await client.post("/v1/completions", json={"prompt": "Count:", "max_tokens": 40, **body})
    assert r.status == 200, await r.text()
    return (await r.json())["choices"][0]


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings_wait_for_min_tokens(smollm2: ScriptedServer, stream: bool):
    smollm2.say(SCRIPT)
    tokens = smollm2.tokenizer.encode(SCRIPT, add_special_tokens=False)
    async with smollm2 as client:
        assert (await complete(client, stop=["."]))["text"] == "one"
        for m in (2, 4, 6):  # the text of the first m tokens is not searched
            before = smollm2.tokenizer.decode(tokens[:m])
            want = SCRIPT[: SCRIPT.index(".", len(before))]
            if stream:
                r = await client.post("/v1/completions", json={
                    "prompt": "Count:", "max_tokens": 40, "stop": ["."], "min_tokens": m, "stream": True})
                raw = (await r.read()).decode()
                assert "".join(_texts(raw)) == want, m
            else:
                choice = await complete(client, stop=["."], min_tokens=m)
                assert (choice["text"], choice["finish_reason"]) == (want, "stop"), m


async def test_a_stop_string_may_start_inside_min_tokens_and_end_after(smollm2: ScriptedServer):
    smollm2.say(SCRIPT)
    async with smollm2 as client:  # ". two" starts with the second token's "."
        choice = await complete(client, stop=[". two"], min_tokens=2)
    assert (choice["text"], choice["finish_reason"]) == ("one", "stop")


def _texts(raw: str) -> list[str]:
    events = [e.removeprefix("data: ") for e in raw.strip().split("\n\n")]
    return [c["text"] for e in events[:-1] for c in json.loads(e).get("choices", [])]
