"""sampling.c: greedy sampling's argmax, with torch.argmax's contract."""

from __future__ import annotations

import torch

from pypto_serving.kernels.cpu import library


def argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 (V >= 1, unit column stride) -> [B] int64: each row's first
    largest value, or its first NaN."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    rows, width = logits.shape
    library().argmax_rows(logits.data_ptr(), rows, width, logits.stride(0), out.data_ptr())
    return out
