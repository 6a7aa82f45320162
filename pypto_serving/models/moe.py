"""The mixture-of-experts MLP of a decoder layer (Qwen3-MoE; Qwen2-MoE's shared expert fits).

A router linear (`gate`) scores every expert for each token; the family's routing picks the
top k and their weights (kernels/moe.py `softmax_top_k`: softmax over all experts in float32,
renormalized when `norm_topk_prob`); the backend's fused-MoE op (`DecoderOps.fused_moe`) runs
the experts over the tokens routed to each; a shared expert, where the family has one, adds
its output to every token, scaled by a sigmoid gate of its own.

The router stays a plain linear in the model dtype whatever `--quantization` says: it is small,
and a rounding there can swap an expert, a far larger change than any linear's error.

Room for expert parallelism (not built): `Experts` holds a contiguous range of the layer's
experts, the fused-MoE op leaves every route outside it at zero, and the block sums its
output over the group (`tp.all_reduce`, the row-parallel down projection's collective), so
ranks that each hold a range add up to the whole layer.
"""

from __future__ import annotations

import torch
from torch import nn

from pypto_serving.kernels.moe import PackedExperts, softmax_top_k
from pypto_serving.loader.arch import ModelArch
from pypto_serving.models.quant import LayerFactory, QuantLinear
from pypto_serving.parallel.sharding import SINGLE, TensorParallel


class ExpertMLP(nn.Module):
    """One expert (or the shared one): SiLU-gated MLP with the fused gate_up_proj."""

    def __init__(self, hidden: int, intermediate: int, make: LayerFactory) -> None:
        super().__init__()
        self.gate_up_proj = make.linear(hidden, 2 * intermediate)
        self.down_proj = make.linear(intermediate, hidden)
        self.ops = make.decoder_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class Experts(nn.ModuleList):
    """Experts first .. first + count - 1 of one layer, named by their index in the range (an
    `ExpertGroup` for the fused-MoE op)."""

    def __init__(self, arch: ModelArch, make: LayerFactory, first: int = 0, count: int | None = None) -> None:
        count = arch.num_experts - first if count is None else count
        super().__init__(ExpertMLP(arch.hidden_size, arch.moe_intermediate_size, make) for _ in range(count))
        self.first = first
        self._packed: PackedExperts | None = None

    def expert(self, index: int) -> nn.Module:
        return self[index]

    @property
    def packed(self) -> PackedExperts | None:
        return self._packed

    def finish_loading(self) -> None:
        """Collects the packed weights (models/quant.py calls this once every linear is in)."""
        linears = [(e.gate_up_proj, e.down_proj) for e in self]
        if not all(isinstance(m, QuantLinear) for pair in linears for m in pair):
            self._packed = None
            return
        activations = {m.kernels.activations for pair in linears for m in pair}
        self._packed = PackedExperts(tuple(g.weight.packed for g, _ in linears),
                                     tuple(d.weight.packed for _, d in linears),
                                     activations.pop() if len(activations) == 1 else "none")


class SparseMoeBlock(nn.Module):
    def __init__(self, arch: ModelArch, make: LayerFactory, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.top_k, self.renormalize = arch.num_experts_per_tok, arch.norm_topk_prob
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = Experts(arch, make)
        self.ops = make.decoder_ops()
        self.shared_expert: ExpertMLP | None = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = ExpertMLP(arch.hidden_size, arch.shared_expert_intermediate_size, make)
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, ids = softmax_top_k(self.gate(x), self.top_k, self.renormalize)  # [T, k] each
        out = self.ops.fused_moe(x, weights, ids, self.experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)
