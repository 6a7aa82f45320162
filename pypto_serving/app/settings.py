"""From parsed flags to the frozen per-component configs, validating as it goes."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pypto_serving.actors.engine import Admission, CacheConfig, EngineConfig
from pypto_serving.actors.request import RequestLimits
from pypto_serving.app.model_source import ModelSource
from pypto_serving.core.generate_config import GenerateConfigError, GenerateDefaults, parse_generate_config
from pypto_serving.core.scheduler import SchedulerConfig
from pypto_serving.core.speculative import SpeculativeConfig, parse_speculative_config
from pypto_serving.http.edge import EdgeConfig, load_api_keys
from pypto_serving.http.protocol import ModelParsers
from pypto_serving.http.server import HttpLimits
from pypto_serving.messages.worker import (
    ON_THE_HOST,
    ActivationQuantization,
    BackendName,
    DeviceConfig,
    DType,
    KVCacheConfig,
    LogConfig,
    LogFormat,
    ModelConfig,
    ModelFormat,
    ParallelConfig,
    QuantConfig,
    Quantization,
    StepLimits,
    WorkerConfig,
    device_string,
)
from pypto_serving.parallel.shapes import check_divisible
from pypto_serving.parsers import reasoning_parser_for, tool_parser_for, tool_parser_name
from pypto_serving.process.cache_dirs import cache_dir
from pypto_serving.telemetry.profiling import DEFAULT_LEVELS, ProfileConfig


class FlagError(ValueError):
    """A bad flag value: one line naming the flag, exit code 2."""


DEFAULT_CPU_KV_BYTES = 1 << 30
_BLOCK_SIZES = {"portable": 16, "cpu": 16, "cuda": 16, "npu": 128}
_DTYPES = {"portable": "float32", "cpu": "float32", "cuda": "bfloat16", "npu": "bfloat16"}
# torch_npu's paged fused attention (kernels/npu.py): pages of 128 to 512 tokens in steps of
# 128, float16 or bfloat16 blocks under float16/bfloat16 compute
_PAGE_SIZES = {"npu": (128, 256, 384, 512)}
_HALF_KV = ("npu",)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    engine: EngineConfig
    defaults: GenerateDefaults
    served_name: str
    backend: str
    platform: str
    device_groups: tuple[tuple[int, ...], ...]  # one per replica (--dp), tp device ids each
    host: str
    port: int
    profile: ProfileConfig | None = None
    shutdown_timeout: float = 30.0
    parsers: ModelParsers = ModelParsers()
    responses_store_size: int = 1000  # /v1/responses kept for previous_response_id
    http: HttpLimits = HttpLimits()
    edge: EdgeConfig = EdgeConfig()

    def replica(self, index: int) -> EngineConfig:
        """Replica `index`'s engine config: `engine` on that replica's device group."""
        return replica_config(self.engine, self.device_groups[index], self.backend, index)


def replica_config(engine: EngineConfig, group: tuple[int, ...], backend: str,
                   index: int = 0) -> EngineConfig:
    """A given --master-port is replica 0's; each later replica's group meets one port up."""
    worker = engine.worker
    device = msgspec.structs.replace(worker.device, device=device_string(backend, group[0]))
    port = worker.parallel.master_port and worker.parallel.master_port + index
    parallel = msgspec.structs.replace(worker.parallel, devices=list(group), master_port=port)  # tp stays
    return dataclasses.replace(engine, worker=msgspec.structs.replace(worker, device=device,
                                                                       parallel=parallel))


def _torch_has_cuda() -> bool:
    """Reads torch's build info (torch/version.py) without importing torch here."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    version = Path(spec.origin).parent / "version.py"
    lines = version.read_text().splitlines() if version.is_file() else []
    cuda = [line for line in lines if line.startswith("cuda")]
    return bool(cuda) and not cuda[0].rstrip().endswith("None")


def _nvidia_device(dev: Path = Path("/dev")) -> bool:
    """An NVIDIA device node, whichever number: a container given one GPU of eight may see
    /dev/nvidia5 alone."""
    return any(node.name.removeprefix("nvidia").isdigit() for node in dev.glob("nvidia*"))


def pick_backend(requested: str | None) -> str:
    has_npu = importlib.util.find_spec("torch_npu") is not None
    if requested == "npu" and not has_npu:
        raise FlagError("--backend npu needs torch_npu, which is not installed "
                        "(pip install torch-npu)")
    has_cuda = _torch_has_cuda() and _nvidia_device()
    if requested == "cuda" and not has_cuda:
        raise FlagError("--backend cuda needs a CUDA build of torch and an NVIDIA device; "
                        "neither was found (use --backend cpu)")
    if requested is not None:
        return requested
    return "cuda" if has_cuda else "npu" if has_npu else "cpu"


