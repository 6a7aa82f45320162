"""The KV cache's byte budget and the arithmetic behind it (the startup log prints it)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


def gib(n: int) -> str:
    """GiB with two decimals; MiB below 1 GiB (a host budget, a small graph pool)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True, slots=True)
class KVBudget:
    bytes: int
    how: str  # the arithmetic that gave `bytes`


def host_budget(host_bytes: int) -> KVBudget:
    """On the host the budget is given (`--kv-cache-memory`, split over the ranks)."""
    return KVBudget(host_bytes, f"{gib(host_bytes)} of host memory (--kv-cache-memory)")


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """An accelerator's memory as the KV budget sees it, in bytes."""

    total: int  # the device's memory
    utilization: float  # --gpu-memory-utilization: the share weights, steps and KV may use
    weights: int
    activations: int  # the largest step's peak, measured by running it
    sampler: int  # the sampler's copies of the logits
    graphs: int = 0  # the decode graphs' memory pool and static inputs (`graph_reserve`)
    elsewhere: int = 0  # what other processes (and the driver) hold on the device at start-up

    def budget(self) -> KVBudget:
        """The KV cache's share; refused where `utilization` x total is more than this process
        can have beside what others hold (as vLLM refuses), rather than failing an allocation."""
        usable = int(self.utilization * self.total)
        if usable + self.elsewhere > self.total:
            raise ValueError(
                f"--gpu-memory-utilization {self.utilization:g} asks for {gib(usable)} of the device's "
                f"{gib(self.total)}, but other processes hold {gib(self.elsewhere)} of it; lower "
                f"--gpu-memory-utilization to {max(0.0, 1 - self.elsewhere / self.total) - 0.005:.2f} or "
                "less, or free the device")
        kv = usable - self.weights - self.activations - self.sampler - self.graphs
        parts = [("weights", self.weights), ("activations", self.activations), ("sampler", self.sampler)]
        parts += [("decode graphs", self.graphs)] if self.graphs else []
        less = " - ".join(f"{name} {gib(n)}" for name, n in parts)
        return KVBudget(kv, f"{self.utilization:g} x {gib(self.total)} = {gib(usable)} - {less} = {gib(kv)}")


def graph_reserve(activations: int, step_tokens: int, rows: int, width: int) -> int:
    """What captured decode graphs keep for themselves (an estimate: they are captured after
    the KV cache is allocated): one memory pool holding the largest graph's activations, taken
    as the largest step's peak per token times its rows (a decode row's linears and norms are a
    prefill row's; its attention reads the cache in place), plus their static inputs (four
    int64 per row, `width` context slots per row, `width` mask columns)."""
    if not rows:
        return 0
    return -(-activations * rows // max(1, step_tokens)) + 8 * (rows * (4 + width) + width)
