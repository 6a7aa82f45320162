"""A request that only scores its prompt (`echo` with `max_tokens: 0`) generates nothing, and
the metrics say so: the one token its step samples is dropped, not counted."""

from __future__ import annotations

from pypto_serving.app.packaged_models import smollm2_path
from tests.replies.scripted import ScriptedServer


async def test_scoring_only_counts_no_generated_tokens():
    server = ScriptedServer(str(smollm2_path()))
    server.say("one two three")
    async with server as client:
        r = await client.post("/v1/completions", json={"prompt": "Count:", "max_tokens": 0, "echo": True})
        body = await r.json()
        assert r.status == 200 and body["usage"]["completion_tokens"] == 0
        assert body["choices"][0]["text"] == "Count:"
        assert server.engine.metrics.generation_tokens == 0
        asked = server.engine.metrics.histograms["request_params_max_tokens"]
        assert (asked.count, asked.sum) == (1, 0)  # the client's max_tokens: 0
        r = await client.post("/v1/completions", json={"prompt": "Count:", "max_tokens": 2})
        assert (await r.json())["usage"]["completion_tokens"] == 2
        assert server.engine.metrics.generation_tokens == 2  # counted when generated
