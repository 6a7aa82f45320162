"""Starts the engine, then either serves HTTP or runs the offline `--prompt` batch."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

import structlog
from aiohttp import web

from pypto_serving.actors.device_worker import WorkerStartError
from pypto_serving.cli import FlagError
from pypto_serving.engine import Engine
from pypto_serving.http.server import Handlers, build_app
from pypto_serving.loader.errors import UnsupportedModel
from pypto_serving.logs import configure_logging
from pypto_serving.model_source import ModelSourceError, resolve_model
from pypto_serving.requests import Finished, GenerateRequest, TextDelta
from pypto_serving.sampling import SamplingParams
from pypto_serving.settings import ServerSettings, build_settings, check_flags
from pypto_serving.tokenizer.tokenizer import Tokenizer

log = structlog.get_logger()


def launch(args: argparse.Namespace) -> int:
    configure_logging(args.log_format, args.log_level)
    check_flags(args)  # fail on bad flags before touching the model
    try:
        source = resolve_model(args.model)
        settings = build_settings(args, source)
        tokenizer = (Tokenizer.from_gguf(source.path) if source.format == "gguf"
                     else Tokenizer.from_hf_dir(source.path))
    except (ModelSourceError, UnsupportedModel, ValueError) as exc:
        if isinstance(exc, FlagError):
            raise
        print(f"pypto-serving: error: {exc}", file=sys.stderr)
        return 2
    run = offline if args.prompt else serve
    try:
        return asyncio.run(run(settings, tokenizer, args))
    except WorkerStartError as exc:
        print(f"pypto-serving: error: the device worker could not start: {exc}", file=sys.stderr)
        return 1


async def _start_engine(settings: ServerSettings, tokenizer: Tokenizer) -> Engine:
    engine = Engine(settings.engine, tokenizer)
    t0 = time.monotonic()
    ready = await engine.start()
    log.info("model loaded", seconds=round(time.monotonic() - t0, 2),
             weights_mib=ready.weight_bytes >> 20, kv_cache_mib=ready.kv_cache_bytes >> 20)
    return engine


def _startup_summary(settings: ServerSettings, engine: Engine) -> None:
    cfg, sched = settings.engine, settings.engine.scheduler
    log.info(f"Serving on http://{settings.host}:{settings.port}")
    log.info(f"Model: {settings.served_name} ({cfg.worker.model_path}, {cfg.worker.arch.family}, "
             f"dtype {cfg.worker.dtype})")
    log.info(f"Platform: {settings.platform}, backend {settings.backend}, "
             f"device groups {[list(settings.devices)]}")
    log.info("Parallelism: replicas 1, dp 1, tp 1")
    log.info(f"Max running requests: {sched.max_num_seqs}; max model len: {sched.max_model_len}")
    log.info(f"Max scheduled tokens per step: {sched.max_num_batched_tokens}")
    log.info(f"Prefill chunk size: {sched.long_prefill_token_threshold}")
    log.info(f"Prefix cache: {'enabled' if cfg.cache.enable_prefix_caching else 'disabled'}")
    log.info(f"Chunked prefill: {'enabled' if sched.enable_chunked_prefill else 'disabled'}")
    log.info("Endpoints: GET /health, GET /v1/models, POST /v1/completions, "
             "POST /v1/chat/completions")
    log.info(f"KV cache: {engine.ready.num_blocks} blocks of {cfg.cache.block_size} tokens")


async def serve(settings: ServerSettings, tokenizer: Tokenizer, args: argparse.Namespace) -> int:
    engine = await _start_engine(settings, tokenizer)
    runner = web.AppRunner(build_app(Handlers(engine, settings.served_name, settings.defaults)),
                           handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.host, settings.port).start()
    except OSError as exc:
        print(f"pypto-serving: error: cannot listen on {settings.host}:{settings.port}: {exc}",
              file=sys.stderr)
        await engine.shutdown()
        return 1
    _startup_summary(settings, engine)
    log.info("Application startup complete")
    await _wait_for_signal()
    log.info("shutting down")
    await runner.cleanup()
    await engine.shutdown()
    return 0


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def offline(settings: ServerSettings, tokenizer: Tokenizer, args: argparse.Namespace) -> int:
    """Generates for every --prompt at once (continuously batched) and prints the results."""
    engine = await _start_engine(settings, tokenizer)
    defaults = settings.defaults
    sampling = SamplingParams(temperature=defaults.temperature, top_p=defaults.top_p,
                              top_k=defaults.top_k or 0, seed=defaults.seed)
    requests = [GenerateRequest(f"offline-{i}", prompt, defaults.max_new_tokens, sampling,
                                tuple(defaults.stop), ignore_eos=defaults.ignore_eos)
                for i, prompt in enumerate(args.prompt)]
    t0 = time.monotonic()
    results = await asyncio.gather(*(_run_one(engine, r) for r in requests))
    elapsed = time.monotonic() - t0
    await engine.shutdown()
    total = 0
    for i, (prompt, (text, ids, done)) in enumerate(zip(args.prompt, results, strict=True)):
        total += len(ids)
        print(f"[{i}] prompt: {prompt!r}\n    text: {text!r}\n    token_ids: {ids}\n"
              f"    finish_reason: {done.finish_reason}")
    print(f"generated {total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s")
    return 0


async def _run_one(engine: Engine, request: GenerateRequest) -> tuple[str, list[int], Finished]:
    text, ids = [], []
    async for event in engine.generate(request):
        match event:
            case TextDelta(delta, token_ids):
                text.append(delta)
                ids.extend(token_ids)
            case Finished():
                return "".join(text), ids, event
    raise RuntimeError("stream ended without Finished")
