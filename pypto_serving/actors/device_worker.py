"""DeviceWorker: one OS process per device that runs the model.

Receives (over a pipe, msgpack-encoded msgspec Structs): `WorkerConfig` once at start,
then `StepPlan` per step, `StartProfile`/`StopProfile` around a profile, `Shutdown` at the end.
Sends: `WorkerReady` (handshake, after weights and KV cache are in place), then one
`StepResult` per `StepPlan` and one `ProfileStopped` per `StopProfile`, in order.
State owned: model weights, KV cache tensors, per-sequence sampler state, its profiler.
Invariant: knows nothing of queues, HTTP or scheduling policy; executes plans as given.
Signals: ignores SIGINT and SIGTERM (a terminal's Ctrl-C or `timeout` reach the whole process
group); the API process drains requests, then sends `Shutdown`; a closed pipe also ends it.
The main-process side (start, pipe, death detection) is actors/device_client.py.
"""

from __future__ import annotations

import gc
import signal

import msgspec
import structlog

from pypto_serving.loader.arch import ModelArch
from pypto_serving.logs import capture_stray_output, configure_logging
from pypto_serving.profiling import WorkerProfiler
from pypto_serving.sampling import SamplingParams

log = structlog.get_logger()


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
    quantization: str = "none"  # weight-only: "none" | "int8" | "int4" | "auto" (models/quant.py)
    activation_quantization: str = "none"  # "int8": the CPU's packed matmuls quantize their inputs
    tokenizer_json: str = ""  # HF tokenizers JSON for grammar masks; "" = no constrained decoding
    eos_token_id: int | None = None  # the EOS llguidance allows once a grammar is complete


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


class StartProfile(msgspec.Struct, frozen=True, tag=True):
    levels: list[str]  # e2e, kernel, verbose
    prefix: str  # fragment path prefix; the worker appends its own name


class StopProfile(msgspec.Struct, frozen=True, tag=True):
    pass


class ProfileStopped(msgspec.Struct, frozen=True, tag=True):
    paths: list[str]  # the fragments this worker wrote


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class StepResult(msgspec.Struct, frozen=True, tag=True):
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
    # what the matmuls really run: "c" (kernels/cpu, built on this machine) or "portable",
    # and "int8" only where the C kernels quantize the activations
    kernels: str = "portable"
    activation_quantization: str = "none"


class WorkerFailed(msgspec.Struct, frozen=True, tag=True):
    message: str


# -- the worker process ------------------------------------------------------------


def worker_main(conn: object, config: bytes) -> None:
    """Entry point of the device-worker process: handshake, then one reply per request."""
    cfg = msgspec.msgpack.decode(config, type=WorkerConfig)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    restore = capture_stray_output() if cfg.log_format == "json" else None
    configure_logging(cfg.log_format, cfg.log_level)
    try:
        _run(conn, cfg)
    except Exception:
        log.exception("device worker failed", device=cfg.device)
    finally:
        if restore is not None:
            restore()


def _run(conn: object, cfg: WorkerConfig) -> None:
    encoder = msgspec.msgpack.Encoder()
    try:
        runner = _build_runner(cfg)
    except Exception as exc:  # reported to the parent, which exits with the message
        conn.send_bytes(encoder.encode(WorkerFailed(f"{type(exc).__name__}: {exc}")))
        return
    # What loading made (modules, the model) lives as long as the process: out of the cyclic
    # collector's sight, a full collection during a step walks only what steps made (it took
    # ~3% of a prefill's time walking torch's and the model's objects). The price: a frozen
    # object that later becomes cyclic garbage is never freed; the runner keeps its model,
    # caches and kernels for the process's life, so only load-time leftovers could be.
    gc.collect()
    gc.freeze()
    conn.send_bytes(encoder.encode(
        WorkerReady(runner.num_blocks, runner.weight_bytes, runner.kv_cache_bytes, runner.kernels,
                    runner.activation_quantization)))
    _serve(conn, runner, encoder, WorkerProfiler(f"device-worker {cfg.device}", cfg.backend))


def _build_runner(cfg: WorkerConfig) -> object:
    from pypto_serving.worker.model_runner import ModelRunner  # torch only in this process

    return ModelRunner(cfg)


IDLE_AFTER_S = 1.0  # a worker this long without a step plan counts as idle


def _serve(conn: object, runner: object, encoder: msgspec.msgpack.Encoder,
           profiler: WorkerProfiler) -> None:
    decoder = msgspec.msgpack.Decoder(StepPlan | Shutdown | StartProfile | StopProfile)
    idle = True
    while True:
        try:
            if not idle and not conn.poll(IDLE_AFTER_S):
                runner.idle()  # no step for a while: hand back what the last ones kept
                idle = True
            msg = decoder.decode(conn.recv_bytes())
            idle = idle and not isinstance(msg, StepPlan)
        except (EOFError, OSError):  # the parent is gone: leave no orphan behind
            return
        match msg:
            case StepPlan():
                reply = _execute(runner, msg, profiler)
            case StartProfile(levels, prefix):
                profiler.start(levels, prefix)
                continue
            case StopProfile():
                reply = ProfileStopped(profiler.stop())
            case Shutdown():
                return
            case _:
                raise TypeError(f"device worker cannot handle {type(msg).__name__}")
        try:
            conn.send_bytes(encoder.encode(reply))
        except OSError:
            return


def _execute(runner: object, plan: StepPlan, profiler: WorkerProfiler) -> StepResult:
    tokens = sum(len(s.token_ids) for s in plan.seqs)
    try:
        with profiler.recorder.span("forward", "worker", step_id=plan.step_id,
                                    seqs=len(plan.seqs), tokens=tokens):
            return runner.execute(plan)
    except Exception as exc:
        log.exception("step failed", step_id=plan.step_id)
        return StepResult(plan.step_id, [], [], error=f"{type(exc).__name__}: {exc}")
