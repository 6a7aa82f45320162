"""A loaded model's state as plain tensors, and back: what the weight cache (worker/
weight_cache.py) stores so that a later start skips dequantizing and packing.

The state is every parameter (norms, biases, unpacked linears and embeddings, in the model's
dtype) and every packed weight's `q`, `scale` and `zero`, with each packed weight's bits. The
rotary table is not in it: `build_model` computes it, and the cache does not key on
`--max-model-len`. Restoring takes the given tensors as they are (memory-mapped ones stay
mapped: nothing is copied on the weights' device); it checks every name, shape and dtype
before it changes anything, so a state that does not fit leaves the model untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from pypto_serving.kernels.quant_linear import PackedWeight, packed_layout
from pypto_serving.models.quant import PackedRows, finish_loading

PACKED_PARTS = ("q", "scale", "zero")


def packed_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(tensors by name, bits by packed weight's name) of a loaded model, on the CPU."""
    tensors = {name: p.detach().cpu() for name, p in model.named_parameters()}
    bits = {}
    for name, module in _packed_rows(model):
        bits[name] = module.packed.bits
        tensors |= {f"{name}.{part}": getattr(module.packed, part).cpu() for part in PACKED_PARTS}
    return tensors, bits


def restore_state(model: nn.Module, tensors: dict[str, torch.Tensor], bits: dict[str, int],
                  device: torch.device) -> None:
    """Puts a `packed_state` into a model just built on `device`; ValueError (model
    untouched) if it does not fit."""
    params, packed = dict(model.named_parameters()), dict(_packed_rows(model))
    _check_fits(params, packed, tensors, bits)
    with torch.no_grad():
        for name, param in params.items():
            param.data = tensors[name].to(device)
    for name, module in packed.items():
        q, scale, zero = (tensors[f"{name}.{part}"].to(device) for part in PACKED_PARTS)
        module.use_packed(PackedWeight(q, scale, zero, bits[name], module.n, module.k))
    finish_loading(model)


def _check_fits(params: dict[str, nn.Parameter], packed: dict[str, PackedRows],
                tensors: dict[str, torch.Tensor], bits: dict[str, int]) -> None:
    expected = set(params) | {f"{name}.{part}" for name in packed for part in PACKED_PARTS}
    if set(tensors) != expected or set(bits) != set(packed):
        raise ValueError(f"the state's tensors differ from the model's: "
                         f"{sorted(set(tensors) ^ expected)[:5] or sorted(set(bits) ^ set(packed))[:5]}")
    for name, param in params.items():
        _check_tensor(name, tensors[name], param.shape, param.dtype)
    for name, module in packed.items():
        if bits[name] not in module.allowed_bits:
            raise ValueError(f"{name}: int{bits[name]} where the model packs to int{module.allowed_bits}")
        for part, (shape, dtype) in packed_layout(module.n, module.k, bits[name]).items():
            _check_tensor(f"{name}.{part}", tensors[f"{name}.{part}"], shape, dtype)


def _check_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype or not tensor.is_contiguous():
        raise ValueError(f"{name}: {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {tuple(shape)}")


def _packed_rows(model: nn.Module) -> list[tuple[str, PackedRows]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, PackedRows)]

