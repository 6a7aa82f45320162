"""The fused per-layer kernels of decoder.c, each with the portable kernel's contract
(float32 only), and the cpu backend's `attend` built from them (backends/cpu.py picks them)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pypto_serving.kernels.attention import AttentionMetadata, paged_attention
from pypto_serving.kernels.cpu import library
from pypto_serving.kernels.decoder_ops import KVCache, Rotary, attend, gemma_add_norm, gemma_qk_norm, qk_norm

MAX_HEAD_DIM = 256  # decoder.c's


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is written into `residual` in place."""
    out = torch.empty_like(residual)
    library().add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, residual.shape[0],
                           residual.shape[1], out.data_ptr())
    return out, residual


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    library().add_rms_norm(None, x.data_ptr(), weight.data_ptr(), eps, x.shape[0], x.shape[1], out.data_ptr())
    return out


def gemma_rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's norm, scaled by (1 + weight)."""
    out = torch.empty_like(x)
    library().gemma_rms_norm(x.data_ptr(), None, weight.data_ptr(), eps, *x.shape, out.data_ptr())
    return out


def gemma_add_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """residual + Gemma's norm of x (a post-norm's residual add), as a new tensor."""
    if residual.dtype != torch.float32 or residual.shape != x.shape:
        return gemma_add_norm(x, residual, weight, eps)
    out, residual = torch.empty_like(x), residual.contiguous()
    lib = library()
    lib.gemma_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, *x.shape, out.data_ptr())
    return out


