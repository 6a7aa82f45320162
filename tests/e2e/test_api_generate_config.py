"""`--generate-config @file.json` on a real server: omitted fields inherit the server values,
present ones win even when null or []; a bad config stops startup naming the field. And the
offline mode's finish reason for EOS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pypto_serving.app.packaged_models import smollm2_path
from pypto_serving.tokenizer.tokenizer import Tokenizer
from tests.e2e.api import COUNT, SHORT_ANSWER, sse, text_of
from tests.e2e.server import ServerProcess

CONFIG = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 40, "seed": 11, "stop": [" 7"],
          "stream": True, "ignore_eos": True}
ANIMAL = "My favourite animal is"


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> httpx.Client:
    path = tmp_path_factory.mktemp("config") / "generate.json"
    path.write_text(json.dumps(CONFIG))
    args = ["--max-model-len", "256", "--kv-cache-memory", "64MiB", "--generate-config", f"@{path}"]
    with ServerProcess(args) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def complete(http: httpx.Client, **body: object) -> dict:
    r = http.post("/v1/completions", json={"stream": False, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_omitted_sampling_fields_take_the_server_values(http: httpx.Client):
    first = complete(http, prompt=ANIMAL)
    assert first["usage"]["completion_tokens"] == 6  # max_new_tokens
    assert text_of(complete(http, prompt=ANIMAL)) == text_of(first)  # seeded by the server
    assert text_of(complete(http, prompt=ANIMAL, seed=12)) != text_of(first)
    assert text_of(complete(http, prompt=ANIMAL, temperature=0)) != text_of(first)


def test_present_fields_win_even_when_null_or_empty(http: httpx.Client):
    cut = complete(http, prompt=COUNT, temperature=0, max_tokens=10)["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (" 5, 6,", "stop")  # the server's stop
    for stop in ([], None):
        assert " 7" in text_of(complete(http, prompt=COUNT, temperature=0, max_tokens=10, stop=stop))
    default_length = complete(http, prompt=ANIMAL, temperature=0, max_tokens=None)
    assert default_length["usage"]["completion_tokens"] == 6  # null max_tokens: the server's


def test_stream_default_and_override(http: httpx.Client):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks, last = sse(r.text)
    assert last == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] == 2
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": False})
    assert r.headers["content-type"].startswith("application/json")


def test_ignore_eos_default_and_per_request_override(http: httpx.Client):
    body = {"messages": SHORT_ANSWER, "max_tokens": 10, "temperature": 0, "stream": False}
    runs = http.post("/v1/chat/completions", json=body).json()
    assert runs["choices"][0]["finish_reason"] == "length" and runs["usage"]["completion_tokens"] == 10
    stops = http.post("/v1/chat/completions", json={**body, "ignore_eos": False}).json()
    assert stops["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("config, field", [
    ({"max_new_tokens": 5, "temprature": 0.5}, "temprature"),
    ({"top_p": 1.5}, "top_p"),
])
def test_a_bad_config_file_stops_startup_naming_the_field(tmp_path: Path, config: dict, field: str):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "pypto_serving", "--generate-config", f"@{path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--generate-config" in out.stderr and field in out.stderr, out.stderr


def test_an_unreadable_config_file_is_named(tmp_path: Path):
    missing = tmp_path / "missing.json"
    out = subprocess.run([sys.executable, "-m", "pypto_serving", "--generate-config", f"@{missing}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "missing.json" in out.stderr, out.stderr


def test_offline_mode_prints_eos_for_eos():
    prompt = Tokenizer.from_gguf(smollm2_path()).apply_chat_template(SHORT_ANSWER)
    out = subprocess.run([sys.executable, "-m", "pypto_serving", "--prompt", prompt, "--generate-config",
                          '{"max_new_tokens": 16}', "--kv-cache-memory", "64MiB"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "finish_reason: eos" in out.stdout, out.stdout
