"""The CPU worker's heap policy: while serving, glibc keeps a step's freed blocks for the next
step (no page faults), after loading it unmaps them; an idle worker hands its free heap back.
The fault counts use plain malloc/free: torch's 64-byte aligned blocks land where the heap's
history puts them (CI once saw them fault 3 steps in 5 where this machine saw none)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import msgspec
import pytest

from pypto_serving.messages.worker import Shutdown, StepPlan, StepResult
from pypto_serving.telemetry.profiling import WorkerProfiler
from pypto_serving.worker import main as device_worker

FAULTS = textwrap.dedent("""
    import ctypes, resource, sys
    from pypto_serving.process import heap
    getattr(heap, sys.argv[1])()
    libc = heap._glibc()
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def step():  # a block the size of a prefill step's activation: written, then freed
        block = libc.malloc(16 << 20)
        assert block
        ctypes.memset(block, 1, 16 << 20)
        libc.free(block)
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def page_faults_of_five_steps(policy: str) -> int:
    out = subprocess.run([sys.executable, "-c", FAULTS, policy], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def transparent_huge_pages() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


@pytest.mark.skipif(transparent_huge_pages() == "always",
                    reason="huge pages fault 2 MiB at a time: the page counts below assume 4 KiB")
def test_serving_reuses_freed_activations_where_loading_unmaps_them() -> None:
    assert page_faults_of_five_steps("release_freed_memory") > 5 * 4000  # 4096 pages each time
    assert page_faults_of_five_steps("reuse_freed_memory") < 500


class FakeConn:
    """The scheduler's end of the pipe: one plan, silence, then shutdown."""

    def __init__(self, messages: list[tuple[float, object]]) -> None:
        self.messages = messages  # (seconds before it arrives, message)
        self.sent: list[bytes] = []
        self._start = time.monotonic()

    def poll(self, timeout: float) -> bool:
        wait = self._start + self.messages[0][0] - time.monotonic()
        if wait > timeout:
            time.sleep(timeout)
            return False
        return True

    def recv_bytes(self) -> bytes:
        delay, msg = self.messages.pop(0)
        time.sleep(max(0.0, self._start + delay - time.monotonic()))
        return msgspec.msgpack.encode(msg)

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)


class Runner:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.calls.append("step")
        return StepResult(plan.step_id, [], [])

    def idle(self) -> None:
        self.calls.append("idle")


def test_an_idle_worker_trims_once_after_its_last_step(monkeypatch) -> None:
    monkeypatch.setattr(device_worker, "IDLE_AFTER_S", 0.05)
    conn = FakeConn([(0.0, StepPlan(1, [])), (0.01, StepPlan(2, [])), (0.4, Shutdown())])
    runner = Runner()
    device_worker._serve(conn, runner, msgspec.msgpack.Encoder(), WorkerProfiler("test", ("cpu",)))
    assert runner.calls == ["step", "step", "idle"]  # not before the first plan, not twice
    assert len(conn.sent) == 2


def test_a_token_in_the_cpu_kv_cache_costs_its_bytes_not_a_huge_page() -> None:
    """The cache is lazily zeroed: writing one token to every layer's k and v makes a few
    pages resident, not a 2 MiB transparent huge page per layer (numpy's calloc asked for
    those, and the first prompt made ~30 MiB of SmolLM2's cache resident)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import torch
        from pypto_serving.loader.arch import ModelArch
        from pypto_serving.backends.cpu import lazy_zeros
        from pypto_serving.worker.kv_cache import allocate_kv_cache
        def anon():  # resident anonymous and shared pages (not code pages torch faults in)
            status = open("/proc/self/status").read()
            return sum(int(status.split(f"{kind}:")[1].split()[0]) for kind in ("RssAnon", "RssShmem"))
        arch = ModelArch("llama", vocab_size=256, hidden_size=576, intermediate_size=1536,
                         num_layers=16, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=1e4, max_position_embeddings=1024, tie_word_embeddings=True,
                         attention_bias=False, qk_norm=False)
        caches = allocate_kv_cache(arch, 2048, 16, torch.float16, lazy_zeros)
        torch.zeros(64, dtype=torch.float16)[0].fill_(1.0)  # torch's first fill sets itself up
        before = anon()
        for k, v in caches:
            k[1024, 0].fill_(1.0)  # mid-cache: inside a 2 MiB-aligned range
            v[1024, 0].fill_(1.0)
        print(anon() - before, sum(t.sum().item() for kv in caches for t in kv))
    """)], capture_output=True, text=True, check=True)
    grown_kib, total = out.stdout.split()
    assert float(total) == 2 * 16 * 3 * 64  # the rest reads as zeros
    assert int(grown_kib) < 8192  # 32 tensors x a few KiB, not 32 x 2 MiB


def trims_in_five_steps(driver, monkeypatch, interval: float) -> list[int]:
    from pypto_serving.backends import cpu
    from pypto_serving.process import heap

    monkeypatch.setattr(cpu, "TRIM_INTERVAL_S", interval)
    d, _ = driver("llama", quantization="int4")
    trims = []
    monkeypatch.setattr(heap, "trim_freed_memory", lambda: trims.append(d.step_id))
    d.step([d.add(0, [5, 6, 7, 8, 9], 5)])  # prefill
    d.step([d.next(0)])  # decode: the prefill's heap goes back
    d.step([d.next(0)])  # decode again: nothing to give back
    d.step([d.next(0), d.add(1, [3, 4, 5], 3)])  # mixed: a prefill
    d.step([d.next(0), d.next(1)])
    return trims


def test_the_heap_is_trimmed_when_prefilling_gives_way_to_decoding(driver, monkeypatch) -> None:
    # during the second and the fifth step (step_id counts steps begun)
    assert trims_in_five_steps(driver, monkeypatch, interval=0.0) == [2, 5]


def test_heap_trims_are_spaced_out(driver, monkeypatch) -> None:
    """Steady arrivals switch between prefill and decode all the time: trimming at every
    switch would page-fault every prefill's activations afresh."""
    assert trims_in_five_steps(driver, monkeypatch, interval=60.0) == [2]


def test_what_loading_made_is_out_of_the_collectors_sight(monkeypatch) -> None:
    """Full collections during steps walk only what steps made, not the loaded model."""
    import gc
    from types import SimpleNamespace

    class Loaded(Runner):
        num_blocks, weight_bytes, kv_cache_bytes, kernels, activation_quantization = 1, 0, 0, "c", "none"
        budget, graph_sizes = SimpleNamespace(how="1.00 GiB"), []

    class Recording(FakeConn):
        def send_bytes(self, data: bytes) -> None:
            frozen.append(gc.get_freeze_count())
            super().send_bytes(data)

    frozen: list[int] = []
    monkeypatch.setattr(device_worker, "_build_runner", lambda cfg: Loaded())
    conn = Recording([(0.0, Shutdown())])
    try:
        device_worker._run(conn, SimpleNamespace(device=SimpleNamespace(device="cpu", backend="cpu"),
                                                 parallel=SimpleNamespace(tp=1)))
    finally:
        gc.unfreeze()
    assert msgspec.msgpack.decode(conn.sent[0])["type"] == "WorkerReady"
    assert frozen[0] > 1000  # frozen before the worker said it was ready: this process's objects
