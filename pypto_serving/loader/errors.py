"""Errors raised while reading a model (checkpoint directory or GGUF file)."""

from __future__ import annotations


class UnsupportedModel(ValueError):
    """The checkpoint is readable but describes a model this server cannot run."""
