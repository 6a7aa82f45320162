"""How many bytes a module's weights take (the startup log, the KV budget)."""

from __future__ import annotations

import torch


def module_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
