"""Whether a model's shape splits over tensor-parallel ranks: plain arithmetic, which the API
process checks before any weight loads (it imports no torch)."""

from __future__ import annotations

from pypto_serving.loader.arch import ModelArch


def check_divisible(arch: ModelArch, size: int) -> str | None:
    """Why `arch` cannot be split over `size` ranks (None: it can)."""
    if size == 1:
        return None
    if arch.num_experts:  # the experts' split (or expert parallelism) is not built yet
        return "mixture-of-experts models run on one rank for now: use --tensor-parallel-size 1"
    if arch.num_heads % size:
        return f"the model's {arch.num_heads} attention heads do not divide over {size} ranks"
    kv = arch.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        return (f"the model's {kv} KV heads neither divide over {size} ranks nor replicate "
                f"evenly on them")
    if arch.intermediate_size % size:
        return f"the model's MLP width {arch.intermediate_size} does not divide over {size} ranks"
    return None