def _device_groups(args: argparse.Namespace) -> tuple[tuple[int, ...], ...]:
    """This node's --devices split into --dp groups of its share of --tp's ranks. Without
    --device(s), ids 0, 1, ..."""
    if args.device is not None and args.devices is not None:
        raise FlagError("--device and --devices: give only one of them")
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    per_node = tp // args.nnodes
    ids = tuple(args.devices or args.device or range(dp * per_node))
    if dp * per_node != len(ids):
        share = "" if args.nnodes == 1 else f" of this node's {per_node} rank(s) each"
        raise FlagError(f"--devices: {len(ids)} device(s) given but --dp x --tp is {dp * tp}{share}")
    return tuple(ids[i * per_node:(i + 1) * per_node] for i in range(dp))


DEFAULT_MASTER_PORT = 29500  # torchrun's, where the nodes must agree on one


def _check_nodes(args: argparse.Namespace) -> None:
    nnodes, rank, tp = args.nnodes, args.node_rank, args.tensor_parallel_size
    if not 0 <= rank < nnodes:
        raise FlagError(f"--node-rank {rank} is not one of the {nnodes} node(s) (0..{nnodes - 1})")
    if not 0 <= args.master_port < 65536:
        raise FlagError(f"--master-port must be in 0..65535, got {args.master_port}")
    if nnodes == 1:
        return
    if tp % nnodes:
        raise FlagError(f"--nnodes {nnodes}: --tensor-parallel-size {tp} does not split evenly "
                        "over the nodes")
    if args.data_parallel_size > 1:
        raise FlagError("--nnodes above 1 serves one replica spanning the nodes: --data-parallel-size 1")
    try:
        socket.getaddrinfo(args.master_addr, None)
    except OSError:
        raise FlagError(f"--master-addr {args.master_addr}: no such host") from None


def _parallel(args: argparse.Namespace, devices: tuple[int, ...]) -> ParallelConfig:
    port = args.master_port or (DEFAULT_MASTER_PORT if args.nnodes > 1 else 0)
    return ParallelConfig(args.tensor_parallel_size, list(devices), args.master_addr, port,
                          args.nnodes, args.node_rank, args.distributed_timeout or 120.0)


# --max-num-batched-tokens when not given. On a CPU a 512-row GEMM already runs at its peak,
# and steps that small let a wave's first prompts decode while the later ones prefill (c16
# 128/128 on SmolLM2: TTFT p50 4.7 s with 4096, see docs/performance.md); accelerators take
# bigger steps.
STEP_BUDGETS = {"portable": 512, "cpu": 512, "cuda": 4096, "npu": 4096}


def step_budget(args: argparse.Namespace, backend: str) -> int:
    """Tokens per step: the flag, else the backend's budget (at least --max-model-len without
    chunked prefill, where a prompt must fit one step)."""
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    budget = STEP_BUDGETS[backend]
    return budget if args.enable_chunked_prefill else max(budget, args.max_model_len)


def _scheduler(args: argparse.Namespace, backend: str) -> SchedulerConfig:
    budget = step_budget(args, backend)
    if not args.enable_chunked_prefill and budget < args.max_model_len:
        raise FlagError(f"--max-num-batched-tokens ({budget}) must be at "
                        f"least --max-model-len ({args.max_model_len}) without chunked prefill")
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_model_len=args.max_model_len,
        speculative=_speculative(args.speculative_config),
        async_scheduling=args.async_scheduling,
    )


def _speculative(text: str | None) -> SpeculativeConfig | None:
    if text is None:
        return None
    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise FlagError(str(exc)) from None


def _profile(args: argparse.Namespace) -> ProfileConfig | None:
    if not args.profile:
        given = [f for f, v in (("--profile-output", args.profile_output),
                                ("--profile-level", args.profile_level)) if v is not None]
        if given:
            raise FlagError(f"{' and '.join(given)} need --profile")
        return None
    output = Path(args.profile_output or "profile_out").absolute()
    check_writable_dir(output, "--profile-output")
    return ProfileConfig(str(output), tuple(args.profile_level or DEFAULT_LEVELS))


