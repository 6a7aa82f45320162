"""The decoder's elementwise kernels in Triton, one launch each, each row read once: RMSNorm,
the residual add fused into it, SiLU-and-mul, and rotary fused with the KV write.

They compute what the portable kernels (kernels/rmsnorm.py, activation.py, rotary.py,
paged_kv.py) compute, and round where they round: the norm in float32 and cast back before the
weight's multiply, the residual sum and SiLU's output in the activations' dtype. Arithmetic is
float32 with explicit roundings (a product or sum of two bf16 values is what torch's bf16 op
gives; Triton's interpreter, which the tests run, multiplies bf16 values wrongly). Rotary runs
in float32 and rounds once (the portable one rounds after each multiply in bf16/fp16), so in
those dtypes the two differ by an ulp here and there; in float32 they agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k, v) caches, or (cos, sin)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    out = (normed * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, d] with unit stride along d (a copy only where it has none)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.rmsnorm.rms_norm: x [..., d], weight [d] -> [..., d]."""
    flat = _rows(x)
    out = torch.empty(flat.shape, dtype=torch.result_type(x, weight), device=x.device)
    n = flat.shape[1]
    _rms_norm_kernel[(flat.shape[0],)](flat, flat, weight, out, out, flat.stride(0), 0, out.stride(0), 0, n,
                                       eps, HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.rmsnorm.add_rms_norm: (rms_norm(x + residual), x + residual)."""
    flat, res = _rows(x), _rows(residual)
    total = torch.empty_like(flat)
    out = torch.empty(flat.shape, dtype=torch.result_type(x, weight), device=x.device)
    n = flat.shape[1]
    _rms_norm_kernel[(flat.shape[0],)](flat, res, weight, out, total, flat.stride(0), res.stride(0),
                                       out.stride(0), total.stride(0), n, eps, HAS_RESIDUAL=True,
                                       BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape), total.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.silu_and_mul: [..., 2 * i] = [gate | up] -> silu(gate) * up [..., i]."""
    flat = _rows(x)
    n = flat.shape[1] // 2
    out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(flat.shape[0], triton.cdiv(n, block))](flat, out, flat.stride(0), out.stride(0), n,
                                                                 BLOCK=block)
    return out.view(*x.shape[:-1], n)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, cache_ptr, v_ptr, v_cache_ptr, slots_ptr,
                   stride_xt, stride_xh, stride_ct, stride_ot, stride_oh, stride_vt, stride_vh, cache_row,
                   HALF: tl.constexpr, H_PAD: tl.constexpr, HEADS: tl.constexpr, D_PAD: tl.constexpr,
                   STORE: tl.constexpr):
    """One token: its heads rotated (halves paired i, i + d/2) into `out`; with STORE also
    written, with the token's v, at its slot of the caches."""
    t = tl.program_id(0)
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, D_PAD)[None, :]
    ok = (h < HEADS) & (i < HALF)
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + i, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + i, mask=ok, other=0.0)
    cos = tl.load(cos_ptr + t * stride_ct + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_ct + i, mask=i < HALF, other=0.0).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    r1 = (a * cos - b * sin).to(x1.dtype)
    r2 = (b * cos + a * sin).to(x1.dtype)
    out = out_ptr + t * stride_ot + h * stride_oh
    tl.store(out + i, r1, mask=ok)
    tl.store(out + HALF + i, r2, mask=ok)
    if STORE:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        row = cache_ptr + slot * cache_row + h * (2 * HALF)
        tl.store(row + i, r1.to(cache_ptr.dtype.element_ty), mask=ok)
        tl.store(row + HALF + i, r2.to(cache_ptr.dtype.element_ty), mask=ok)
        v_row = v_cache_ptr + slot * cache_row + h * (2 * HALF)
        v_base = v_ptr + t * stride_vt + h * stride_vh
        v1 = tl.load(v_base + i, mask=ok, other=0.0)
        v2 = tl.load(v_base + HALF + i, mask=ok, other=0.0)
        tl.store(v_row + i, v1.to(v_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(v_row + HALF + i, v2.to(v_cache_ptr.dtype.element_ty), mask=ok)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: KVCache | None,
            v: torch.Tensor | None, slots: torch.Tensor | None) -> torch.Tensor:
    tokens, heads, d = x.shape
    half = d // 2
    out = torch.empty(tokens, heads, d, dtype=x.dtype, device=x.device)
    if not tokens:
        return out
    cos2, sin2 = cos.reshape(tokens, half), sin.reshape(tokens, half)
    k_cache, v_cache = caches if caches is not None else (out, out)
    v = v if v is not None else x
    _rotary_kernel[(tokens,)](
        x, cos2, sin2, out, k_cache, v, v_cache, slots if slots is not None else cos2,
        x.stride(0), x.stride(1), cos2.stride(0), out.stride(0), out.stride(1), v.stride(0), v.stride(1),
        heads * d, HALF=half, H_PAD=triton.next_power_of_2(heads), HEADS=heads,
        D_PAD=triton.next_power_of_2(half), STORE=caches is not None)
    return out


def rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: KVCache, kv: KVCache,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """kernels.decoder_ops' rotate-and-store: q, k, v [T, heads, d] (views with unit stride along
    d) -> the rotated q; the rotated k and v written at `slot_mapping` in the caches
    [blocks, block_size, kv_heads, d] (which must be contiguous)."""
    cos, sin = rotary
    if k.shape[1] != kv[0].shape[2] or v.stride(-1) != 1 or k.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("rotate_and_store takes [T, heads, d] views with unit stride along d")
    _rotate(k, cos, sin, kv, v, slot_mapping)
    return _rotate(q, cos, sin, None, None, None)
