"""One request's observation: its metric samples, its two log lines and its trace events.

The engine wraps every request's event stream in a `RequestObserver`, so request-level
numbers are taken in one place whatever the caller (HTTP or offline): arrival is when the
caller first asks `Engine.generate`'s stream for an event, the first token is the first
`TextDelta` that carries token ids, the end is `Finished` or, when the caller stops listening
first, the close of the stream (aborted).
"""

from __future__ import annotations

import time

import msgspec
import structlog

from pypto_serving.core.request import ChatInput, Finished, Started, TextDelta
from pypto_serving.telemetry.metrics import EngineMetrics, finish_label
from pypto_serving.telemetry.profiling import SpanRecorder

log = structlog.get_logger()


class RequestObserver:
    def __init__(self, request_id: str, metrics: EngineMetrics, recorder: SpanRecorder,
                 max_tokens_param: int | None = None, score_only: bool = False):
        """`max_tokens_param`: the request's max_tokens as the client gave it (None: not given);
        `score_only`: the request only scores its prompt, and the token it samples is no output."""
        self.request_id = request_id
        self.max_tokens_param = max_tokens_param
        self.score_only = score_only
        self.metrics = metrics
        self.recorder = recorder
        self.log = log.bind(request_id=request_id)
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.started = False
        self.finished = False
        self._content: tuple[object, int | None] | None = None  # (prompt, max_log_len)
        self._output: list[str] = []

    def log_content(self, prompt: object, max_len: int | None) -> None:
        """--log-requests: the prompt and the output go into the two log lines, cut to
        `max_len` characters (never logged otherwise)."""
        self._content = (prompt, max_len)

    def on_event(self, event: object) -> None:
        match event:
            case Started(prompt_tokens, max_tokens):
                self._started(prompt_tokens, max_tokens)
            case TextDelta(text, token_ids):
                if self._content is not None:
                    self._output.append(event.reasoning + text)
                if token_ids and not self.score_only:
                    self._tokens(len(token_ids))
            case Finished():
                self._finished(event.finish_reason, event.prompt_tokens,
                               0 if self.score_only else event.completion_tokens,
                               cached_tokens=event.cached_tokens, error=event.error)

    def close(self) -> None:
        """The stream was closed: a started request that did not finish was abandoned."""
        if self.started and not self.finished:
            self._finished("aborted", self.prompt_tokens, self.output_tokens)

    def _started(self, prompt_tokens: int, max_tokens: int) -> None:
        self.started = True
        self.prompt_tokens = prompt_tokens
        self.metrics.request_started(prompt_tokens)
        self.metrics.observe("request_max_num_generation_tokens", max_tokens)
        if self.max_tokens_param is not None:
            self.metrics.observe("request_params_max_tokens", self.max_tokens_param)
        fields = {} if self._content is None else {"prompt": self._cut(self._content[0])}
        self.log.info("request received", prompt_tokens=prompt_tokens, max_new_tokens=max_tokens, **fields)

    def _tokens(self, count: int) -> None:
        now = time.monotonic()
        # One inter-token sample between each two tokens, also for tokens that come together
        # (speculation, or a stream's tokens merged under load): those share the wait since
        # the stream's last tokens evenly; the ones that come with the first wait nothing.
        if self.first_token is None:
            self.first_token = now
            self.metrics.observe("ttft", now - self.arrival)
            gaps = (0.0,) * (count - 1)
        else:
            gaps = ((now - self.last_token) / count,) * count
        for gap in gaps:
            self.metrics.observe("itl", gap)
        self.last_token = now
        self.output_tokens += count
        self.metrics.tokens_generated(count)
        if self.recorder.verbose:
            self.recorder.instant("token", "request", request_id=self.request_id, count=count)

    def _finished(self, reason: str, prompt_tokens: int, output_tokens: int,
                  cached_tokens: int = 0, error: str | None = None) -> None:
        self.finished = True
        if output_tokens > self.output_tokens:  # tokens the stream did not show one by one
            self.metrics.tokens_generated(output_tokens - self.output_tokens)
        latency = time.monotonic() - self.arrival
        self.metrics.observe("e2e", latency)
        if self.first_token is not None and output_tokens > 1:
            self.metrics.observe("tpot", (self.last_token - self.first_token) / (output_tokens - 1))
        self.metrics.request_finished(reason, prompt_tokens, output_tokens)
        fields = {"error": error} if error else {}
        if self._content is not None:
            fields["output"] = self._cut("".join(self._output))
        self.log.info("request finished", prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                      cached_tokens=cached_tokens, reason=finish_label(reason),
                      latency_s=round(latency, 3),
                      ttft_s=None if self.first_token is None else round(self.first_token - self.arrival, 3),
                      tokens_per_s=round(output_tokens / latency, 1) if latency > 0 else 0.0, **fields)


    def _cut(self, value: object) -> str:
        """A prompt as a log line shows it: text as it is, a chat's messages as JSON (not the
        repr of the request's object); cut to --max-log-len."""
        if isinstance(value, ChatInput):
            text = msgspec.json.encode(value.messages).decode()
        else:
            text = value if isinstance(value, str) else repr(value)
        max_len = self._content[1]
        return text if max_len is None or len(text) <= max_len else text[:max_len] + "..."


class SequencePhases:
    """The scheduler's view of each sequence's phases (vLLM's prefill, decode and inference
    times): from its first scheduled step to its first token, to its end."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics
        self._first: dict[int, tuple[float, float | None]] = {}  # seq_id -> (scheduled, first token)

    def scheduled(self, seq_id: int, now: float) -> None:
        self._first.setdefault(seq_id, (now, None))

    def token(self, seq_id: int, now: float) -> None:
        scheduled, first = self._first.get(seq_id, (None, None))
        if scheduled is not None and first is None:
            self._first[seq_id] = (scheduled, now)
            self.metrics.observe("request_prefill_time", now - scheduled)

    def ended(self, seq_id: int, now: float, preemptions: int, computed_prompt_tokens: int) -> None:
        scheduled, first = self._first.pop(seq_id, (None, None))
        if scheduled is None:
            return
        self.metrics.observe("request_inference_time", now - scheduled)
        self.metrics.observe("request_decode_time", now - (first if first is not None else now))
        self.metrics.observe("request_num_preemptions", preemptions)
        self.metrics.observe("request_prefill_kv_computed_tokens", computed_prompt_tokens)
