"""sampling.c: greedy sampling's argmax, with torch.argmax's contract, random sampling's draw,
grammars' token masks and the logprobs fields."""

from __future__ import annotations

import torch

from pypto_serving.kernels.cpu import library
from pypto_serving.kernels.sampling import SamplingTensors, TokenLogprobs, draw_portable, token_logprobs

TOP_LOGPROBS = 64  # beyond this many, torch's topk (the C kernel keeps them by insertion)


def argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 (V >= 1, unit column stride) -> [B] int64: each row's first
    largest value, or its first NaN."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    rows, width = logits.shape
    library().argmax_rows(logits.data_ptr(), rows, width, logits.stride(0), out.data_ptr())
    return out


def draw_cpu(logits: torch.Tensor, t: SamplingTensors, u: torch.Tensor) -> torch.Tensor:
    """`draw_portable`'s tokens for float32 rows (the same settings, the same kind of draw),
    without sorting the vocabulary: sampling.c's sample_rows."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, width = logits.shape
    top_k = t.top_k if t.top_k is not None else torch.zeros(rows, dtype=torch.int64)
    top_p = t.top_p if t.top_p is not None else torch.ones(rows)
    min_p = t.min_p if t.min_p is not None else torch.zeros(rows)
    temperature, u = t.temperature.contiguous(), u.to(torch.float64).contiguous()
    top_k, top_p, min_p = top_k.contiguous(), top_p.contiguous(), min_p.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    settings = (temperature, top_k, top_p, min_p, u)
    if library().sample_rows(logits.data_ptr(), rows, width, logits.stride(0),
                             *(s.data_ptr() for s in settings), out.data_ptr()):
        return draw_portable(logits, t, u)  # a thread's scratch could not be allocated
    return out


def mask_tokens_cpu(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`apply_token_bitmask`'s answer, as a new tensor (`logits` float32 [B, V] stays as it is)."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(logits.shape, dtype=torch.float32)
    rows, bitmask = rows.contiguous(), bitmask.to(torch.int32).contiguous()
    (b, v), words = logits.shape, bitmask.shape[1]
    library().mask_tokens(logits.data_ptr(), b, v, logits.stride(0), out.data_ptr(), out.stride(0),
                          rows.data_ptr(), rows.shape[0], bitmask.data_ptr(), words)
    return out


def logprobs_cpu(logits: torch.Tensor, chosen: torch.Tensor, k: int, ranks: bool = False) -> TokenLogprobs:
    """`token_logprobs`' answer for float32 rows (sampling.c's logprob_rows; the rank comes
    free, so it is always there); rows with a NaN or no finite logit take torch's (NaN)."""
    rows, width = logits.shape
    chosen = chosen.to(torch.int64).contiguous()
    outside = rows and not 0 <= int(chosen.min()) <= int(chosen.max()) < width
    if k > min(TOP_LOGPROBS, width) or outside:  # (outside the vocabulary: torch's error)
        return token_logprobs(logits, chosen, k, ranks)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    value, rank = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
    top_ids, top_values = torch.empty(rows, k, dtype=torch.int64), torch.empty(rows, k)
    if library().logprob_rows(logits.data_ptr(), rows, width, logits.stride(0), chosen.data_ptr(), k,
                              value.data_ptr(), rank.data_ptr(), top_ids.data_ptr(), top_values.data_ptr()):
        return token_logprobs(logits, chosen, k, ranks)
    return TokenLogprobs(value, rank, top_ids if k else None, top_values if k else None)
