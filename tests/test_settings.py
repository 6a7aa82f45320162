"""How --activation-quantization resolves against the backend, dtype and weight packing."""

from __future__ import annotations

import pytest

from pypto_serving.app.cli import build_parser
from pypto_serving.app.settings import FlagError, build_settings


@pytest.fixture(scope="module")
def smollm2(smollm2_source):
    return smollm2_source


def worker(source, *flags: str):
    args = build_parser().parse_args(["--model", "smollm2", *flags])
    return build_settings(args, source).engine.worker


@pytest.mark.parametrize(("flags", "weights", "activations"), [
    ((), "auto", "mixed"),  # the CPU default: packed weights, int8 inputs (outlier groups wider)
    (("--activation-quantization", "none"), "auto", "none"),
    (("--quantization", "int8", "--activation-quantization", "int8"), "int8", "int8"),
    (("--quantization", "none"), "none", "none"),  # exact weights: exact activations
    (("--dtype", "float32"), "none", "none"),  # an explicit dtype asks for the exact path
])
def test_activation_quantization_follows_the_weights(smollm2, flags, weights, activations) -> None:
    cfg = worker(smollm2, *flags)
    assert (cfg.quant.weights, cfg.quant.activations) == (weights, activations)


def test_int8_activations_without_packed_weights_are_refused(smollm2) -> None:
    with pytest.raises(FlagError, match="--activation-quantization int8"):
        worker(smollm2, "--quantization", "none", "--activation-quantization", "int8")


def test_int16_activations_need_packed_weights_too(smollm2) -> None:
    assert worker(smollm2, "--activation-quantization", "int16").quant.activations == "int16"
    with pytest.raises(FlagError, match="--activation-quantization int16"):
        worker(smollm2, "--quantization", "none", "--activation-quantization", "int16")


@pytest.mark.parametrize(("c_kernels", "expected"), [(True, ("c", "int8")), (False, ("portable", "none"))])
def test_the_worker_reports_the_kernels_it_really_runs(monkeypatch, c_kernels, expected) -> None:
    import torch

    from pypto_serving.backends import CpuBackend
    from pypto_serving.kernels import cpu

    monkeypatch.setattr(cpu, "available", lambda: c_kernels)
    backend = CpuBackend("cpu", torch.float32)
    assert backend.kernels_used("auto", "int8") == expected
    assert backend.kernels_used("none", "none") == ("portable", "none")


@pytest.mark.parametrize("kernels", ["c", "portable"])
def test_the_startup_log_says_what_the_worker_runs(kernels) -> None:
    """Asked for int8 activations where the C kernels cannot run: the log says so."""
    import asyncio
    from types import SimpleNamespace

    from structlog.testing import capture_logs

    from pypto_serving.app.launch import _start_engine
    from pypto_serving.messages.worker import WorkerReady

    ready = WorkerReady(8, 1 << 20, 1 << 20, kernels, "int8" if kernels == "c" else "none")

    async def start() -> WorkerReady:
        return ready

    engine = SimpleNamespace(start=start, workers=[SimpleNamespace(process=SimpleNamespace(pid=7))],
                             config=SimpleNamespace(worker=SimpleNamespace(
                                 quant=SimpleNamespace(weights="auto", activations="int8"))))
    with capture_logs() as logs:
        asyncio.run(_start_engine(engine))
    loaded = next(e for e in logs if e["event"] == "model loaded")
    assert (loaded["kernels"], loaded["activation_quantization"]) == (kernels, ready.activation_quantization)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == (kernels == "portable")
    assert all("float32 activations" in e["event"] for e in warnings)


def test_dp_splits_the_devices_into_one_group_per_replica(smollm2) -> None:
    args = build_parser().parse_args(["--model", "smollm2", "--dp", "2", "--devices", "3,5"])
    settings = build_settings(args, smollm2)
    assert settings.device_groups == ((3,), (5,))
    replicas = [settings.replica(i).worker for i in range(2)]
    assert [w.parallel.devices for w in replicas] == [[3], [5]]
    assert [w.device.device for w in replicas] == ["cpu", "cpu"]  # ids are labels on the host
    assert replicas[0].kv_cache == replicas[1].kv_cache == settings.engine.worker.kv_cache
    default = build_settings(build_parser().parse_args(["--model", "smollm2", "--dp", "3"]), smollm2)
    assert default.device_groups == ((0,), (1,), (2,))
    with pytest.raises(FlagError, match="--dp x --tp is 2"):
        build_settings(build_parser().parse_args(["--model", "smollm2", "--dp", "2", "--device", "0"]),
                       smollm2)


def test_enforce_eager_reaches_the_worker(smollm2) -> None:
    assert worker(smollm2, "--enforce-eager").device.enforce_eager is True
    assert worker(smollm2).device.enforce_eager is False


def test_the_startup_log_says_whether_decode_steps_replay_graphs_and_how_the_kv_was_sized() -> None:
    from types import SimpleNamespace

    from structlog.testing import capture_logs

    from pypto_serving.app.launch import _kv_cache_summary, graphs_line
    from pypto_serving.messages.worker import WorkerReady

    assert graphs_line("cuda", False, [1, 2, 4]) == "on, decode batches of 1, 2, 4 (padded up to the next)"
    assert graphs_line("cuda", True, []) == "off (--enforce-eager)"
    assert graphs_line("cpu", False, []) == "off (backend cpu: every step eager)"
    assert graphs_line("cuda", False, []).startswith("off (tensor parallelism or a mixture of experts")
    ready = WorkerReady(100, 0, 3 << 29, kv_budget="0.9 x 80.00 GiB = ...", graph_sizes=[1, 2])
    worker_cfg = SimpleNamespace(kv_cache=SimpleNamespace(block_size=16),
                                 device=SimpleNamespace(enforce_eager=False))
    settings = SimpleNamespace(backend="cuda", engine=SimpleNamespace(worker=worker_cfg))
    with capture_logs() as logs:
        _kv_cache_summary(settings, SimpleNamespace(engines=[SimpleNamespace(ready=ready)]))
    assert [e["event"] for e in logs] == [
        "KV cache: 100 blocks of 16 tokens", "KV cache size: 1.50 GiB; budget 0.9 x 80.00 GiB = ...",
        "CUDA graphs: on, decode batches of 1, 2 (padded up to the next)"]


def test_an_nvidia_device_is_found_whatever_its_number(tmp_path) -> None:
    """A container given one GPU of eight may see /dev/nvidia5 alone (and always the control
    nodes, which are no device)."""
    from pypto_serving.app.settings import _nvidia_device

    for node in ("nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (tmp_path / node).touch()
    assert not _nvidia_device(tmp_path)
    (tmp_path / "nvidia5").touch()
    assert _nvidia_device(tmp_path)
