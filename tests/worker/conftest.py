"""Fixtures: tiny checkpoints saved once per session, and Driver/Oracle pairs over them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pypto_serving.worker.model_runner import ModelRunner
from tests.worker.tiny_models import Driver, Oracle, build_hf_model, worker_config


@pytest.fixture(scope="session")
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """name -> (checkpoint dir, the transformers model saved there); built once per session."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            model = build_hf_model(name)
            model.save_pretrained(path)
            cache[name] = (path, model)
        return cache[name]

    return get


@pytest.fixture
def driver(checkpoint: Callable) -> Callable[..., tuple[Driver, Oracle]]:
    """(name, **config overrides) -> (Driver over a fresh ModelRunner, the HF oracle)."""

    def make(name: str, **overrides: object) -> tuple[Driver, Oracle]:
        path, hf = checkpoint(name)
        return Driver(ModelRunner(worker_config(path, **overrides))), Oracle(hf)

    return make
