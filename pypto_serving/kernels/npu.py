"""The npu backend's decoder ops on torch_npu's fused operators (Ascend A2/A3: `--platform a2a3`).
Imported by backends/npu.py only, on a machine with torch_npu.

Each call follows its operator's page in Ascend/op-plugin, docs/zh/custom_APIs/torch_npu/:
- RMSNorm: `npu_rms_norm(x, gamma, epsilon) -> (y, rstd)`; the pre-norm block's residual add
  fused in: `npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x1 + x2)`.
- SwiGLU: `npu_swiglu(x, dim=-1)` is silu(first half) * second half: our [gate | up].
- Rotary: `npu_rotary_mul(x, r1, r2)` in its default "half" mode is kernels/rotary.py's
  half-rotation, with r1, r2 the full-width cos and sin; x as BSND [1, T, heads, d], r1 and r2
  as 1S1D [1, T, 1, d].
- KV write: `npu_scatter_nd_update_(cache, indices, updates)` on the cache viewed as
  [slots, kv_heads, d], indices the slots [T, 1].
- Attention: `npu_fused_infer_attention_score` with PageAttention. Our blocks
  [num_blocks, block_size, kv_heads, d] viewed as [num_blocks, block_size, kv_heads * d] are
  its "BnBsH" cache layout, so nothing is copied; queries are BSH, `block_table` int32
  [B, blocks], `actual_seq_lengths_kv` host ints. The decode rows are one call (Q_S = 1, its
  incremental branch); each prefill chunk is one call (Q_S > 1) with `sparse_mode` 3, the
  right-down causal mask a chunk after a cached prefix needs (its row i sees keys up to
  prefix + i), given as the 2048 x 2048 mask that mode takes (True: not attended).
  PageAttention with Q_S > 1 needs block sizes that are multiples of 128 up to 512
  (app/settings.py refuses others on npu).
Sliding-window layers (Gemma 3's) and steps without block tables take the SDPA path.
"""

from __future__ import annotations

import torch
import torch_npu

from pypto_serving.kernels.attention import AttentionMetadata, BlockTables
from pypto_serving.kernels.decoder_ops import DecoderOps, KVCache, Rotary, attend_sdpa

CAUSAL_MASK = 2048  # sparse_mode 2-4 take this optimised square mask, whatever the lengths
RIGHT_DOWN_CAUSAL = 3


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, total = torch_npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
    return y, total


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return torch_npu.npu_swiglu(x, dim=-1)


def qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)


def rotate(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] by r1, r2 [1, T, 1, d] -> [T, heads, d]."""
    return torch_npu.npu_rotary_mul(x.unsqueeze(0), r1, r2)[0]


def full_width(rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, d / 2] -> r1, r2 [1, T, 1, d]: both halves of a pair share an angle."""
    cos, sin = rotary
    return torch.cat([cos, cos], dim=-1).unsqueeze(0), torch.cat([sin, sin], dim=-1).unsqueeze(0)


def write_kv(kv: KVCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, kv_heads, d] into their slots [T]."""
    kv_heads, head_dim = kv[0].shape[2:]
    index = slots.unsqueeze(-1)
    for cache, x in zip(kv, (k, v), strict=True):
        torch_npu.npu_scatter_nd_update_(cache.view(-1, kv_heads, head_dim), index, x.to(cache.dtype))


class NpuAttention:
    """`Attend` (kernels/decoder_ops.py) through the fused paged attention; owns the causal mask."""

    def __init__(self, device: torch.device) -> None:
        self.mask = torch.ones(CAUSAL_MASK, CAUSAL_MASK, dtype=torch.bool, device=device).triu_(1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary, kv: KVCache,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.window or meta.tables is None:
            return attend_sdpa(q, k, v, rotary, kv, meta, scale)
        r1, r2 = full_width(rotary)
        q, k = rotate(q, r1, r2), rotate(k, r1, r2)
        write_kv(kv, k, v, meta.slot_mapping)
        return self.paged(q, kv, meta, meta.tables, scale)

    def paged(self, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata, tables: BlockTables,
              scale: float) -> torch.Tensor:
        """q [T, heads, d] (rotated; its k and v stored) -> [T, heads, d]."""
        if meta.all_decode:
            return self.decode(q, kv, tables, scale)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self.decode(q[meta.decode_rows], kv, tables, scale)
        for seg, table in zip(meta.prefills, tables.prefills, strict=True):
            out[seg.start : seg.end] = self.prefill(q[seg.start : seg.end], kv, table,
                                                    seg.ctx_slots.shape[0], scale)
        return out

    def decode(self, q: torch.Tensor, kv: KVCache, tables: BlockTables, scale: float) -> torch.Tensor:
        """One query per row: q [Bd, heads, d] -> [Bd, heads, d]."""
        return fused_attention(q.unsqueeze(1), kv, tables.decode, tables.decode_lens, scale).squeeze(1)

    def prefill(self, q: torch.Tensor, kv: KVCache, table: torch.Tensor, context: int,
                scale: float) -> torch.Tensor:
        """One chunk, the last q [n, heads, d] of its `context` positions -> [n, heads, d]."""
        return fused_attention(q.unsqueeze(0), kv, table, (context,), scale, actual_seq_lengths=[q.shape[0]],
                               sparse_mode=RIGHT_DOWN_CAUSAL, atten_mask=self.mask)[0]


def fused_attention(q: torch.Tensor, kv: KVCache, table: torch.Tensor, kv_lens: tuple[int, ...],
                    scale: float, **causal: object) -> torch.Tensor:
    """q [B, S, heads, d] over row b's first kv_lens[b] cached positions -> [B, S, heads, d]."""
    batch, rows, heads, head_dim = q.shape
    blocks, block_size, kv_heads, _ = kv[0].shape
    key, value = (c.view(blocks, block_size, kv_heads * head_dim) for c in kv)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q.reshape(batch, rows, heads * head_dim), key, value, block_table=table, block_size=block_size,
        actual_seq_lengths_kv=list(kv_lens), num_heads=heads, num_key_value_heads=kv_heads, scale=scale,
        input_layout="BSH", **causal)
    return out.view(batch, rows, heads, head_dim)


def npu_ops(device: torch.device) -> DecoderOps:
    return DecoderOps(rms_norm, add_rms_norm, silu_and_mul, NpuAttention(device), qk_norm)
