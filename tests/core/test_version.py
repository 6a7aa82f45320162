"""The version /version and --version report."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from pypto_serving.core import version as version_module


def test_a_checkout_that_was_never_installed_reports_its_pyprojects_version(monkeypatch) -> None:
    """`python -m pypto_serving` from a source tree (a device machine given the checkout)
    used to die at argument parsing: no distribution metadata."""
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    version_module.version.cache_clear()
    try:
        pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
        assert version_module.version() == pyproject["project"]["version"] + "+source"
    finally:
        version_module.version.cache_clear()
