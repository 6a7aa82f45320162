"""The MoE kernels: softmax top-k routing, and the fused-MoE op (portable, and the cpu
backend's C op) against the definition: every route's expert output, weighted, summed."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.backends import CpuBackend
from pypto_serving.kernels import cpu
from pypto_serving.kernels.moe import ExpertGroup, fused_moe, group_by_expert, softmax_top_k
from pypto_serving.loader.arch import ModelArch
from pypto_serving.models.moe import Experts
from pypto_serving.models.quant import LayerFactory, QuantLinear, finish_loading

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 6, 2
ARCH = ModelArch("qwen3_moe", 256, HIDDEN, 128, 1, 4, 2, 16, 1e-6, 1e4, 128, False, False, True,
                 num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=INTER, moe_layers=(0,))
needs_c = pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")


def random_weights(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2 * INTER, HIDDEN, generator=g) * 0.2, torch.randn(HIDDEN, INTER, generator=g) * 0.2)
            for _ in range(EXPERTS)]


def make_experts(make: LayerFactory, weights: list[tuple[torch.Tensor, torch.Tensor]], first: int = 0,
                 count: int | None = None) -> Experts:
    """Experts first .. first + count - 1 of `weights`, as the model would hold them."""
    count = len(weights) - first if count is None else count
    group = Experts(ARCH, make, first, count)
    for mlp, pair in zip(group, weights[first:first + count], strict=True):
        for linear, w in zip((mlp.gate_up_proj, mlp.down_proj), pair, strict=True):
            if isinstance(linear, QuantLinear):
                linear.weight.load_rows(0, w)
            else:
                linear.weight.data.copy_(w)
    finish_loading(group)
    return group


def routed(tokens: int, seed: int = 1, skip: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, hidden] and a top-k routing that sends no token to expert `skip`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    logits = torch.randn(tokens, EXPERTS, generator=g)
    logits[:, skip] = -torch.inf
    weights, ids = softmax_top_k(logits, TOP_K, renormalize=True)
    return x, weights, ids


def by_definition(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  experts: ExpertGroup) -> torch.Tensor:
    """Every route on its own: no grouping by expert."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            if experts.first <= e < experts.first + len(experts):
                out[t] += w * experts.expert(e - experts.first)(x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_top_k_picks_the_largest_probabilities(renormalize: bool) -> None:
    logits = torch.randn(9, EXPERTS, generator=torch.Generator().manual_seed(0))
    weights, ids = softmax_top_k(logits, TOP_K, renormalize)
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(ids, probs.topk(TOP_K, dim=-1).indices)
    expected = probs.gather(1, ids)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    else:
        assert (weights.sum(-1) < 1).all()
    torch.testing.assert_close(weights, expected)
    assert weights.dtype == torch.float32


def test_group_by_expert_orders_routes_by_expert_within_the_range() -> None:
    ids = torch.tensor([[4, 1], [1, 2], [0, 4]])
    routes, offsets = group_by_expert(ids, first=1, count=3)  # experts 1, 2, 3
    assert routes.tolist() == [1, 2, 3] and offsets.tolist() == [0, 2, 3, 3]


@pytest.mark.parametrize("tokens", [1, 7])
def test_portable_fused_moe_is_the_weighted_sum_of_the_routes(tokens: int) -> None:
    experts = make_experts(LayerFactory(), random_weights())
    x, weights, ids = routed(tokens)
    with torch.no_grad():
        expected = by_definition(x, weights, ids, experts)
        torch.testing.assert_close(fused_moe(x, weights, ids, experts), expected, atol=1e-5, rtol=1e-5)


def test_expert_ranges_sum_to_the_whole_layer() -> None:
    """Room for expert parallelism: each rank's range gives a partial output; they add up."""
    weights_ = random_weights()
    x, weights, ids = routed(5)
    whole = fused_moe(x, weights, ids, make_experts(LayerFactory(), weights_))
    parts = [fused_moe(x, weights, ids, make_experts(LayerFactory(), weights_, first, 3)) for first in (0, 3)]
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-6, rtol=1e-6)


@needs_c
@pytest.mark.parametrize("tokens", [1, 3, 19])
def test_cpu_fused_moe_matches_portable_over_the_same_packed_weights(tokens: int) -> None:
    from pypto_serving.kernels.cpu.moe import fused_moe_cpu

    weights_ = random_weights()
    portable = make_experts(LayerFactory("int4"), weights_)
    fast = make_experts(CpuBackend("cpu", torch.float32).layers("int4"), weights_)
    assert fast.packed is not None
    x, weights, ids = routed(tokens)
    torch.testing.assert_close(fused_moe_cpu(x, weights, ids, fast), fused_moe(x, weights, ids, portable),
                               atol=1e-4, rtol=1e-4)


@needs_c
@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_cpu_fused_moe_with_quantized_activations_matches_the_per_expert_path(activations: str) -> None:
    """The C op runs the same C linears the per-expert Python path runs, in one call."""
    from pypto_serving.kernels.cpu.moe import fused_moe_cpu

    experts = make_experts(CpuBackend("cpu", torch.float32).layers("int4", activations), random_weights())
    assert experts.packed.activations == activations
    x, weights, ids = routed(11)
    torch.testing.assert_close(fused_moe_cpu(x, weights, ids, experts), fused_moe(x, weights, ids, experts),
                               atol=1e-5, rtol=1e-5)
    float_activations = fused_moe(x, weights, ids, make_experts(LayerFactory("int4"), random_weights()))
    torch.testing.assert_close(fused_moe_cpu(x, weights, ids, experts), float_activations,
                               atol=0.05, rtol=0.02)


@needs_c
def test_cpu_fused_moe_falls_back_to_portable_for_float_experts() -> None:
    from pypto_serving.kernels.cpu.moe import fused_moe_cpu

    experts = make_experts(LayerFactory(), random_weights())
    assert experts.packed is None
    x, weights, ids = routed(4)
    torch.testing.assert_close(fused_moe_cpu(x, weights, ids, experts), fused_moe(x, weights, ids, experts))
