"""`--generate-config`: inline JSON or @file; unknown keys and bad values name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from pypto_serving.core.generate_config import GenerateConfigError, GenerateDefaults, parse_generate_config


def test_defaults_without_a_config():
    assert parse_generate_config(None) == GenerateDefaults()
    assert GenerateDefaults().max_new_tokens == 256 and GenerateDefaults().temperature == 0.0


def test_inline_and_file(tmp_path: Path):
    inline = parse_generate_config('{"max_new_tokens": 5, "temperature": 1, "stop": ["x"], "stream": true}')
    assert (inline.max_new_tokens, inline.temperature, inline.stop, inline.stream) == (5, 1.0, ["x"], True)
    path = tmp_path / "gen.json"
    path.write_text('{"seed": 4, "ignore_eos": true, "top_k": 3, "top_p": 0.5}')
    config = parse_generate_config(f"@{path}")
    assert (config.seed, config.ignore_eos, config.top_k, config.top_p) == (4, True, 3, 0.5)


def test_top_k_0_and_minus_1_are_server_defaults_too():
    from tests.http.test_protocol import completion

    for value in (0, -1):
        defaults = parse_generate_config(f'{{"top_k": {value}}}')
        assert completion(defaults).request.sampling.top_k == 0


@pytest.mark.parametrize("text, words", [
    ('{"temprature": 1}', ["temprature"]),
    ('{"top_k": "x"}', ["top_k", "int"]),
    ('{"top_k": -2}', ["top_k", ">= -1"]),
    ('{"max_new_tokens": 0}', ["max_new_tokens", ">= 1"]),
    ('{"temperature": -1}', ["temperature", ">= 0.0"]),
    ('{"top_p": 0}', ["top_p"]),
    ('{"stop": "x"}', ["stop", "array"]),
    ('{"stop": [""]}', ["stop"]),
    ('{"seed": 99999999999999999999}', ["seed"]),
    ('{"stream": "yes"}', ["stream", "bool"]),
    ("[1]", ["object"]),
    ("{", ["JSON"]),
])
def test_bad_configs_name_the_field(text: str, words: list[str]):
    with pytest.raises(GenerateConfigError) as info:
        parse_generate_config(text)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_missing_file_is_named(tmp_path: Path):
    with pytest.raises(GenerateConfigError, match="nope.json"):
        parse_generate_config(f"@{tmp_path / 'nope.json'}")
