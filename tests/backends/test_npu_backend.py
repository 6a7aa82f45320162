"""The npu backend on torch_npu's fused operators, on the CPU: a stand-in `torch_npu`
(tests/backends/stand_in_torch_npu.py) checks each call against its documented shapes, dtypes
and layouts and computes with the portable kernels, and tiny random Llama and Qwen3
checkpoints run through ModelRunner on it as on the portable backend (prefill across pages,
a chunk after a cached prefix, a prefix-cache hit, mixed and decode steps). Then the flags:
`--npu-memory-utilization`, the npu page sizes and KV dtypes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pypto_serving.app.cli import build_parser
from pypto_serving.app.settings import FlagError, build_settings
from pypto_serving.backends import NpuBackend
from pypto_serving.kernels.decoder_ops import SDPA
from pypto_serving.parallel.group import COLLECTIVE_LIBRARIES
from pypto_serving.worker.model_runner import ModelRunner
from tests.backends import stand_in_torch_npu
from tests.worker.tiny_models import CHECKPOINTS, COMMON, Driver, worker_config

PAGE = 128  # the npu default, and the fused attention's smallest prefill page
LONG = dict(max_position_embeddings=512)  # room for contexts over several pages
PROMPT = [(7 * i + 3) % 256 for i in range(300)]


@pytest.fixture
def torch_npu(monkeypatch: pytest.MonkeyPatch) -> object:
    return stand_in_torch_npu.install(monkeypatch)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random Llama and Qwen3 (head_dim 32) with 512 positions, saved once."""
    paths = {}
    for name in ("llama", "qwen3"):
        prefix, extra = CHECKPOINTS[name]
        config = getattr(transformers, f"{prefix}Config")(**(COMMON | extra | LONG))
        torch.manual_seed(0)
        paths[name] = tmp_path_factory.mktemp(name)
        getattr(transformers, f"{prefix}ForCausalLM")(config).save_pretrained(paths[name])
    return paths


def runner(path: Path, backend: str) -> ModelRunner:
    return ModelRunner(worker_config(path, backend=backend, dtype="bfloat16", block_size=PAGE,
                                     max_model_len=512, max_num_batched_tokens=512, max_num_blocks=32,
                                     kv_cache_bytes=1 << 24, gpu_memory_utilization=0.5))


def steps_of_every_kind(d: Driver) -> list[torch.Tensor]:
    """The logits of every step's sampled rows, in order."""
    rows = []

    def run(*seqs: object) -> None:
        rows.append(d.step(list(seqs))[1])

    run(d.add(1, PROMPT, chunk=200))  # prefill over two pages, nothing sampled
    run(d.next(1, 100))  # the rest, after a 200-token cached prefix: into a third page
    run(d.next(1), d.add(2, PROMPT[:130], chunk=130))  # a decode row beside a prefill over two pages
    run(d.add(3, PROMPT[:140], chunk=12, shared_blocks=d.blocks[1][:1]))  # a prefix-cache hit
    for _ in range(4):
        run(d.next(1), d.next(2), d.next(3))  # decode rows of three lengths
    return rows


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_npu_backend_runs_a_model_as_the_portable_one_does(torch_npu, checkpoints, name) -> None:
    fast, slow = Driver(runner(checkpoints[name], "npu")), Driver(runner(checkpoints[name], "portable"))
    got, want = steps_of_every_kind(fast), steps_of_every_kind(slow)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)
    assert fast.tokens == slow.tokens
    calls = stand_in_torch_npu.calls
    layers, steps = 2, 8 + 1  # one more: the largest step, run to size the KV cache
    assert calls["fused_attention_prefill"] == layers * (1 + 4)  # each chunk of each step, per layer
    assert calls["fused_attention_decode"] == layers * 5  # each step with decode rows, per layer
    assert calls["npu_rotary_mul"] == 2 * layers * steps  # q and k
    assert calls["npu_scatter_nd_update_"] == 2 * layers * steps  # k and v
    assert calls["npu_swiglu"] == layers * steps
    assert calls["npu_add_rms_norm"] == (2 * layers) * steps  # the first layer's first norm has no add
    assert calls["npu_rms_norm"] == (1 + (2 * layers if name == "qwen3" else 0)) * steps  # + q/k norms


def test_the_npu_kv_cache_is_sized_from_the_memory_utilization(torch_npu, checkpoints) -> None:
    run = runner(checkpoints["llama"], "npu")
    assert run.budget.how.startswith("0.5 x 8.00 GiB = 4.00 GiB - weights")
    assert run.kv_caches[0][0].dtype == torch.bfloat16 and run.kv_caches[0][0].shape[1] == PAGE


def test_float32_on_npu_keeps_the_sdpa_ops(torch_npu) -> None:
    """The fused attention takes float16/bfloat16 queries only."""
    assert NpuBackend("cpu", torch.float32).decoder_ops(packed=False) is SDPA
    assert NpuBackend("cpu", torch.bfloat16).decoder_ops(packed=False).attend is not SDPA.attend


def worker(source: object, *flags: str) -> object:
    args = build_parser().parse_args(["--model", "smollm2", "--backend", "npu", *flags])
    return build_settings(args, source).engine.worker


def test_npu_defaults_bfloat16_blocks_of_128_tokens_and_hccl(torch_npu, smollm2_source) -> None:
    cfg = worker(smollm2_source)
    assert cfg.kv_cache.block_size == 128
    assert (cfg.device.dtype, cfg.device.kv_cache_dtype) == ("bfloat16", "bfloat16")
    assert cfg.device.device == "npu:0" and COLLECTIVE_LIBRARIES["npu"] == "hccl"


def test_npu_memory_utilization_is_the_gpu_flag(torch_npu, smollm2_source) -> None:
    assert worker(smollm2_source, "--npu-memory-utilization", "0.6").kv_cache.gpu_memory_utilization == 0.6
    assert worker(smollm2_source, "--gpu-memory-utilization", "0.7").kv_cache.gpu_memory_utilization == 0.7
    with pytest.raises(FlagError, match="--gpu-memory-utilization must be in"):
        worker(smollm2_source, "--npu-memory-utilization", "1.5")


@pytest.mark.parametrize("size", [16, 64, 200, 1024])
def test_npu_pages_the_fused_attention_cannot_take_are_refused(torch_npu, smollm2_source, size) -> None:
    with pytest.raises(FlagError, match=f"--block-size {size}: .*128, 256, 384, 512"):
        worker(smollm2_source, "--block-size", str(size))
    assert worker(smollm2_source, "--block-size", "256").kv_cache.block_size == 256


def test_npu_float32_kv_blocks_under_half_compute_are_refused(torch_npu, smollm2_source) -> None:
    with pytest.raises(FlagError, match="--kv-cache-dtype float32 with --dtype bfloat16"):
        worker(smollm2_source, "--kv-cache-dtype", "float32")
    assert worker(smollm2_source, "--kv-cache-dtype", "float16").device.kv_cache_dtype == "float16"
    assert worker(smollm2_source, "--dtype", "float32").device.kv_cache_dtype == "float32"  # the SDPA ops
