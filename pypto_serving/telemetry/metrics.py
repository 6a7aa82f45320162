"""Engine metrics: one set of numbers, rendered as Prometheus text or as the JSON snapshot.

Request counters and histograms are pushed by the engine's request wrapper (observe.py) and
the scheduler actor (queue time). Gauges and the scheduler/allocator counters are read from
the pure `Scheduler` and `BlockAllocator` at scrape time, so they are exact and cost the
engine step nothing. Everything runs on the event loop thread, so a scrape never sees a
half-applied step. The Prometheus text carries every metric twice: under `pypto:` and under
vLLM's `vllm:` names for existing dashboards.
"""

from __future__ import annotations

import bisect
import copy
import math
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from pypto_serving.core.block_allocator import BlockAllocator
from pypto_serving.core.scheduler import Scheduler, SpecDecodeStats

PREFIXES = ("pypto:", "vllm:")
LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "tool_calls", "aborted", "error")
# why requests were turned away or cut off by the server's bounds (not bad input: see the
# http metrics for 400s): a full queue (503), --request-timeout, --max-request-bytes (413)
REJECTION_REASONS = ("queue_full", "timeout", "body_too_large")

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_PER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
              10.0, 20.0, 40.0, 80.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
_PARAMS_N = (1.0, 2.0, 5.0, 10.0, 20.0)
_PREEMPTIONS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
# finished_reason under vLLM's names: its values (tool calls end with "stop" there)
VLLM_FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop", "aborted": "abort",
               "error": "error"}
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# JSON key -> (Prometheus name without prefix, help text)
GAUGES = {
    "running": ("num_requests_running", "Requests in the running batch."),
    "waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)."),
}
COUNTERS = {
    "prompt_tokens": ("prompt_tokens_total", "Prompt tokens of requests."),
    "prefill_tokens": ("prefill_tokens_total", "Prompt tokens computed (prefix-cache hits excluded)."),
    "generation_tokens": ("generation_tokens_total", "Generated tokens."),
    "prefix_cache_queries": ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
    "preemptions": ("num_preemptions_total", "Sequences preempted for lack of KV blocks."),
    "prompt_tokens_cached": ("prompt_tokens_cached_total", "Prompt tokens served from the prefix cache."),
}
SPEC_DECODE = {
    "num_drafts": ("spec_decode_num_drafts_total", "Decode steps of a sequence that carried proposals."),
    "num_draft_tokens": ("spec_decode_num_draft_tokens_total", "Tokens proposed."),
    "num_accepted_tokens": ("spec_decode_num_accepted_tokens_total", "Proposed tokens kept."),
}
HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Arrival to first generated token."),
    "itl": ("inter_token_latency_seconds", "Time between consecutive generated tokens."),
    "tpot": ("request_time_per_output_token_seconds", "Decode time per output token after the first."),
    "e2e": ("e2e_request_latency_seconds", "Arrival to finish."),
    "queue_time": ("request_queue_time_seconds", "Submission to first scheduled step."),
    "request_prompt_tokens": ("request_prompt_tokens", "Prompt tokens per request."),
    "request_generation_tokens": ("request_generation_tokens", "Generated tokens per request."),
    "iteration_tokens": ("iteration_tokens_total", "Tokens per engine step."),
    "request_max_num_generation_tokens": ("request_max_num_generation_tokens",
                                          "Tokens a request may generate (max_tokens, capped)."),
    "request_params_n": ("request_params_n", "The n request parameter."),
    "request_params_max_tokens": ("request_params_max_tokens", "max_tokens a request runs with, when set."),
    "request_inference_time": ("request_inference_time_seconds", "First scheduled step to finish."),
    "request_prefill_time": ("request_prefill_time_seconds", "First scheduled step to first token."),
    "request_decode_time": ("request_decode_time_seconds", "First token to finish."),
    "request_num_preemptions": ("request_num_preemptions", "Times a request was preempted."),
    "request_prefill_kv_computed_tokens": ("request_prefill_kv_computed_tokens",
                                           "Prompt tokens computed (not from the prefix cache) per request."),
}


