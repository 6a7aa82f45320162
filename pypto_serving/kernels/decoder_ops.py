"""The kernels a decoder layer is made of, as one swappable set that a backend picks
(backends/): portable torch (`PORTABLE`), SDPA prefill for the accelerators (`SDPA`), the
cpu backend's fused C kernels (kernels/cpu/decoder.py, kernels/cpu/moe.py), or the npu
backend's torch_npu operators (kernels/npu.py).

`attend` covers rotary -> KV write -> paged attention, so the CPU set can rotate q and k in
place inside the fused qkv projection and write the cache in the same pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pypto_serving.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pypto_serving.kernels.attention import AttentionMetadata, paged_attention, sdpa_prefill_attention
from pypto_serving.kernels.moe import FusedMoe, fused_moe
from pypto_serving.kernels.paged_kv import write_kv
from pypto_serving.kernels.rmsnorm import add_rms_norm, gemma_rms_norm, rms_norm
from pypto_serving.kernels.rotary import apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]
Rotary = tuple[torch.Tensor, torch.Tensor]
# (q, k, v [T, heads, d] views, rotary, kv, meta, scale) -> [T, heads, d]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Rotary, KVCache, AttentionMetadata, float],
                  torch.Tensor]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary, kv: KVCache,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Portable: rotate q and k, store k and v, attend over each sequence's cached context."""
    return paged_attention(_rotate_and_store(q, k, v, rotary, kv, meta), kv[0], kv[1], meta, scale)


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary, kv: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """As `attend`, with SDPA over each prefill chunk's whole context (the accelerators')."""
    def prefill(pq: torch.Tensor, ctx_slots: torch.Tensor) -> torch.Tensor:
        return sdpa_prefill_attention(pq, kv[0], kv[1], ctx_slots, scale, meta.window)

    q = _rotate_and_store(q, k, v, rotary, kv, meta)
    return paged_attention(q, kv[0], kv[1], meta, scale, prefill=prefill)


# (q [B, heads, d], k_cache, v_cache, slots [B, L], lens [B], scale) -> [B, heads, d]
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                        torch.Tensor]


# (q, k, v [T, heads, d], rotary, kv, slot_mapping) -> the rotated q; k, v stored
RotateStore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Rotary, KVCache, torch.Tensor],
                       torch.Tensor]


def attend_sdpa_with(decode_kernel: DecodeKernel, rotate_store: RotateStore | None = None) -> Attend:
    """`attend_sdpa` with `decode_kernel` for the single-query rows (a paged kernel that reads
    the cache through the slot table, instead of the portable gather) and, when given,
    `rotate_store` for rotary and the KV write (one fused kernel)."""
    def attend_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary, kv: KVCache,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
        def prefill(pq: torch.Tensor, ctx_slots: torch.Tensor) -> torch.Tensor:
            return sdpa_prefill_attention(pq, kv[0], kv[1], ctx_slots, scale, meta.window)

        def decode(dq: torch.Tensor) -> torch.Tensor:
            return decode_kernel(dq, kv[0], kv[1], meta.decode_slots, meta.decode_lens, scale)

        if rotate_store is not None:
            q = rotate_store(q, k, v, rotary, kv, meta.slot_mapping)
        else:
            q = _rotate_and_store(q, k, v, rotary, kv, meta)
        # the paged kernel reads every key of its rows: a sliding window's rows take the portable one
        paged = meta.decode_lens is not None and not meta.window
        return paged_attention(q, kv[0], kv[1], meta, scale, decode if paged else None, prefill)

    return attend_paged


def _rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary, kv: KVCache,
                      meta: AttentionMetadata) -> torch.Tensor:
    """Rotates q and k, stores k and v at their slots; returns the rotated q."""
    q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
    return q


def qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k [T, heads, d] before rotary."""
    return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)


def gemma_qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 3's per-head norms of q and k [T, heads, d] (scaled by 1 + weight) before rotary."""
    return gemma_rms_norm(q, q_weight, eps), gemma_rms_norm(k, k_weight, eps)


def gemma_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual + Gemma's norm of x: a post-norm block's residual add."""
    return residual + gemma_rms_norm(x, weight, eps)


@dataclass(frozen=True, slots=True)
class DecoderOps:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    attend: Attend
    qk_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                      tuple[torch.Tensor, torch.Tensor]] = qk_norm
    fused_moe: FusedMoe = fused_moe  # a mixture-of-experts layer's experts (kernels/moe.py)
    # Gemma 3's GeGLU, its norms (scaled by 1 + weight), its post-norms' residual add, its q/k norms
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh_and_mul
    gemma_rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = gemma_rms_norm
    gemma_add_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] = gemma_add_norm
    gemma_qk_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                            tuple[torch.Tensor, torch.Tensor]] = gemma_qk_norm


PORTABLE = DecoderOps(rms_norm, add_rms_norm, silu_and_mul, attend)
SDPA = DecoderOps(rms_norm, add_rms_norm, silu_and_mul, attend_sdpa)
