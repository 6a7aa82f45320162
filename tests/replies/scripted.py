"""A served engine whose device worker writes a script instead of running a model.

Everything else is real: HTTP handlers, RequestStream (detokenizer, stop strings, reply
parsers), tokenizer, scheduler and KV allocator actors. The worker answers each step like a
device worker whose model's next token is the script's next token (then EOS), so a test can
make the "model" think, call tools or write malformed calls, and see what a client gets.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from aiohttp.test_utils import TestClient, TestServer

from pypto_serving.actors.engine import Engine
from pypto_serving.actors.replicas import ReplicaSet
from pypto_serving.app.cli import build_parser
from pypto_serving.app.model_source import resolve_model
from pypto_serving.app.settings import build_settings
from pypto_serving.http.server import Handlers, build_app
from pypto_serving.messages.worker import StepPlan, StepResult, WorkerConfig, WorkerReady
from pypto_serving.tokenizer.tokenizer import Tokenizer


class ScriptedWorker:
    """The device worker's client interface; `script` is read when a sequence starts."""

    script: list[int] = []
    fail_at: int | None = None  # the output index at which the "device" fails the step

    def __init__(self, cfg: WorkerConfig, on_result: Callable[[StepResult], None],
                 on_death: Callable[[str], None]):
        self.cfg = cfg
        self._on_result = on_result
        self._scripts: dict[int, tuple[list[int], int]] = {}  # seq id -> (script, prompt length)
        self.process = None

    async def start(self) -> WorkerReady:
        return WorkerReady(num_blocks=256, weight_bytes=0, kv_cache_bytes=0)

    def send(self, plan: StepPlan) -> None:
        for seq_id in plan.finished:
            self._scripts.pop(seq_id, None)
        seq_ids, tokens = [], []
        for s in plan.seqs:
            if s.reset and s.seq_id not in self._scripts:
                self._scripts[s.seq_id] = (list(self.script), s.num_prompt_tokens)
            if s.sample:
                script, prompt_len = self._scripts[s.seq_id]
                i = s.start_pos + len(s.token_ids) - prompt_len
                if self.fail_at is not None and i >= self.fail_at:
                    failed = StepResult(plan.step_id, [], [], error="scripted device failure")
                    asyncio.get_running_loop().call_soon(self._on_result, failed)
                    return
                seq_ids.append(s.seq_id)
                tokens.append(script[i] if i < len(script) else self.cfg.grammar.eos_token_id)
        asyncio.get_running_loop().call_soon(self._on_result, StepResult(plan.step_id, seq_ids, tokens))

    def kill(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class ScriptedServer:
    """An in-process server on `model` (a GGUF path or packaged name) with a scripted worker."""

    def __init__(self, model: str, *flags: str):
        args = build_parser().parse_args(["--model", model, "--max-model-len", "1024", *flags])
        source = resolve_model(args.model)
        self.settings = build_settings(args, source)
        self.tokenizer = _tokenizer(str(source.path))
        self.worker: type[ScriptedWorker] = type("Worker", (ScriptedWorker,), {"script": []})

    def say(self, text: str) -> None:
        """What the model writes next (then EOS), for every request from now on."""
        self.worker.script = self.tokenizer.encode(text, add_special_tokens=False)

    async def __aenter__(self) -> TestClient:
        self.engine = Engine(self.settings.engine, self.tokenizer, worker_factory=self.worker)
        await self.engine.start()
        replicas = ReplicaSet([self.engine])
        handlers = Handlers(replicas, "scripted", self.settings.defaults, self.settings.parsers)
        self.client = TestClient(TestServer(build_app(handlers)))
        await self.client.start_server()
        return self.client

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.engine.shutdown()


@functools.cache
def _tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path)
