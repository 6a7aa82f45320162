"""Starts the engine (one per --dp replica), then either serves HTTP or runs the offline
`--prompt` batch."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from pathlib import Path

import structlog
from aiohttp import web

from pypto_serving.actors.device_client import WorkerStartError, drop_early_worker, start_early_worker
from pypto_serving.actors.engine import Engine
from pypto_serving.actors.replicas import ReplicaSet
from pypto_serving.app.model_source import ModelSource, ModelSourceError, resolve_model
from pypto_serving.app.node import run_node
from pypto_serving.app.settings import FlagError, ServerSettings, build_settings, check_flags
from pypto_serving.app.shutdown import ShutdownSignals, graceful_shutdown
from pypto_serving.core.request import ChatInput, Finished, GenerateRequest, TextDelta
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.http.edge import install_edge
from pypto_serving.http.ops import Ops
from pypto_serving.http.server import AppRunner, Handlers, build_app
from pypto_serving.loader.errors import UnsupportedModel
from pypto_serving.process.heap import release_freed_memory, serving_collector
from pypto_serving.telemetry.logs import configure_logging
from pypto_serving.telemetry.metrics import EngineMetrics
from pypto_serving.telemetry.profiling import Profiler, SpanRecorder
from pypto_serving.tokenizer.tokenizer import Tokenizer

log = structlog.get_logger()


def launch(args: argparse.Namespace) -> int:
    configure_logging(args.log_format, args.log_level)
    check_flags(args)  # fail on bad flags before touching the model
    if args.node_rank > 0:
        return _node(args)
    start_early_worker()  # loads torch while the model's settings and tokenizer are read
    try:
        return _serve_or_run(args)
    finally:
        drop_early_worker()  # startup failed before an engine took it


def _serve_or_run(args: argparse.Namespace) -> int:
    try:  # a port in use is found now, not after minutes of loading
        listening = None if args.prompt else listen(args.host, args.port)
    except OSError as exc:
        return _fail(args, f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", 2)
    log.info("starting", model=args.model, backend=args.backend or "auto")
    try:
        source = resolve_model(args.model)
        settings = build_settings(args, source)
        tokenizer = load_tokenizer(args, source)
    except (ModelSourceError, UnsupportedModel, ValueError) as exc:
        if isinstance(exc, FlagError):
            raise
        return _fail(args, str(exc), 2)
    # Big bodies and prompts come and go: their memory goes back to the OS when freed.
    release_freed_memory()
    try:
        if listening is None:
            return asyncio.run(offline(settings, tokenizer, args))
        return asyncio.run(serve(settings, tokenizer, args, listening))
    except WorkerStartError as exc:
        return _fail(args, f"the device worker could not start: {exc}", 1)
    except KeyboardInterrupt:  # Ctrl-C in offline mode (serve mode handles its signals)
        return 130


def _node(args: argparse.Namespace) -> int:
    """A node other than node 0: only the device workers of its ranks (app/node.py)."""
    try:
        source = resolve_model(args.model)
        settings = build_settings(args, source)
    except (ModelSourceError, UnsupportedModel, ValueError) as exc:
        if isinstance(exc, FlagError):
            raise
        return _fail(args, str(exc), 2)
    worker = settings.engine.worker
    code, error = run_node(worker.parallel, worker.log, str(source.path))
    return _fail(args, error, code) if error else code


def listen(host: str, port: int) -> list[socket.socket]:
    """The server's sockets, one per address `host` names (localhost: IPv4 and IPv6), bound
    before the model loads so a port in use is found at once. They listen only once the
    server starts: a client connecting during the load is refused, not left hanging."""
    sockets: list[socket.socket] = []
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def load_tokenizer(args: argparse.Namespace, source: ModelSource) -> Tokenizer:
    """The model's tokenizer, or `--tokenizer`'s; `--chat-template` replaces its template."""
    path, kind = source.path, source.format
    if args.tokenizer is not None:
        path = Path(args.tokenizer)
        if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
            raise FlagError(f"--tokenizer {args.tokenizer}: not an HF checkpoint directory or .gguf file")
        kind = "gguf" if path.is_file() else "hf"
    tokenizer = Tokenizer.from_gguf(path) if kind == "gguf" else Tokenizer.from_hf_dir(path)
    if args.chat_template is not None:
        tokenizer.use_chat_template(chat_template_text(args.chat_template))
    if args.trust_remote_code:
        log.info("--trust-remote-code is accepted and ignored: no code is loaded from checkpoints")
    return tokenizer


def chat_template_text(value: str) -> str:
    """A template file's text, or the value itself when it is a template (it has Jinja tags)."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{%" in value or "{{" in value:
        return value
    raise FlagError(f"--chat-template {value}: neither a file nor a Jinja template")


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    """One line: plain for a person, a JSON log line for a log pipeline."""
    if args.log_format == "json":
        log.error(message)
    else:
        print(f"pypto-serving: error: {message}", file=sys.stderr)
    return code