def check_writable_dir(path: Path, flag: str) -> None:
    """A directory this process can write, or can create: found out now, not after the load."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise FlagError(f"{flag} {path}: {existing} is not a directory")
    if existing is None or not os.access(existing, os.W_OK | os.X_OK):
        raise FlagError(f"{flag} {path}: {existing or path} is not writable")


def _quantization(args: argparse.Namespace, backend: str) -> str:
    """auto packs weights only where it pays and nothing asked for exact: cpu, --dtype auto."""
    if args.quantization != "auto":
        return args.quantization
    return "auto" if backend == "cpu" and args.dtype == "auto" else "none"


def _activation_quantization(args: argparse.Namespace, backend: str, dtype: str, quantization: str) -> str:
    """Quantized activations go with the CPU's packed float32 matmuls: auto picks mixed there
    (int8, with a second plane for each row's outlier groups)."""
    packed_cpu = backend == "cpu" and dtype == "float32" and quantization != "none"
    if args.activation_quantization == "auto":
        return "mixed" if packed_cpu else "none"
    if args.activation_quantization != "none" and not packed_cpu:
        raise FlagError(f"--activation-quantization {args.activation_quantization} needs packed weights "
                        "on the cpu backend (--backend cpu, --dtype auto or float32, --quantization "
                        "other than none)")
    return args.activation_quantization


def block_size_of(args: argparse.Namespace, backend: str) -> int:
    """--block-size, else the backend's; on npu one its fused attention's pages may be."""
    size = args.block_size or _BLOCK_SIZES[backend]
    allowed = _PAGE_SIZES.get(backend)
    if allowed and size not in allowed:
        raise FlagError(f"--block-size {size}: the {backend} backend's paged attention takes pages of "
                        f"{', '.join(map(str, allowed))} tokens")
    return size


def _check_kv_dtype(backend: str, dtype: str, kv_dtype: str) -> None:
    if backend in _HALF_KV and dtype != "float32" and kv_dtype == "float32":
        raise FlagError(f"--kv-cache-dtype float32 with --dtype {dtype}: the {backend} backend's fused "
                        "attention reads float16 or bfloat16 KV blocks (use --kv-cache-dtype auto)")


def _kv_dtype(args: argparse.Namespace, dtype: str, quantization: str) -> str:
    """Packed weights on the CPU keep the KV cache in float16 (half the memory and reads)."""
    if args.kv_cache_dtype != "auto":
        return args.kv_cache_dtype
    return "float16" if quantization != "none" and dtype == "float32" else dtype


def check_flags(args: argparse.Namespace) -> tuple[str, tuple[tuple[int, ...], ...], GenerateDefaults]:
    """Everything that can be checked before the model is looked at."""
    if not 0 < args.gpu_memory_utilization <= 1:
        raise FlagError("--gpu-memory-utilization must be in (0, 1]")
    if not 0 < args.port < 65536:
        raise FlagError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue_len is not None and args.max_queue_len < 0:
        raise FlagError(f"--max-queue-len must be 0 (no bound) or more, got {args.max_queue_len}")
    if args.max_request_bytes < 1:
        raise FlagError(f"--max-request-bytes must be at least 1 byte, got {args.max_request_bytes}")
    if args.metrics_require_auth and not args.api_key:
        raise FlagError("--metrics-require-auth needs --api-key")
    edge_config(args)  # an unreadable key file fails now
    if args.enable_auto_tool_choice and args.tool_call_parser == "none":
        raise FlagError("--enable-auto-tool-choice needs a tool-call parser: drop "
                        "--tool-call-parser none (the model family picks one)")
    try:
        defaults = parse_generate_config(args.generate_config)
    except GenerateConfigError as exc:
        raise FlagError(f"--generate-config: {exc}") from None
    backend = pick_backend(args.backend)
    block_size_of(args, backend)
    _check_nodes(args)
    _scheduler(args, backend)
    _profile(args)
    weight_cache_dir(args)
    return backend, _device_groups(args), defaults


def build_settings(args: argparse.Namespace, source: ModelSource) -> ServerSettings:
    backend, groups, defaults = check_flags(args)
    if args.max_model_len > source.arch.max_position_embeddings:
        raise FlagError(f"--max-model-len {args.max_model_len} exceeds the model's context "
                        f"length ({source.arch.max_position_embeddings})")
    reason = check_divisible(source.arch, args.tensor_parallel_size)
    if reason is not None:
        raise FlagError(f"--tensor-parallel-size {args.tensor_parallel_size}: {reason}")
    block_size = block_size_of(args, backend)
    worker = _worker(args, source, backend, groups[0], block_size)
    cache = CacheConfig(block_size, args.enable_prefix_caching)
    engine = EngineConfig(worker, _scheduler(args, backend), cache,
                          RequestLimits(args.max_model_len, defaults.max_new_tokens or args.max_model_len),
                          _admission(args), args.restart_worker, args.log_requests, args.max_log_len)
    return ServerSettings(engine, defaults, args.served_model_name or source.default_name, backend,
                          args.platform, groups, args.host, args.port, _profile(args),
                          args.shutdown_timeout, _parsers(args, source.arch.family),
                          args.responses_store_size, _http_limits(args), edge_config(args))


def _admission(args: argparse.Namespace) -> Admission:
    """--max-queue-len: 4 running batches' worth by default, 0 for no bound."""
    queue = 4 * args.max_num_seqs if args.max_queue_len is None else args.max_queue_len
    return Admission(queue or None, args.request_timeout or None)


def edge_config(args: argparse.Namespace) -> EdgeConfig:
    try:
        keys = load_api_keys(args.api_key or ())
    except ValueError as exc:
        raise FlagError(f"--api-key: {exc}") from None
    origins = _origins(args.allowed_origins)
    try:
        return EdgeConfig(keys, args.metrics_require_auth, origins)
    except ValueError as exc:
        flag = "--api-key" if "API key" in str(exc) else "--allowed-origins"
        raise FlagError(f"{flag}: {exc}") from None


def _origins(value: str | None) -> tuple[str, ...]:
    """A comma list, or vLLM's JSON list (`["*"]`, its default, means any origin there)."""
    if value is None:
        return ()
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise FlagError(f"--allowed-origins: not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise FlagError("--allowed-origins: a JSON list must hold strings")
        return tuple(items)
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _http_limits(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(args.max_request_bytes, args.request_body_timeout or None,
                      args.keep_alive_timeout)


def _worker(args: argparse.Namespace, source: ModelSource, backend: str, devices: tuple[int, ...],
            block_size: int) -> WorkerConfig:
    dtype = _DTYPES[backend] if args.dtype == "auto" else args.dtype
    quantization = _quantization(args, backend)
    kv_dtype = _kv_dtype(args, dtype, quantization)
    _check_kv_dtype(backend, dtype, kv_dtype)
    device = device_string(backend, devices[0])
    return WorkerConfig(
        model=ModelConfig(str(source.path), ModelFormat(source.format), source.arch),
        device=DeviceConfig(BackendName(backend), device, DType(dtype),
                            DType(kv_dtype), _threads(args, backend),
                            args.enforce_eager),
        kv_cache=KVCacheConfig(block_size, _max_blocks(args, block_size),
                               args.kv_cache_memory or DEFAULT_CPU_KV_BYTES, args.gpu_memory_utilization),
        limits=StepLimits(args.max_num_seqs, args.max_model_len, step_budget(args, backend)),
        quant=QuantConfig(Quantization(quantization), ActivationQuantization(
            _activation_quantization(args, backend, dtype, quantization))),
        log=LogConfig(LogFormat(args.log_format), args.log_level),
        seed=args.seed,
        weight_cache_dir=weight_cache_dir(args),
        parallel=_parallel(args, devices),
    )


def _threads(args: argparse.Namespace, backend: str) -> int:
    """Several workers on this host's CPU (--dp replicas, --tp ranks) share its cores evenly,
    rather than each starting a thread per core (0: one worker, torch's default)."""
    workers = args.data_parallel_size * args.tensor_parallel_size // args.nnodes
    if backend not in ON_THE_HOST or workers == 1:
        return 0
    return max(1, len(os.sched_getaffinity(0)) // workers)


def weight_cache_dir(args: argparse.Namespace) -> str:
    """The weight cache's directory ("" with --no-weight-cache); one given explicitly must be
    writable (the default one may not be: the worker then logs it and loads uncached)."""
    if args.no_weight_cache:
        if args.weight_cache_dir is not None:
            raise FlagError("--weight-cache-dir and --no-weight-cache: give only one of them")
        return ""
    if args.weight_cache_dir is None:
        return str(cache_dir("weights"))
    if not args.weight_cache_dir:
        raise FlagError("--weight-cache-dir: give a directory (--no-weight-cache turns the cache off)")
    path = Path(args.weight_cache_dir).expanduser().absolute()
    check_writable_dir(path, "--weight-cache-dir")
    return str(path)


def _max_blocks(args: argparse.Namespace, block_size: int) -> int:
    """Enough KV blocks for every running sequence at full length, twice over."""
    return 2 * args.max_num_seqs * math.ceil(args.max_model_len / block_size)


def _parsers(args: argparse.Namespace, family: str) -> ModelParsers:
    return ModelParsers(reasoning_parser_for(family, args.reasoning_parser),
                        tool_parser_for(family, args.tool_call_parser),
                        tool_parser_name(family, args.tool_call_parser),
                        args.exclude_tools_when_tool_choice_none)
