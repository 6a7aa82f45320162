"""The server's version: the installed distribution's, else a source checkout's pyproject."""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path


@functools.cache
def version() -> str:
    """`pip install .` records it; `python -m pypto_serving` in a checkout that was never
    installed (a device machine given the tree) reads pyproject.toml beside the package."""
    try:
        return importlib.metadata.version("pypto-serving")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        if pyproject.is_file():
            return tomllib.loads(pyproject.read_text())["project"]["version"] + "+source"
        return "unknown"