def qk_norm_cpu(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_norm` in place, when q and k are consecutive float32 column blocks of the fused
    projection's rows (as `attend_cpu` then finds them), else the portable kernel."""
    if not _fused_qk(q, k, q_weight, k_weight):
        return qk_norm(q, k, q_weight, k_weight, eps)
    library().qk_norm(q.data_ptr(), q.shape[0], q.stride(0), q.shape[1], k.shape[1], q.shape[2],
                      q_weight.data_ptr(), k_weight.data_ptr(), eps)
    return q, k


def gemma_qk_norm_cpu(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemma_qk_norm` in place, where `qk_norm_cpu` runs in place, else the portable kernel."""
    if not _fused_qk(q, k, q_weight, k_weight):
        return gemma_qk_norm(q, k, q_weight, k_weight, eps)
    library().gemma_qk_norm(q.data_ptr(), q.shape[0], q.stride(0), q.shape[1], k.shape[1], q.shape[2],
                            q_weight.data_ptr(), k_weight.data_ptr(), eps)
    return q, k


def _fused_qk(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor) -> bool:
    """q [t, heads, d] and k are consecutive float32 column blocks of the same rows."""
    t, heads, d = q.shape
    return (q.dtype == k.dtype == q_weight.dtype == k_weight.dtype == torch.float32 and d % 8 == 0
            and q.stride()[1:] == (d, 1) and k.stride()[1:] == (d, 1)
            and (t == 1 or q.stride(0) == k.stride(0))  # one row: views of it may take any row stride
            and k.data_ptr() == q.data_ptr() + heads * d * 4
            and q_weight.is_contiguous() and k_weight.is_contiguous())


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """x [t, 2 * n] = [gate | up] -> silu(gate) * up [t, n]."""
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n)
    library().silu_and_mul(x.data_ptr(), x.shape[0], n, out.data_ptr())
    return out


def gelu_tanh_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """x [t, 2 * n] = [gate | up] -> gelu_tanh(gate) * up [t, n] (Gemma's GeGLU)."""
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n)
    library().gelu_tanh_and_mul(x.data_ptr(), x.shape[0], n, out.data_ptr())
    return out


def rope_write_kv_cpu(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """qkv [t, (heads + 2 kv_heads) d]: q and k rotated in place (cos/sin [t, 1, d / 2] with
    equal row strides), k and v stored at their slots (caches float32 or float16)."""
    d = k_cache.shape[-1]
    slot_mapping = slot_mapping.contiguous()
    library().rope_write_kv(qkv.data_ptr(), qkv.shape[0], heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(),
                            cos.stride(0), slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                            k_cache.dtype == torch.float16)


def decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q [b, heads, d] (rows may be strided), slots [b, L] padded, lens [b] -> [b, heads, d];
    with `window`, each query sees the last `window` keys of its context only."""
    b, heads, d = q.shape
    _check_inputs("decode_attention_cpu", k_cache, v_cache, heads, d)
    slots, lens = slots.contiguous(), lens.contiguous()  # slots is often a cut of wider block rows
    out = torch.empty(b, heads, d)
    scores = torch.empty(library().decode_scores_len(b, heads, slots.shape[1]))
    library().decode_attention(q.data_ptr(), q.stride(0), b, heads, k_cache.shape[2], d, k_cache.data_ptr(),
                               v_cache.data_ptr(), slots.data_ptr(), slots.shape[1], lens.data_ptr(), scale,
                               scores.data_ptr(), out.data_ptr(), k_cache.dtype == torch.float16, window)
    return out


def prefill_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx_slots: torch.Tensor, scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One prefill chunk: q [n, heads, d] (rows may be strided), the last n of its context
    slots [L] -> [n, heads, d], causal (and within `window` positions, when given); each row
    exactly as `decode_attention_cpu` gives it."""
    n, heads, d = q.shape
    _check_inputs("prefill_attention_cpu", k_cache, v_cache, heads, d)
    if ctx_slots.dtype != torch.int64 or ctx_slots.shape[0] < n:
        raise ValueError(f"prefill_attention_cpu needs int64 context slots for at least the chunk's {n} rows")
    if q.stride()[1:] != (d, 1):
        q = q.contiguous()
    ctx_slots = ctx_slots.contiguous()
    out = torch.empty(n, heads, d)
    if n and library().prefill_attention(
        q.data_ptr(), q.stride(0), n, heads, k_cache.shape[2], d, k_cache.data_ptr(), v_cache.data_ptr(),
        ctx_slots.data_ptr(), ctx_slots.shape[0], scale, out.data_ptr(), k_cache.dtype == torch.float16,
        window,
    ):
        raise MemoryError(f"prefill attention: no memory for scores over {ctx_slots.shape[0]} positions")
    return out


def _check_inputs(kernel: str, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, d: int) -> None:
    """The C attention takes head_dim d <= MAX_HEAD_DIM (a multiple of 8) and reads contiguous
    float32 or float16 caches [blocks, block_size, kv_heads, d], kv_heads dividing the queries'
    heads (the kernel shares each kv head among heads / kv_heads of them: a shape off that would
    divide by zero or read past the cache, taking the process down)."""
    if d > MAX_HEAD_DIM or d % 8:
        raise ValueError(f"{kernel} takes head_dim <= {MAX_HEAD_DIM} and a multiple of 8, got {d}")
    for cache in (k_cache, v_cache):
        usable = cache.dtype in (torch.float32, torch.float16) and cache.is_contiguous() and cache.dim() == 4
        if not usable or cache.shape[-1] != d or cache.shape != k_cache.shape:
            raise ValueError("the C attention takes contiguous float32 or float16 KV caches [blocks, "
                             "block_size, kv_heads, head_dim] of the queries' head_dim, got "
                             f"{cache.dtype} {tuple(cache.shape)}")
    kv_heads = k_cache.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{kernel}: {heads} query heads cannot share {kv_heads} kv heads evenly")


def fp32_rows(c_kernel: Callable, portable: Callable) -> Callable:
    """`c_kernel` for contiguous 2-D float32 rows of a width the kernels take (multiple of 8)."""
    def pick(x: torch.Tensor, *args: object) -> object:
        ok = x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] % 8 == 0
        return (c_kernel if ok else portable)(x, *args)

    return pick


def attend_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary, kv: KVCache,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The fused rotary + KV write when q, k, v are the fused projection's views and the cache
    is float32 or float16; the C attention for every row, decode and prefill, in every kind of
    step (with int8 activations a last-bit difference between two kernels can flip a
    rounding, so a token must see one kernel whatever it is batched with or chunked into)."""
    if not _fused_qkv(q, k, v, kv, rotary):
        return attend(q, k, v, rotary, kv, meta, scale)
    width = (q.shape[1] + 2 * k.shape[1]) * q.shape[2]
    qkv = torch.as_strided(q, (q.shape[0], width), (width, 1))
    rope_write_kv_cpu(qkv, q.shape[1], k.shape[1], *rotary, meta.slot_mapping, *kv)
    # The C attention keeps 8 keys of at most MAX_HEAD_DIM floats on the stack.
    if q.shape[2] > MAX_HEAD_DIM:
        return paged_attention(q, kv[0], kv[1], meta, scale)

    def decode(dq: torch.Tensor) -> torch.Tensor:
        return decode_attention_cpu(dq, kv[0], kv[1], meta.decode_slots, meta.decode_lens, scale, meta.window)

    def prefill(pq: torch.Tensor, ctx_slots: torch.Tensor) -> torch.Tensor:
        return prefill_attention_cpu(pq, kv[0], kv[1], ctx_slots, scale, meta.window)

    decode_kernel = decode if meta.decode_lens is not None else None
    return paged_attention(q, kv[0], kv[1], meta, scale, decode_kernel, prefill)


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, rotary: Rotary) -> bool:
    """q, k, v are consecutive column blocks of one contiguous float32 [T, (h + 2 kvh) d]."""
    t, heads, d = q.shape
    width = (heads + 2 * k.shape[1]) * d
    cos, sin = rotary
    return (
        q.dtype == cos.dtype == torch.float32 and kv[0].dtype in (torch.float32, torch.float16)
        and d % 16 == 0 and q.stride()[1:] == (d, 1)
        and (t == 1 or q.stride(0) == k.stride(0) == v.stride(0) == width)  # one row: any stride
        and k.data_ptr() == q.data_ptr() + heads * d * 4
        and v.data_ptr() == k.data_ptr() + k.shape[1] * d * 4
        and cos.stride(-1) == 1 and sin.stride(0) == cos.stride(0)
        and kv[0].is_contiguous() and kv[1].is_contiguous()
    )
