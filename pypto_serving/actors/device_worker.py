"""DeviceWorker: one OS process per device that runs the model.

Receives (over a pipe, msgpack-encoded msgspec Structs): `WorkerConfig` once at start,
then `StepPlan` per step, `Shutdown` at the end.
Sends: `WorkerReady` (handshake, after weights and KV cache are in place), then one
`StepResult` per `StepPlan`, in order.
State owned: model weights, KV cache tensors, per-sequence sampler state.
Invariant: knows nothing of queues, HTTP or scheduling policy; executes plans as given.
"""

from __future__ import annotations

import asyncio
import os
import time
import traceback
from collections.abc import Callable

import msgspec
import multiprocess

from pypto_serving.loader.arch import ModelArch
from pypto_serving.logs import configure_logging
from pypto_serving.sampling import SamplingParams


class WorkerConfig(msgspec.Struct, frozen=True):
    model_path: str  # HF checkpoint directory or .gguf file
    model_format: str  # "hf" or "gguf"
    arch: ModelArch
    dtype: str  # "float32" | "bfloat16" | "float16"
    kv_cache_dtype: str
    backend: str  # "cpu" | "cuda" | "npu"
    device: str  # torch device string, e.g. "cpu", "cuda:0"
    block_size: int
    max_num_blocks: int  # upper bound on KV blocks (enough for every running sequence)
    kv_cache_bytes: int  # memory budget for the KV cache on the CPU
    gpu_memory_utilization: float  # fraction of device memory for weights + KV on accelerators
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    log_format: str = "console"
    log_level: str = "info"


class ScheduledSeq(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's share of a step.

    `token_ids` are the tokens whose KV is computed this step, at positions
    `start_pos .. start_pos + len(token_ids) - 1`. With `reset` the worker (re)starts the
    sequence: `prefix_ids` are the tokens already in the KV cache (prefix-cache hits, so
    len(prefix_ids) == start_pos), `new_block_ids` is the whole block table, `sampling` is
    set, and `num_prompt_tokens` tells where generated tokens begin (after a preemption,
    tokens past the prompt are earlier outputs being recomputed). Without `reset`,
    `new_block_ids` are appended to the block table the worker already has. `sample` is
    true when the chunk ends at the last known token, so one new token is sampled after it.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    new_block_ids: list[int]
    sample: bool
    reset: bool = False
    prefix_ids: list[int] = []
    num_prompt_tokens: int = 0
    sampling: SamplingParams | None = None


class StepPlan(msgspec.Struct, frozen=True, tag=True):
    step_id: int
    seqs: list[ScheduledSeq]
    finished: list[int] = []  # sequence ids whose state the worker can drop


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class StepResult(msgspec.Struct, frozen=True):
    """Tokens sampled in one step: `token_ids[i]` belongs to `seq_ids[i]`.

    `seq_ids` lists exactly the scheduled sequences with `sample` true, in plan order.
    `logprobs[i]` is the chosen token's logprob, when its sequence asked for logprobs
    (else 0.0); `top_logprobs[i]` its top-k list (empty when not asked).
    """

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] = []
    top_logprobs: list[list[TopLogprob]] = []
    error: str | None = None


class WorkerReady(msgspec.Struct, frozen=True, tag=True):
    num_blocks: int
    weight_bytes: int
    kv_cache_bytes: int


class WorkerFailed(msgspec.Struct, frozen=True, tag=True):
    message: str


# -- the worker process ------------------------------------------------------------


def worker_main(conn: object, config: bytes) -> None:
    """Entry point of the device-worker process: handshake, then one result per plan."""
    encoder = msgspec.msgpack.Encoder()
    cfg = msgspec.msgpack.decode(config, type=WorkerConfig)
    configure_logging(cfg.log_format, cfg.log_level)
    try:
        runner = _build_runner(cfg)
    except Exception as exc:  # reported to the parent, which exits with the message
        conn.send_bytes(encoder.encode(WorkerFailed(f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(encoder.encode(
        WorkerReady(runner.num_blocks, runner.weight_bytes, runner.kv_cache_bytes)))
    _serve(conn, runner, encoder)


def _build_runner(cfg: WorkerConfig) -> object:
    from pypto_serving.worker.model_runner import ModelRunner  # torch only in this process

    return ModelRunner(cfg)


def _serve(conn: object, runner: object, encoder: msgspec.msgpack.Encoder) -> None:
    decoder = msgspec.msgpack.Decoder(StepPlan | Shutdown)
    while True:
        try:
            msg = decoder.decode(conn.recv_bytes())
        except EOFError:  # the parent is gone: leave no orphan behind
            return
        match msg:
            case StepPlan():
                conn.send_bytes(encoder.encode(_execute(runner, msg)))
            case Shutdown():
                return


def _execute(runner: object, plan: StepPlan) -> StepResult:
    try:
        return runner.execute(plan)
    except Exception as exc:
        traceback.print_exc()
        return StepResult(plan.step_id, [], [], error=f"{type(exc).__name__}: {exc}")


# -- the main-process side -----------------------------------------------------------


class WorkerStartError(RuntimeError):
    pass


class DeviceWorkerClient:
    """Starts one worker process and moves plans and results over its pipe.

    Results and the worker's death are reported through callbacks on the event loop.
    """

    def __init__(self, cfg: WorkerConfig, on_result: Callable[[StepResult], None],
                 on_death: Callable[[str], None]):
        self.cfg = cfg
        self._on_result = on_result
        self._on_death = on_death
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepResult)
        self._conn = None
        self.process = None
        self._stopping = False
        self._gone = False

    async def start(self) -> WorkerReady:
        ctx = multiprocess.get_context("spawn")
        self._conn, child = ctx.Pipe()
        config = self._encoder.encode(self.cfg)
        self.process = ctx.Process(target=worker_main, args=(child, config), daemon=True,
                                   name=f"device-worker-{self.cfg.device}")
        self.process.start()
        child.close()
        ready = await asyncio.get_running_loop().run_in_executor(None, self._handshake)
        loop = asyncio.get_running_loop()
        loop.add_reader(self._conn.fileno(), self._readable)
        loop.add_reader(self.process.sentinel, self._exited)
        return ready

    def _handshake(self) -> WorkerReady:
        try:
            data = self._conn.recv_bytes()
        except EOFError:
            raise WorkerStartError(f"device worker exited with code {self.process.exitcode} "
                                   "before it was ready") from None
        msg = msgspec.msgpack.decode(data, type=WorkerReady | WorkerFailed)
        if isinstance(msg, WorkerFailed):
            raise WorkerStartError(msg.message)
        return msg

    def send(self, plan: StepPlan) -> None:
        try:
            self._conn.send_bytes(self._encoder.encode(plan))
        except (BrokenPipeError, OSError) as exc:
            self._on_death(f"device worker pipe closed: {exc}")

    def _readable(self) -> None:
        try:
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            self._exited()
            return
        self._on_result(self._decoder.decode(data))

    def _exited(self) -> None:
        if self._gone:
            return
        self._gone = True
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._conn.fileno())
        loop.remove_reader(self.process.sentinel)
        if not self._stopping:
            self.process.join(0.1)
            self._on_death(f"device worker {self.cfg.device} died (exit code {self.process.exitcode})")

    async def stop(self, timeout: float = 5.0) -> None:
        """Asks the worker to exit, then makes sure it did."""
        self._stopping = True
        if self.process is None or not self.process.is_alive():
            return
        try:
            self._conn.send_bytes(self._encoder.encode(Shutdown()))
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        while self.process.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.process.is_alive():
            os.kill(self.process.pid, 9)
        self.process.join(1)
