"""How many bytes the KV cache may take on an accelerator (cuda, npu)."""

from __future__ import annotations

from types import ModuleType

import torch


def accelerator(device: torch.device) -> ModuleType:
    """torch.cuda or torch.npu (torch_npu registers the same memory API under torch.npu)."""
    if device.type == "npu":
        import torch_npu  # noqa: F401  - only present on Ascend machines; registers torch.npu
    return getattr(torch, device.type)


def accelerator_kv_budget(
    device: torch.device, utilization: float, weight_bytes: int, activation_bytes: int
) -> int:
    """utilization x total device memory, less the weights and a forward's peak activations."""
    total = accelerator(device).mem_get_info(device)[1]
    return int(utilization * total) - weight_bytes - activation_bytes


def module_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