def token_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_len` (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(buckets)
            buckets.append(float(m * scale))
        scale *= 10


def finish_label(reason: str) -> str:
    """The engine says `eos`; HTTP and metrics say `stop`."""
    return "stop" if reason == "eos" else reason


class Histogram:
    """Cumulative-bucket histogram; the last bound is +Inf."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = (*bounds, math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        total, out = 0, []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


class EngineMetrics:
    """The numbers of one replica (`engine` label), owned by the Engine."""

    def __init__(self, model_name: str, max_model_len: int = 1024, engine: str = "0"):
        self.model_name = model_name
        self.engine = engine
        self.server_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finish_reasons = dict.fromkeys(FINISH_REASONS, 0)
        self.rejections = dict.fromkeys(REJECTION_REASONS, 0)
        self.worker_restarts = 0
        tokens = token_buckets(max_model_len)
        bounds = {"ttft": _LATENCY, "itl": _PER_TOKEN, "tpot": _PER_TOKEN, "e2e": _REQUEST,
                  "queue_time": _REQUEST, "request_prompt_tokens": tokens,
                  "request_generation_tokens": tokens, "iteration_tokens": _ITERATION,
                  "request_max_num_generation_tokens": tokens, "request_params_n": _PARAMS_N,
                  "request_params_max_tokens": tokens, "request_inference_time": _REQUEST,
                  "request_prefill_time": _REQUEST, "request_decode_time": _REQUEST,
                  "request_num_preemptions": _PREEMPTIONS, "request_prefill_kv_computed_tokens": tokens}
        self.cache_info: dict[str, str] = {}  # the KV cache's settings (cache_config_info)
        self.histograms = {key: Histogram(bounds[key]) for key in HISTOGRAMS}
        self._scheduler: Scheduler | None = None
        self._allocator: BlockAllocator | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def bind(self, scheduler: Scheduler, allocator: BlockAllocator) -> None:
        """The live sources of gauges and step counters, read at scrape time."""
        self._scheduler, self._allocator = scheduler, allocator

    # -- hooks -----------------------------------------------------------------
    def request_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens

    def tokens_generated(self, count: int) -> None:
        self.generation_tokens += count

    def observe(self, histogram: str, value: float) -> None:
        self.histograms[histogram].observe(value)

    def request_finished(self, reason: str, prompt_tokens: int, output_tokens: int) -> None:
        label = finish_label(reason)
        self.finish_reasons[label] = self.finish_reasons.get(label, 0) + 1
        self.observe("request_prompt_tokens", prompt_tokens)
        self.observe("request_generation_tokens", output_tokens)

    def rejected(self, reason: str) -> None:
        self.rejections[reason] += 1

    # -- views -----------------------------------------------------------------
    def spec_decode(self) -> SpecDecodeStats | None:
        """Speculation's counters; None when the server does not speculate."""
        sched = self._scheduler
        if sched is None or sched.config.speculative is None:
            return None
        return sched.spec

    def _spec_decode_json(self) -> dict[str, Any]:
        stats = self.spec_decode()
        if stats is None:
            return {}
        return {"spec_decode": {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                                "num_accepted_tokens": stats.num_accepted_tokens,
                                "accepted_per_pos": list(stats.accepted_per_pos)}}

    def gauges(self) -> dict[str, float]:
        sched, alloc = self._scheduler, self._allocator
        return {"running": sched.num_running if sched else 0,
                "waiting": sched.num_waiting if sched else 0,
                "kv_cache_usage": alloc.usage if alloc else 0.0}

    def counters(self) -> dict[str, int]:
        sched, alloc = self._scheduler, self._allocator
        return {"prompt_tokens": self.prompt_tokens,
                "prefill_tokens": sched.num_prefill_tokens if sched else 0,
                "generation_tokens": self.generation_tokens,
                "prefix_cache_queries": alloc.prefix_queries if alloc else 0,
                "prefix_cache_hits": alloc.prefix_hits if alloc else 0,
                "preemptions": sched.num_preemptions if sched else 0,
                "prompt_tokens_cached": alloc.prefix_hits if alloc else 0}

    def families(self) -> list[Metric]:
        """Every metric family, read now (cheap; on the event loop, between two messages)."""
        return list(self.registry.collect())

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return render_families(self.families())

    def snapshot(self) -> dict[str, Any]:
        """The /metrics/json document (schema_version 1)."""
        return self.document([self.replica_json()])

    def document(self, replicas: list[dict[str, Any]]) -> dict[str, Any]:
        return {"schema_version": 1, "server_id": self.server_id, "started_at": self.started_at,
                "timestamp": time.time(), "model_name": self.model_name, "replicas": replicas}

    def replica_json(self) -> dict[str, Any]:
        """This replica's entry in the /metrics/json document."""
        reasons = dict(self.finish_reasons)
        counters = {**self.counters(), "requests_finished": sum(reasons.values()),
                    "requests_error": reasons["error"], "requests_aborted": reasons["aborted"]}
        return {"engine": self.engine, "gauges": self.gauges(), "counters": counters,
                "finish_reasons": reasons, "rejections": dict(self.rejections),
                "worker_restarts": self.worker_restarts,
                **self._spec_decode_json(),
                "histograms": {key: _histogram_json(h) for key, h in self.histograms.items()}}


class ReplicaMetrics:
    """The numbers of every data-parallel replica as one scrape: one series per replica
    (`engine` label) in each family. What happens before a request reaches a replica (its
    `n` parameter, a body over the size limit) counts under the first replica's label."""

    def __init__(self, replicas: Sequence[EngineMetrics]):
        self.replicas = list(replicas)

    def observe(self, histogram: str, value: float) -> None:
        self.replicas[0].observe(histogram, value)

    def rejected(self, reason: str) -> None:
        self.replicas[0].rejected(reason)

    def families(self) -> list[Metric]:
        return merge_families([m.families() for m in self.replicas])

    def render(self) -> bytes:
        return render_families(self.families())

    def snapshot(self) -> dict[str, Any]:
        return self.replicas[0].document([m.replica_json() for m in self.replicas])


def merge_families(groups: list[list[Metric]]) -> list[Metric]:
    """Several replicas' families as one family per name holding every replica's samples (a
    Prometheus exposition may name each family once)."""
    merged: dict[str, Metric] = {}
    for families in groups:
        for family in families:
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = one = copy.copy(family)
                one.samples = list(family.samples)
    return list(merged.values())


def render_families(families: list[Metric]) -> bytes:
    """Formats families read earlier; the slow part of a scrape, safe on another thread."""
    return generate_latest(_Fixed(families))


class _Fixed:
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _histogram_json(h: Histogram) -> dict[str, Any]:
    buckets = [{"le": "+Inf" if math.isinf(le) else le, "count": n} for le, n in h.cumulative()]
    return {"buckets": buckets, "count": h.count, "sum": h.sum}


class _Collector:
    """Yields every metric family under each prefix, from one read of the numbers."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        m = self.metrics
        values = [m.model_name, m.engine]
        gauges, counters = m.gauges(), m.counters()
        for prefix in PREFIXES:
            for key, (name, doc) in GAUGES.items():
                family = GaugeMetricFamily(prefix + name, doc, labels=LABELS)
                family.add_metric(values, gauges[key])
                yield family
            for key, (name, doc) in COUNTERS.items():
                family = CounterMetricFamily(prefix + name, doc, labels=LABELS)
                family.add_metric(values, counters[key])
                yield family
            yield self._finish_reasons(prefix, values)
            for key, (name, doc) in HISTOGRAMS.items():
                yield self._histogram(prefix + name, doc, values, m.histograms[key])
            yield from self._by_label(prefix, values, gauges, counters)
            yield from self._spec_decode(prefix, values)
            yield self._cache_info(prefix)
        yield from self._operations(values)

    def _operations(self, values: list[str]) -> Iterator[Metric]:
        """This server's own families (vLLM has no such names): the bounds' rejections and
        the device workers started again by --restart-worker."""
        rejections = CounterMetricFamily("pypto:request_rejections_total",
                                         "Requests turned away or cut off by a server bound, by reason.",
                                         labels=(*LABELS, "reason"))
        for reason, count in self.metrics.rejections.items():
            rejections.add_metric([*values, reason], count)
        yield rejections
        restarts = CounterMetricFamily("pypto:worker_restarts_total",
                                       "Device workers started again after engine death.", labels=LABELS)
        restarts.add_metric(values, self.metrics.worker_restarts)
        yield restarts

    def _finish_reasons(self, prefix: str, values: list[str]) -> CounterMetricFamily:
        family = CounterMetricFamily(prefix + "request_success_total", "Finished requests by reason.",
                                     labels=(*LABELS, "finished_reason"))
        counts = self.metrics.finish_reasons
        if prefix == "vllm:":  # vLLM's reason values, every one of them
            counts = dict.fromkeys(VLLM_FINISH_REASONS, 0)
            for reason, count in self.metrics.finish_reasons.items():
                counts[VLLM_FINISH.get(reason, reason)] += count
        for reason, count in counts.items():
            family.add_metric([*values, reason], count)
        return family

    def _by_label(self, prefix: str, values: list[str], gauges: dict[str, float],
                  counters: dict[str, int]) -> Iterator[Metric]:
        """vLLM's families split by one more label, with the values that exist here."""
        def labeled(kind: type, name: str, doc: str, label: str, split: dict[str, float]) -> Metric:
            family = kind(prefix + name, doc, labels=(*LABELS, label))
            for key, value in split.items():
                family.add_metric([*values, key], value)
            return family

        yield labeled(GaugeMetricFamily, "num_requests_waiting_by_reason", "Waiting requests by reason.",
                      "reason", {"capacity": gauges["waiting"], "deferred": 0})
        yield labeled(GaugeMetricFamily, "engine_sleep_state", "Engine sleep state (it never sleeps).",
                      "sleep_state", {"awake": 1, "weights_offloaded": 0, "discard_all": 0})
        sources = {"local_compute": counters["prefill_tokens"],
                   "local_cache_hit": counters["prefix_cache_hits"], "external_kv_transfer": 0}
        yield labeled(CounterMetricFamily, "prompt_tokens_by_source", "Prompt tokens by source.", "source",
                      sources)
        yield labeled(CounterMetricFamily, "prompt_tokens_cached_by_source",
                      "Prefix-cache hit tokens by the cache tier that supplied them.", "source",
                      {"device": counters["prefix_cache_hits"]})

    def _spec_decode(self, prefix: str, values: list[str]) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters, when --speculative-config is on."""
        stats = self.metrics.spec_decode()
        if stats is None:
            return
        for key, (name, doc) in SPEC_DECODE.items():
            family = CounterMetricFamily(prefix + name, doc, labels=LABELS)
            family.add_metric(values, getattr(stats, key))
            yield family
        family = CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos_total",
                                     "Proposals kept, by their position in the proposal.",
                                     labels=(*LABELS, "position"))
        for position, count in enumerate(stats.accepted_per_pos):
            family.add_metric([*values, str(position)], count)
        yield family

    def _cache_info(self, prefix: str) -> GaugeMetricFamily:
        info = {**self.metrics.cache_info, "engine": self.metrics.engine}
        family = GaugeMetricFamily(prefix + "cache_config_info", "The KV cache's settings.",
                                   labels=list(info))
        family.add_metric(list(info.values()), 1)
        return family

    def _histogram(self, name: str, doc: str, values: list[str], h: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        buckets = [(floatToGoString(le), count) for le, count in h.cumulative()]
        family.add_metric(values, buckets, sum_value=h.sum)
        return family