def _new_replicas(settings: ServerSettings, tokenizer: Tokenizer) -> ReplicaSet:
    """One engine per device group (--dp), sharing the tokenizer and the span recorder."""
    recorder = SpanRecorder("api-server")
    max_model_len = settings.engine.limits.max_model_len
    return ReplicaSet([Engine(settings.replica(i), tokenizer,
                              EngineMetrics(settings.served_name, max_model_len, engine=str(i)), recorder)
                       for i in range(len(settings.device_groups))])


async def _start_engine(engine: Engine, replica: int = 0) -> None:
    t0 = time.monotonic()
    ready = await engine.start()
    worker = engine.config.worker
    log.info("model loaded", seconds=round(time.monotonic() - t0, 2),
             weights_mib=ready.weight_bytes >> 20, kv_cache_mib=ready.kv_cache_bytes >> 20,
             quantization=worker.quant.weights, kernels=ready.kernels,
             activation_quantization=ready.activation_quantization, replica=replica,
             worker_pids=[w.process.pid for w in engine.workers])
    if worker.quant.activations != ready.activation_quantization:
        log.warning("the CPU's C kernels cannot run here (they need AVX2, FMA and F16C and a C "
                    "compiler): packed matmuls run the portable kernels with float32 activations",
                    requested_activation_quantization=worker.quant.activations)


def _profiler(settings: ServerSettings, replicas: ReplicaSet) -> Profiler | None:
    if settings.profile is None:
        return None
    return Profiler(settings.profile, replicas.recorder, lambda: replicas.workers)


def _startup_summary(settings: ServerSettings, replicas: ReplicaSet, endpoints: list[str]) -> None:
    cfg, sched = settings.engine, settings.engine.scheduler
    log.info(f"Serving on http://{settings.host}:{settings.port}", host=settings.host,
             port=settings.port)
    model = cfg.worker.model
    log.info(f"Model: {settings.served_name} ({model.path}, {model.arch.family}, "
             f"dtype {cfg.worker.device.dtype})")
    log.info(f"Platform: {settings.platform}, backend {settings.backend}, "
             f"device groups {[list(g) for g in settings.device_groups]}")
    parallel = cfg.worker.parallel
    dp, tp = len(settings.device_groups), parallel.tp
    nodes = f", {parallel.nnodes} nodes (master {parallel.master_addr}:{parallel.master_port})" \
        if parallel.nnodes > 1 else ""
    log.info(f"Parallelism: replicas {dp}, dp {dp}, tp {tp}{nodes}" +
             (" (scheduler limits, queue and KV cache per replica)" if dp > 1 else ""))
    log.info(f"Max running requests: {sched.max_num_seqs}{' per replica' if dp > 1 else ''}; "
             f"max model len: {sched.max_model_len}")
    log.info(f"Max scheduled tokens per step: {sched.max_num_batched_tokens}")
    log.info(f"Prefill chunk size: {sched.long_prefill_token_threshold}")
    log.info(f"Prefix cache: {'enabled' if cfg.cache.enable_prefix_caching else 'disabled'}")
    log.info(f"Chunked prefill: {'enabled' if sched.enable_chunked_prefill else 'disabled'}")
    log.info(f"Async scheduling: {'on' if sched.max_in_flight > 1 else 'off'}")
    spec = sched.speculative
    log.info("Speculative decoding: " + ("off" if spec is None else
             f"ngram, {spec.num_speculative_tokens} tokens, n-grams of {spec.prompt_lookup_min}.."
             f"{spec.prompt_lookup_max}" + (f", off from {spec.disable_by_batch_size} running"
                                            if spec.disable_by_batch_size else "")))
    reasoning = settings.parsers.reasoning
    log.info(f"Reasoning parser: {reasoning.name if reasoning else 'none'}; "
             f"tool-call parser: {settings.parsers.tool_parser_name}")
    log.info(f"Endpoints: {', '.join(endpoints)}")
    if settings.profile is not None:
        log.info(f"Profiling: levels {','.join(settings.profile.levels)}, "
                 f"output {settings.profile.output}")
    _kv_cache_summary(settings, replicas)
    log.info(f"Shutdown timeout: {settings.shutdown_timeout:g} s")
    admission, limits, edge = cfg.admission, settings.http, settings.edge
    log.info(f"Bounds: queue {admission.max_queue_len or 'unbounded'}, request timeout "
             f"{f'{admission.request_timeout:g} s' if admission.request_timeout else 'none'}, body "
             f"{limits.max_request_bytes} bytes; worker restart {'on' if cfg.restart_worker else 'off'}")
    log.info(f"Access: {len(edge.api_keys)} API key(s)"
             f"{', metrics need a key' if edge.metrics_require_auth else ''}; CORS "
             f"{', '.join(edge.allowed_origins) or 'off'}")


