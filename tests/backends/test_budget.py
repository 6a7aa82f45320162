"""The KV cache's budget on an accelerator, and the line the startup log prints for it."""

from __future__ import annotations

import pytest

from pypto_serving.backends.budget import GIB, DeviceMemory, graph_reserve, host_budget


def test_the_device_budget_is_utilization_times_memory_less_what_else_lives_there() -> None:
    memory = DeviceMemory(total=80 * GIB, utilization=0.9, weights=GIB, activations=GIB // 2,
                          sampler=GIB // 4, graphs=GIB // 4)
    budget = memory.budget()
    assert budget.bytes == int(0.9 * 80 * GIB) - 2 * GIB
    assert budget.how == ("0.9 x 80.00 GiB = 72.00 GiB - weights 1.00 GiB - activations 512.0 MiB - "
                          "sampler 256.0 MiB - decode graphs 256.0 MiB = 70.00 GiB")


def test_without_graphs_the_line_does_not_mention_them() -> None:
    how = DeviceMemory(total=GIB, utilization=0.5, weights=0, activations=0, sampler=0).budget().how
    assert "graphs" not in how and how.endswith("= 512.0 MiB")


def test_a_budget_that_is_used_up_comes_out_negative() -> None:
    """num_kv_blocks then refuses to start, naming the budget (worker/kv_cache.py)."""
    assert DeviceMemory(total=GIB, utilization=0.5, weights=GIB, activations=0, sampler=0).budget().bytes < 0


def test_the_graphs_reserve_their_rows_share_of_the_step_and_their_inputs() -> None:
    assert graph_reserve(activations=4096 * 1000, step_tokens=4096, rows=256, width=1024) == \
        256 * 1000 + 8 * (256 * (4 + 1024) + 1024)
    assert graph_reserve(activations=10**9, step_tokens=4096, rows=0, width=1024) == 0


def test_on_the_host_the_budget_is_the_flags() -> None:
    budget = host_budget(GIB)
    assert budget.bytes == GIB and "1.00 GiB" in budget.how and "--kv-cache-memory" in budget.how


def test_a_share_that_other_processes_already_hold_is_refused_with_the_flag_to_lower() -> None:
    """0.9 of 80 GiB while another process holds 20 GiB: vLLM refuses too, rather than letting
    the KV cache's allocation fail later."""
    memory = DeviceMemory(total=80 * GIB, utilization=0.9, weights=GIB, activations=0, sampler=0,
                          elsewhere=20 * GIB)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.9 asks for 72.00 GiB of the device's "
                       r"80.00 GiB, but other processes hold 20.00 GiB of it; lower --gpu-memory-utilization "
                       r"to 0.74 or less"):
        memory.budget()
    assert DeviceMemory(total=80 * GIB, utilization=0.7, weights=GIB, activations=0, sampler=0,
                        elsewhere=20 * GIB).budget().bytes == int(0.7 * 80 * GIB) - GIB
