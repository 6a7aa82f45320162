"""DeepSeek V4 (`DeepseekV4ForCausalLM`), over the same flattened varlen tokens and paged
blocks as llama.py, portable torch (what transformers' modeling_deepseek_v4.py computes).

What differs from Llama:
- **Hyper-connections.** The residual is `hc_mult` streams per token, [T, n, hidden]. Before
  each attention and MoE block a small float32 projection of the streams gives a collapse
  weight (the block's input), an expand weight (its output back onto the streams) and a
  stream mix, made doubly stochastic by Sinkhorn iterations. A last collapse (`hc_head`)
  precedes the final norm.
- **Attention.** One key head whose vector is also the value (K = V). The query goes through
  a low-rank bottleneck (`wq_a`, its norm, `wq_b`) and an unweighted per-head RMSNorm. The
  trailing `rope_dim` channels rotate, in interleaved pairs, and the output's rotate back.
  Each head has a learned sink logit in the softmax. The output projection is grouped
  (`wo_a`: block-diagonal over `o_groups`, then `wo_b`).
  Every layer attends to the last `sliding_window` tokens. "hca" layers also attend to every
  compressed entry: one per `hca_rate` tokens, a softmax-gated sum of the window's projections.
  "csa" layers compress every `csa_rate` tokens from two overlapping series (the previous
  window's first, this window's second), and a lightning indexer picks the `index_topk`
  entries each query attends to.
- **Mixture of experts** on every layer, with a shared expert. The router scores with
  sqrt(softplus) (or sigmoid/softmax). The first layers route by a fixed token-id table
  (`tid2eid`), the rest by the top k of score + bias. The weights are renormalized and
  scaled, and the experts' SwiGLU clamps its gate and up projections.

The compressed state lives in the same paged blocks as the keys (worker/kv_cache.py
`CompressedLayerCache`): each token's compressor projections sit at its slot, and the entry of
a window sits in the block of the window's last token, so that prefix caching, preemption
and freeing treat it as they treat the keys. An entry is computed in the step that computes
the window's last token, and its slot records which window it holds, checked on every read.

Module names follow the published checkpoints' (`attn.wq_a`, `ffn.experts.N.w1`, ...), under
`model.` as the other families'. The MTP head (`mtp.*`) is not loaded (transformers drops it
too). Tensor parallelism is refused (parallel/shapes.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pypto_serving.kernels.attention import AttentionMetadata
from pypto_serving.kernels.compressed_kv import CompressedLayerCache
from pypto_serving.kernels.moe import fused_moe
from pypto_serving.kernels.rotary import rope_cache, rope_inv_freq
from pypto_serving.loader.arch import DeepseekV4Shape, ModelArch
from pypto_serving.models.llama import CausalLM
from pypto_serving.models.quant import LayerFactory
from pypto_serving.parallel.sharding import SINGLE, TensorParallel

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, rope_dim / 2], the model dtype


class Norm(nn.Module):
    """RMSNorm with its weight kept in float32 (applied in float32, cast once at the end)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rotate(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """x [N, heads, d]: its trailing rope_dim channels rotated in interleaved pairs by
    cos/sin [N, rope_dim / 2] (in float32, cast back)."""
    cos, sin = (t.repeat_interleave(2, dim=-1).unsqueeze(1) for t in rotary)
    width = cos.shape[-1]
    keep, rope = x[..., :-width], x[..., -width:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([keep, (rope.float() * cos + turned.float() * sin).to(x.dtype)], dim=-1)


def rotary_of(table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
    """table [P, 2, rope_dim / 2] float32 -> the positions' cos, sin in `dtype`."""
    rows = table[positions]
    return rows[:, 0].to(dtype), rows[:, 1].to(dtype)


@dataclass(frozen=True, slots=True)
class SeqRows:
    """One sequence's share of a step: its rows and the slots of its whole context."""

    rows: slice
    ctx_slots: torch.Tensor  # [L] slots of positions 0 .. L - 1 (this step's rows are the last)

    @property
    def length(self) -> int:
        return self.ctx_slots.shape[0]

    @property
    def first(self) -> int:
        return self.length - (self.rows.stop - self.rows.start)


def step_sequences(meta: AttentionMetadata) -> list[SeqRows]:
    seqs = [SeqRows(slice(seg.start, seg.end), seg.ctx_slots) for seg in meta.prefills]
    if meta.decode_slots is not None:
        rows, lens = meta.decode_rows.tolist(), meta.decode_lens.tolist()
        seqs += [
            SeqRows(slice(r, r + 1), meta.decode_slots[i, :n])
            for i, (r, n) in enumerate(zip(rows, lens, strict=True))
        ]
    return seqs


@dataclass(frozen=True, slots=True)
class Step:
    """What every layer of one step shares."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    seqs: list[SeqRows]
    rotary: dict[str, Rotary]  # "main" (sliding layers), "compress" (csa/hca layers and entries)
    tables: dict[str, torch.Tensor]  # the same kinds' [P, 2, rope_dim / 2] cos/sin tables


class GroupedLinear(nn.Module):
    """Block-diagonal linear: group g of the input [..., groups, in] -> [..., groups, out]."""

    def __init__(self, in_per_group: int, out_total: int, groups: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_total, in_per_group))
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)  # [groups, in, out]
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


class Compressor(nn.Module):
    """One compressed series: each token's projections (kv and gate, `width` channels each)
    and, per window of `rate` tokens, their softmax-gated sum, normalized and rotated at the
    window's first position. `overlap`: the csa kind, whose projections are two series (the
    first half feeds the next window's entry, the second half this window's)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width))  # the gate's bias per window position
        self.norm = Norm(dim, eps)

    @property
    def inputs_width(self) -> int:
        return 2 * self.wkv.out_features

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> [T, inputs_width]: what a token stores (kv, then gate)."""
        return torch.cat([self.wkv(h), self.wgate(h)], dim=-1)

    def entries(
        self, inputs: torch.Tensor, previous: torch.Tensor | None, first: int, table: torch.Tensor
    ) -> torch.Tensor:
        """inputs [W, rate, inputs_width] of W consecutive windows (the first `first // rate`),
        `previous` [rate, inputs_width] the window before them (None: they start the sequence)
        -> their entries [W, dim]."""
        width = self.wkv.out_features
        kv, gate = inputs[..., :width], inputs[..., width:] + self.ape
        if self.overlap:
            d, count = self.dim, kv.shape[0]
            earlier_kv = kv.new_zeros(count, self.rate, d)
            earlier_gate = gate.new_full((count, self.rate, d), float("-inf"))  # weight 0 at the start
            earlier_kv[1:], earlier_gate[1:] = kv[:-1, :, :d], gate[:-1, :, :d]
            if previous is not None:
                earlier_kv[0] = previous[:, :d].to(kv.dtype)
                earlier_gate[0] = previous[:, width : width + d] + self.ape[:, :d]
            kv = torch.cat([earlier_kv, kv[..., d:]], dim=1)
            gate = torch.cat([earlier_gate, gate[..., d:]], dim=1)
        entry = self.norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        positions = torch.arange(kv.shape[0], device=kv.device) * self.rate + first
        return rotate(entry.unsqueeze(1), rotary_of(table, positions, entry.dtype)).squeeze(1)


class Indexer(nn.Module):
    """The lightning indexer of a csa layer: its own compressed keys (index_head_dim wide),
    queries from the attention's low-rank query, and per query the top `index_topk` entries
    by sum over heads of weight * relu(q . k)."""

    def __init__(self, arch: ModelArch, shape: DeepseekV4Shape) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = shape.index_heads, shape.index_head_dim, shape.index_topk
        self.wq_b = nn.Linear(shape.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(arch.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(arch.hidden_size, self.dim, shape.csa_rate, True, arch.rms_norm_eps)

    def scores(
        self, q_low: torch.Tensor, h: torch.Tensor, keys: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        """q_low [n, q_lora], h [n, hidden], keys [E, dim] -> [n, E] float32."""
        q = rotate(self.wq_b(q_low).view(-1, self.heads, self.dim), rotary)
        scores = torch.matmul(q.float().unsqueeze(0), keys.float().T.unsqueeze(0).unsqueeze(0))[
            0
        ]  # [n, heads, E]
        scores = F.relu(scores) * self.dim**-0.5
        weights = self.weights_proj(h).float() * self.heads**-0.5
        return (scores * weights.unsqueeze(-1)).sum(dim=1)

    def pick(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """scores [n, E], visible [n, E] (complete windows) -> [n, E] True at the entries a
        query attends to: its top k among the visible ones."""
        k = min(self.topk, scores.shape[1])
        top = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1).indices
        picked = torch.zeros_like(visible)
        picked.scatter_(1, top, True)
        return picked & visible


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, make: LayerFactory) -> None:
        super().__init__()
        shape = arch.deepseek_v4
        self.kind, self.rate = shape.attention[layer], shape.rate(layer)
        self.heads, self.head_dim, self.groups = arch.num_heads, arch.head_dim, shape.o_groups
        self.window, self.eps = arch.sliding_window, arch.rms_norm_eps
        self.wq_a = make.linear(arch.hidden_size, shape.q_lora_rank)
        self.q_norm = Norm(shape.q_lora_rank, arch.rms_norm_eps)
        self.wq_b = make.linear(shape.q_lora_rank, self.heads * self.head_dim)
        self.wkv = make.linear(arch.hidden_size, self.head_dim)
        self.norm = Norm(self.head_dim, arch.rms_norm_eps)
        self.wo_a = GroupedLinear(
            self.heads * self.head_dim // self.groups, self.groups * shape.o_lora_rank, self.groups
        )
        self.wo_b = make.linear(self.groups * shape.o_lora_rank, arch.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(self.heads))
        self.compressor = self.indexer = None
        if self.kind != "sliding":
            self.compressor = Compressor(
                arch.hidden_size, self.head_dim, self.rate, self.kind == "csa", arch.rms_norm_eps
            )
        if self.kind == "csa":
            self.indexer = Indexer(arch, shape)

    @property
    def rope_kind(self) -> str:
        return "main" if self.kind == "sliding" else "compress"

    def forward(self, h: torch.Tensor, step: Step, cache: CompressedLayerCache) -> torch.Tensor:
        tokens, rotary = h.shape[0], step.rotary[self.rope_kind]
        q_low = self.q_norm(self.wq_a(h))
        q = unweighted_rms_norm(self.wq_b(q_low).view(tokens, self.heads, self.head_dim), self.eps)
        q = rotate(q, rotary)
        kv = rotate(self.norm(self.wkv(h)).view(tokens, 1, self.head_dim), rotary)
        cache.kv.view(-1, self.head_dim).index_copy_(0, step.meta.slot_mapping, kv[:, 0].to(cache.kv.dtype))
        if self.compressor is not None:
            cache.store_inputs(
                step.meta.slot_mapping,
                self.compressor.project(h),
                self.indexer.compressor.project(h) if self.indexer else None,
            )
        out = torch.empty_like(q)
        for seq in step.seqs:
            out[seq.rows] = self._attend(q[seq.rows], seq, step, cache, q_low[seq.rows], h[seq.rows])
        out = rotate(out, (rotary[0], -rotary[1]))  # the values' rotation, undone at the query's position
        grouped = self.wo_a(out.reshape(tokens, self.groups, -1)).flatten(1)
        return self.wo_b(grouped)

    def _attend(
        self,
        q: torch.Tensor,
        seq: SeqRows,
        step: Step,
        cache: CompressedLayerCache,
        q_low: torch.Tensor,
        h: torch.Tensor,
    ) -> torch.Tensor:
        """One sequence's rows: q [n, heads, d] -> [n, heads, d]."""
        first, length = seq.first, seq.length
        oldest = max(0, first - self.window + 1)
        keys = cache.kv.view(-1, self.head_dim)[seq.ctx_slots[oldest:]].to(q.dtype)  # [K, d]
        query_pos = torch.arange(first, length, device=q.device).unsqueeze(1)
        key_pos = torch.arange(oldest, length, device=q.device)
        visible = (key_pos <= query_pos) & (key_pos > query_pos - self.window)
        if self.compressor is not None and length >= self.rate:
            self._compress(seq, step, cache)
            entries, index_keys = cache.entries_of(seq.ctx_slots)
            complete = torch.arange(entries.shape[0], device=q.device) < (query_pos + 1) // self.rate
            if self.indexer is not None:
                scores = self.indexer.scores(q_low, h, index_keys, _rows(step.rotary["compress"], seq))
                complete = self.indexer.pick(scores, complete)
            keys = torch.cat([keys, entries.to(q.dtype)])
            visible = torch.cat([visible, complete], dim=1)
        scores = torch.matmul(q.transpose(0, 1), keys.T) * self.head_dim**-0.5  # [heads, n, K]
        scores = scores.masked_fill(~visible, float("-inf"))
        sinks = self.attn_sink.view(-1, 1, 1).expand(-1, q.shape[0], 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(q.dtype)
        return torch.matmul(probs, keys).transpose(0, 1)

    def _compress(self, seq: SeqRows, step: Step, cache: CompressedLayerCache) -> None:
        """The entries of the windows this step completes (their last token is a row of it)."""
        done, now = seq.first // self.rate, seq.length // self.rate
        if now == done:
            return
        table = step.tables["compress"]
        for compressor, index in ((self.compressor, False), (self.indexer and self.indexer.compressor, True)):
            if compressor is None:
                continue
            inputs = cache.window_inputs(seq.ctx_slots, done, now, index)  # [W, rate, width]
            previous = None
            if compressor.overlap and done:
                previous = cache.window_inputs(seq.ctx_slots, done - 1, done, index)[0]
            entries = compressor.entries(inputs, previous, done * self.rate, table)
            cache.store_entries(seq.ctx_slots, done, entries, index)


def _rows(rotary: Rotary, seq: SeqRows) -> Rotary:
    return rotary[0][seq.rows], rotary[1][seq.rows]


class HyperConnection(nn.Module):
    """The collapse, expand and mix weights of one block from the n streams (float32)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        n = self.n = arch.deepseek_v4.hc_mult
        self.iters, self.hc_eps, self.eps = (
            arch.deepseek_v4.hc_sinkhorn_iters,
            arch.deepseek_v4.hc_eps,
            arch.rms_norm_eps,
        )
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * arch.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, hidden] -> (expand [T, n], mix [T, n, n], the block's input [T, hidden])."""
        n, tokens = self.n, streams.shape[0]
        mixes = F.linear(unweighted_rms_norm(streams.reshape(tokens, -1).float(), self.eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(tokens, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def merge(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The block's output expanded onto the streams, plus the streams mixed."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class ExpertMLP(nn.Module):
    """SwiGLU with its gate clamped above and its up projection clamped both ways."""

    def __init__(self, hidden: int, intermediate: int, limit: float, make: LayerFactory) -> None:
        super().__init__()
        self.gate_up_proj = make.linear(hidden, 2 * intermediate)
        self.down_proj = make.linear(intermediate, hidden)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit))


class Experts(nn.ModuleList):
    """A layer's routed experts as an `ExpertGroup` (kernels/moe.py). Never `packed`: the C
    fused-MoE op knows no clamp, so the portable op runs them (over their own linears)."""

    first = 0
    packed = None

    def expert(self, index: int) -> nn.Module:
        return self[index]


class Router(nn.Module):
    """Scores every expert; picks by token id (`hashed`) or by the top k of score + bias."""

    def __init__(self, arch: ModelArch, hashed: bool) -> None:
        super().__init__()
        shape = arch.deepseek_v4
        self.top_k, self.scoring, self.scaling = (
            arch.num_experts_per_tok,
            shape.scoring,
            shape.routed_scaling_factor,
        )
        self.weight = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(
                torch.zeros(arch.vocab_size, self.top_k, dtype=torch.int64), requires_grad=False
            )
        else:
            self.bias = nn.Parameter(torch.empty(arch.num_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k], expert ids [T, k])."""
        logits = F.linear(x, self.weight)
        scores = (
            F.softplus(logits).sqrt()
            if self.scoring == "sqrtsoftplus"
            else torch.sigmoid(logits)
            if self.scoring == "sigmoid"
            else logits.softmax(dim=-1)
        )
        if hasattr(self, "tid2eid"):
            ids = self.tid2eid[input_ids]
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, ids


class MoE(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, make: LayerFactory) -> None:
        super().__init__()
        shape = arch.deepseek_v4
        width, limit = arch.moe_intermediate_size, shape.swiglu_limit
        self.gate = Router(arch, layer in shape.hash_layers)
        self.experts = Experts(
            ExpertMLP(arch.hidden_size, width, limit, make) for _ in range(arch.num_experts)
        )
        self.shared_experts = (
            ExpertMLP(arch.hidden_size, arch.shared_expert_intermediate_size, limit, make)
            if arch.shared_expert_intermediate_size
            else None
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        out = fused_moe(x, weights, ids, self.experts)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, make: LayerFactory) -> None:
        super().__init__()
        self.attn = Attention(arch, layer, make)
        self.ffn = MoE(arch, layer, make)
        self.attn_norm = Norm(arch.hidden_size, arch.rms_norm_eps)
        self.ffn_norm = Norm(arch.hidden_size, arch.rms_norm_eps)
        self.hc_attn = HyperConnection(arch)
        self.hc_ffn = HyperConnection(arch)

    def forward(self, streams: torch.Tensor, step: Step, cache: CompressedLayerCache) -> torch.Tensor:
        post, comb, x = self.hc_attn(streams)
        streams = merge(streams, post, comb, self.attn(self.attn_norm(x), step, cache))
        post, comb, x = self.hc_ffn(streams)
        return merge(streams, post, comb, self.ffn(self.ffn_norm(x), step.input_ids))


class HyperHead(nn.Module):
    """The streams' last collapse, before the final norm."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        n = arch.deepseek_v4.hc_mult
        self.eps, self.hc_eps = arch.rms_norm_eps, arch.deepseek_v4.hc_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * arch.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class DeepseekV4Model(nn.Module):
    def __init__(self, arch: ModelArch, make: LayerFactory, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = make.embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, make.for_layer(i, arch.num_layers))
                                    for i in range(arch.num_layers))
        self.norm = Norm(arch.hidden_size, arch.rms_norm_eps)
        self.hc_head = HyperHead(arch)


# Kept in float32 whatever the model dtype, as transformers keeps them (`_keep_in_fp32_modules_strict`).
FLOAT32 = ("hc_attn", "hc_ffn", "hc_head", "attn_sink", "ape", "gate.bias", "q_norm", "norm.weight")
# Checkpoint names outside the layers -> ours (the published files name them so).
TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
EXPERT_LINEARS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class DeepseekV4ForCausalLM(CausalLM):
    def __init__(
        self, arch: ModelArch, make: LayerFactory | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(arch, make, tp, DeepseekV4Model)
        # [P, 2, rope_dim / 2] float32 cos/sin of each rotary kind, filled by `build_rotary`
        self.register_buffer("rope_compress", torch.empty(0), persistent=False)

    float32_parameters = FLOAT32

    def build_rotary(self, positions: int) -> None:
        """The sliding layers' table (`rope`) and the compressed layers' and entries' one."""
        shape, device = self.arch.deepseek_v4, self.rope.device
        main = rope_inv_freq(shape.rope_dim, self.arch.rope_theta, None)
        compress = rope_inv_freq(shape.rope_dim, shape.compress_rope_theta, shape.compress_rope_scaling)
        self.rope = rope_cache(main, positions).to(device)
        self.rope_compress = rope_cache(compress, positions).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[CompressedLayerCache],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        tables = {"main": self.rope, "compress": self.rope_compress}
        step = Step(
            input_ids,
            positions,
            meta,
            step_sequences(meta),
            {kind: rotary_of(t, positions, h.dtype) for kind, t in tables.items()},
            tables,
        )
        streams = h.unsqueeze(1).expand(-1, self.arch.deepseek_v4.hc_mult, -1).contiguous()
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            streams = layer(streams, step, cache)
        return self.model.norm(self.model.hc_head(streams))

    @staticmethod
    def checkpoint_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The published names (with or without `model.`) -> ours; the MTP head is skipped."""
        for name, tensor in weights:
            if name.startswith(("mtp.", "model.mtp.")):
                continue
            bare = name.removeprefix("model.")
            if bare in TOP_LEVEL:
                yield TOP_LEVEL[bare], tensor
                continue
            if bare == "embed_tokens.weight" or bare.startswith("hc_head."):
                yield f"model.{bare}", tensor
                continue
            parts = bare.split(".")
            if (
                len(parts) > 2
                and parts[-2] in EXPERT_LINEARS
                and ("experts" in parts or "shared_experts" in parts)
            ):
                parts[-2] = EXPERT_LINEARS[parts[-2]]
            if parts[0] == "layers" and parts[2].startswith("hc_"):  # hc_attn_fn -> hc_attn.fn
                kind, _, field = parts[2].rpartition("_")
                parts[2:3] = [kind, field]
            yield "model." + ".".join(parts) if parts[0] == "layers" else name, tensor
