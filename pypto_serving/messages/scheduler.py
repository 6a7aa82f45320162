"""What the SchedulerActor receives: from request streams (`Submit`, `Abort`), from the engine
(`WorkerDied`, `AbortAll`); `StepResult` comes over the worker's pipe (messages/worker.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.messages.mailbox import Mailbox
from pypto_serving.messages.worker import StepResult


@dataclass(frozen=True, slots=True)
class Submit:
    seq_id: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    reply_to: Mailbox


@dataclass(frozen=True, slots=True)
class Abort:
    seq_id: int
    reason: str  # "aborted" (client gone), "stop" (stop string), "error" (malformed tool call)


@dataclass(frozen=True, slots=True)
class WorkerDied:
    reason: str


@dataclass(frozen=True, slots=True)
class AbortAll:
    reason: str  # "aborted": the shutdown timeout ran out


# Everything the SchedulerActor receives (StepResult comes over the worker's pipe).
SchedulerInbox = Submit | Abort | WorkerDied | AbortAll | StepResult
