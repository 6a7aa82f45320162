"""Mixture-of-experts kernels: routing (softmax top-k) and the fused-MoE op, portable torch.

The fused-MoE op takes the step's tokens x [T, hidden], each token's top-k experts and their
weights, and one layer's `ExpertGroup`: a contiguous range of its experts (global ids
`first` .. `first + len - 1`). Tokens are grouped by expert, so each expert's weights are read
once per step, over just the tokens routed to it; each expert's output, scaled by the token's
routing weight, is added into the token's row. Experts outside the group contribute nothing:
with expert parallelism each rank holds one range and the caller sums the partial outputs.
The portable op here is the reference; the cpu backend's (kernels/cpu/moe.py) runs the same
sums in one C call over packed weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pypto_serving.kernels.quant_linear import PackedWeight

Expert = Callable[[torch.Tensor], torch.Tensor]  # one expert's whole MLP: [n, hidden] -> [n, hidden]


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)  # identity: kernels cache per group
class PackedExperts:
    """Every expert's packed linears, in the group's order, for the kernels that read them."""

    gate_up: tuple[PackedWeight, ...]  # [2 * inter, hidden] each: gate rows, then up rows
    down: tuple[PackedWeight, ...]  # [hidden, inter] each
    activations: str = "none"  # what the matmuls quantize their inputs to: none, int8, int16


class ExpertGroup(Protocol):
    """A contiguous range of one layer's experts (models/moe.py's `Experts`)."""

    first: int  # the global id of the group's first expert

    def __len__(self) -> int: ...

    def expert(self, index: int) -> Expert:
        """The MLP of the group's `index`-th expert (global id first + index)."""
        ...

    @property
    def packed(self) -> PackedExperts | None:
        """The packed weights where every expert's linears are packed, else None."""
        ...


FusedMoe = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertGroup], torch.Tensor]


def softmax_top_k(router_logits: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, experts] -> (weights [T, k] float32, expert ids [T, k] int64): the
    softmax over all experts (in float32) at the k largest, renormalized to sum to 1 if asked
    (Qwen2-MoE, Qwen3-MoE, and with renormalization Mixtral's top-k-then-softmax)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def group_by_expert(ids: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] global expert ids -> (routes [R], offsets [count + 1]): the flat indices
    (token * k + slot) of the routes into experts first .. first + count - 1, ordered by expert
    (and by token within one), and where each expert's routes start in them."""
    flat = ids.reshape(-1) - first
    inside = ((flat >= 0) & (flat < count)).nonzero().squeeze(-1)
    local = flat[inside]
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=count)
    offsets = torch.zeros(count + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return inside[order], offsets


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              experts: ExpertGroup) -> torch.Tensor:
    """Portable: x [T, hidden], weights / ids [T, k] -> the group's experts' weighted sum
    [T, hidden]; rows routed to no expert of the group are zeros."""
    out = torch.zeros_like(x)
    k = ids.shape[1]
    routes, offsets = group_by_expert(ids, experts.first, len(experts))
    bounds = offsets.tolist()
    flat_weights = weights.reshape(-1)
    for index in range(len(experts)):
        mine = routes[bounds[index]:bounds[index + 1]]
        if not len(mine):
            continue
        tokens = mine // k
        y = experts.expert(index)(x[tokens])
        out.index_add_(0, tokens, y * flat_weights[mine].to(y.dtype).unsqueeze(-1))
    return out

