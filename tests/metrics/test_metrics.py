"""EngineMetrics: exact numbers from the pure scheduler and allocator, two exports of them."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from pypto_serving.core.block_allocator import BlockAllocator
from pypto_serving.core.scheduler import Scheduler, SchedulerConfig
from pypto_serving.core.sequence import Sequence
from pypto_serving.messages.worker import StepResult
from pypto_serving.telemetry.metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    EngineMetrics,
    ReplicaMetrics,
    token_buckets,
)

PROMPT = tuple(range(100, 112))  # 12 tokens: 3 blocks of 4


def make_sequences(n: int, prompt: tuple[int, ...] = PROMPT, max_tokens: int = 3) -> list[Sequence]:
    return [Sequence(seq_id=i, prompt_ids=prompt, max_tokens=max_tokens) for i in range(n)]


def run_to_end(sched: Scheduler, alloc: BlockAllocator) -> None:
    """Drives the policy like the actors do, with a worker that always samples token 7."""
    plan, _ = sched.step()
    while sched.has_work:
        assert plan is not None
        sampled = [s.seq_id for s in plan.seqs if s.sample]
        plan, _ = sched.step(StepResult(plan.step_id, sampled, [7] * len(sampled)))


def bound_metrics(**cfg: int) -> tuple[EngineMetrics, Scheduler, BlockAllocator]:
    metrics = EngineMetrics("tiny", max_model_len=64)
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(SchedulerConfig(max_model_len=64, **cfg), alloc)
    metrics.bind(sched, alloc)
    return metrics, sched, alloc


def test_prefix_reuse_and_prefill_counters_are_exact():
    metrics, sched, alloc = bound_metrics()
    first, second = make_sequences(2)
    sched.add(first)
    run_to_end(sched, alloc)
    sched.add(second)  # same prompt: its first two blocks come from the cache
    run_to_end(sched, alloc)
    counters = metrics.counters()
    assert counters["prefix_cache_queries"] == 24
    assert counters["prefix_cache_hits"] == 8 == second.num_cached_tokens
    assert counters["prefill_tokens"] == 24 - 8
    assert metrics.gauges() == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}


def test_chunked_prefill_counts_each_prompt_token_once():
    metrics, sched, alloc = bound_metrics(long_prefill_token_threshold=5)
    for seq in make_sequences(1, prompt=tuple(range(23))):
        sched.add(seq)
    run_to_end(sched, alloc)
    assert metrics.counters()["prefill_tokens"] == 23


def test_gauges_follow_the_queues():
    metrics, sched, alloc = bound_metrics(max_num_seqs=1)
    for seq in make_sequences(3):
        sched.add(seq)
    sched.schedule()
    gauges = metrics.gauges()
    assert (gauges["running"], gauges["waiting"]) == (1, 2)
    assert gauges["kv_cache_usage"] == 3 / 32


def observe_requests(metrics: EngineMetrics) -> None:
    metrics.request_started(5)
    metrics.tokens_generated(3)
    metrics.observe("ttft", 0.2)
    metrics.observe("e2e", 1.5)
    metrics.request_finished("eos", 5, 3)  # EOS is reported as "stop"
    metrics.request_started(4)
    metrics.request_finished("aborted", 4, 0)


def test_prometheus_text_parses_with_both_prefixes_and_labels():
    metrics, _, _ = bound_metrics()
    observe_requests(metrics)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    for prefix in ("pypto:", "vllm:"):
        # a counter's family name drops the _total its samples carry; gauges' and histograms' do not
        names = [*GAUGES.values(), *[(n.removesuffix("_total"), d) for n, d in COUNTERS.values()],
                 *HISTOGRAMS.values()]
        for name, _ in names:
            family = families[prefix + name]
            assert all(s.labels["model_name"] == "tiny" and s.labels["engine"] == "0"
                       for s in family.samples)
        success = {s.labels["finished_reason"]: s.value
                   for s in families[prefix + "request_success"].samples}
        if prefix == "pypto:":
            assert success == {"stop": 1, "length": 0, "tool_calls": 0, "aborted": 1, "error": 0}
        else:  # vLLM's finished_reason values
            assert success == {"stop": 1, "length": 0, "abort": 1, "error": 0, "repetition": 0}
        prompt = families[prefix + "prompt_tokens"].samples[0]
        assert prompt.name == prefix + "prompt_tokens_total" and prompt.value == 9


def test_json_snapshot_matches_the_prometheus_numbers():
    metrics, _, _ = bound_metrics()
    observe_requests(metrics)
    snap = metrics.snapshot()
    assert snap["schema_version"] == 1 and snap["model_name"] == "tiny"
    replica = snap["replicas"][0]
    assert replica["counters"]["prompt_tokens"] == 9
    assert replica["counters"]["generation_tokens"] == 3
    assert replica["counters"]["requests_finished"] == 2
    assert replica["counters"]["requests_aborted"] == 1 and replica["counters"]["requests_error"] == 0
    ttft = replica["histograms"]["ttft"]
    assert ttft["count"] == 1 and ttft["sum"] == 0.2
    assert ttft["buckets"][-1] == {"le": "+Inf", "count": 1}
    counts = {b["le"]: b["count"] for b in ttft["buckets"]}
    assert counts[0.1] == 0 and counts[0.25] == 1
    tokens = replica["histograms"]["request_generation_tokens"]
    assert tokens["count"] == 2 and tokens["sum"] == 3


def test_histogram_buckets_are_cumulative_and_inclusive():
    metrics = EngineMetrics("m")
    for value in (0.1, 0.1, 0.25, 100.0):
        metrics.observe("ttft", value)
    cumulative = dict(metrics.histograms["ttft"].cumulative())
    assert cumulative[0.08] == 0 and cumulative[0.1] == 2 and cumulative[0.25] == 3
    assert cumulative[80.0] == 3 and cumulative[math.inf] == 4


def test_token_buckets():
    assert token_buckets(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)


def test_replicas_render_as_one_family_per_name_with_a_series_per_engine():
    replicas = [EngineMetrics("tiny", 64, engine=str(i)) for i in range(2)]
    for i, metrics in enumerate(replicas):
        metrics.request_finished("length", 4, 2 + i)
    both = ReplicaMetrics(replicas)
    both.rejected("body_too_large")  # before any replica got the request: the first's
    text = both.render().decode()
    assert text.count("# TYPE pypto:num_requests_running gauge") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["pypto:num_requests_running"].samples
    assert [s.labels["engine"] for s in running] == ["0", "1"]
    done = [s for s in families["vllm:request_success"].samples
            if s.labels["finished_reason"] == "length" and s.name.endswith("_total")]
    assert [(s.labels["engine"], s.value) for s in done] == [("0", 1), ("1", 1)]
    tokens = families["pypto:request_generation_tokens"].samples
    assert sorted(s.value for s in tokens if s.name.endswith("_sum")) == [2, 3]
    snap = both.snapshot()
    assert [r["engine"] for r in snap["replicas"]] == ["0", "1"]
    assert [r["rejections"]["body_too_large"] for r in snap["replicas"]] == [1, 0]
    assert snap["server_id"] == replicas[0].server_id
