"""How many bytes the KV cache may take on an accelerator (cuda, npu)."""

from __future__ import annotations

import ctypes
import ctypes.util
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


def release_freed_memory() -> None:
    """Makes glibc give large freed blocks back to the OS (CPU only).

    Loading dequantizes and packs tensor after tensor; glibc's dynamic mmap threshold would
    keep those freed megabytes in the heap, and the worker's resident memory would stay
    hundreds of MiB above its weights and KV cache for good.
    """
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name)
    if hasattr(libc, "mallopt"):
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: allocations over 1 MiB get their own mapping