async def serve(settings: ServerSettings, tokenizer: Tokenizer, args: argparse.Namespace,
                listening: list[socket.socket]) -> int:
    replicas = _new_replicas(settings, tokenizer)
    signals = ShutdownSignals(on_force=replicas.kill)
    await replicas.start(lambda i, engine: _start_engine(engine, i))
    if signals.requested:  # asked to stop while the model was loading
        await replicas.shutdown()
        return 0
    handlers = Handlers(replicas, settings.served_name, settings.defaults, settings.parsers,
                        settings.responses_store_size)
    ops = Ops(replicas, _profiler(settings, replicas))
    app = build_app(handlers, settings.http)
    ops.install(app)
    install_edge(app, settings.edge, ops.http_metrics)
    runner = AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                       keepalive_timeout=settings.http.keepalive_timeout)
    await runner.setup()
    for sock in listening:
        await web.SockSite(runner, sock).start()
    endpoints = [f"{r.method} {r.path}" for r in handlers.routes()] + ops.endpoints()
    _startup_summary(settings, replicas, endpoints)
    log.info("Application startup complete")
    serving_collector()
    await signals.wait()
    await graceful_shutdown(replicas, ops, runner, settings.shutdown_timeout)
    return 0


async def offline(settings: ServerSettings, tokenizer: Tokenizer, args: argparse.Namespace) -> int:
    """Generates for every --prompt at once (continuously batched) and prints the results."""
    replicas = _new_replicas(settings, tokenizer)
    await replicas.start(lambda i, engine: _start_engine(engine, i))
    profiler = _profiler(settings, replicas)
    defaults = settings.defaults
    temperature = defaults.temperature if args.temperature is None else args.temperature
    sampling = SamplingParams(temperature=temperature, top_p=defaults.top_p,
                              top_k=defaults.top_k or 0, seed=defaults.seed)
    max_tokens = defaults.max_new_tokens if args.max_tokens is None else args.max_tokens
    requests = [GenerateRequest(f"offline-{i}", _offline_prompt(prompt, args.chat), max_tokens, sampling,
                                tuple(defaults.stop), ignore_eos=defaults.ignore_eos)
                for i, prompt in enumerate(args.prompt)]
    if profiler is not None:  # offline, the profile covers the whole batch
        profiler.start()
    t0 = time.monotonic()
    results = await asyncio.gather(*(_run_one(replicas, r) for r in requests))
    elapsed = time.monotonic() - t0
    if profiler is not None:
        await profiler.stop()
    await replicas.shutdown()
    total = 0
    for i, (prompt, (text, ids, done)) in enumerate(zip(args.prompt, results, strict=True)):
        total += len(ids)
        print(f"[{i}] prompt: {prompt!r}\n    text: {text!r}\n    token_ids: {ids}\n"
              f"    finish_reason: {done.finish_reason}")
    print(f"generated {total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s")
    return 0


def _offline_prompt(text: str, chat: bool) -> str | ChatInput:
    """`--chat`: the prompt as a user message, rendered with the chat template."""
    return ChatInput(({"role": "user", "content": text},), None, {}, True) if chat else text


async def _run_one(replicas: ReplicaSet, request: GenerateRequest) -> tuple[str, list[int], Finished]:
    text, ids = [], []
    async for event in replicas.generate(request):
        match event:
            case TextDelta(delta, token_ids):
                text.append(delta)
                ids.extend(token_ids)
            case Finished():
                return "".join(text), ids, event
    raise RuntimeError("stream ended without Finished")


def _kv_cache_summary(settings: ServerSettings, replicas: ReplicaSet) -> None:
    """The KV cache (blocks, bytes, how its budget was found) and the decode graphs."""
    blocks = [e.ready.num_blocks for e in replicas.engines]
    where = "".join(f", {n} on replica {i}" for i, n in enumerate(blocks) if i)
    where = f" on replica 0{where}" if len(blocks) > 1 else ""
    ready, worker = replicas.engines[0].ready, settings.engine.worker
    log.info(f"KV cache: {blocks[0]} blocks of {worker.kv_cache.block_size} tokens{where}")
    log.info(f"KV cache size: {ready.kv_cache_bytes / (1 << 30):.2f} GiB{' per replica' if where else ''}; "
             f"budget {ready.kv_budget or 'not reported'}")
    log.info(f"CUDA graphs: {graphs_line(settings.backend, worker.device.enforce_eager, ready.graph_sizes)}")


def graphs_line(backend: str, enforce_eager: bool, sizes: list[int]) -> str:
    """Whether decode steps replay captured graphs, and why not where they do not."""
    if sizes:
        return f"on, decode batches of {', '.join(map(str, sizes))} (padded up to the next)"
    if enforce_eager:
        return "off (--enforce-eager)"
    return "off (tensor parallelism or a mixture of experts: eager)" if backend == "cuda" else \
        f"off (backend {backend}: every step eager)"
