"""The `vllm:` families are vLLM v1's (v0.33.0, vllm/v1/metrics/loggers.py and buckets.py):
same names, types, labels and buckets, so its dashboards and alerts work unchanged. The list
is kept here, so a family dropped or renamed fails."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pypto_serving.telemetry.metrics import token_buckets
from tests.metrics.test_metrics import bound_metrics, observe_requests

MAX_LEN = 64
LATENCY = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
           20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
PER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
           480.0, 960.0, 1920.0, 7680.0]
TOKENS = list(token_buckets(MAX_LEN))
assert TOKENS == [1, 2, 5, 10, 20, 50]  # vLLM's build_1_2_5_buckets(64)

# family (as the text parser names it) -> (type, labels beyond model_name and engine, buckets)
VLLM_FAMILIES = {
    "vllm:num_requests_running": ("gauge", (), None),
    "vllm:num_requests_waiting": ("gauge", (), None),
    "vllm:num_requests_waiting_by_reason": ("gauge", ("reason",), None),
    "vllm:engine_sleep_state": ("gauge", ("sleep_state",), None),
    "vllm:kv_cache_usage_perc": ("gauge", (), None),
    "vllm:prefix_cache_queries": ("counter", (), None),
    "vllm:prefix_cache_hits": ("counter", (), None),
    "vllm:num_preemptions": ("counter", (), None),
    "vllm:prompt_tokens": ("counter", (), None),
    "vllm:prompt_tokens_by_source": ("counter", ("source",), None),
    "vllm:prompt_tokens_cached": ("counter", (), None),
    "vllm:prompt_tokens_cached_by_source": ("counter", ("source",), None),
    "vllm:generation_tokens": ("counter", (), None),
    "vllm:request_success": ("counter", ("finished_reason",), None),
    "vllm:request_prompt_tokens": ("histogram", (), TOKENS),
    "vllm:request_generation_tokens": ("histogram", (), TOKENS),
    "vllm:iteration_tokens_total": ("histogram", (), [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                                      8192, 16384]),
    "vllm:request_max_num_generation_tokens": ("histogram", (), TOKENS),
    "vllm:request_params_n": ("histogram", (), [1, 2, 5, 10, 20]),
    "vllm:request_params_max_tokens": ("histogram", (), TOKENS),
    "vllm:time_to_first_token_seconds": ("histogram", (), LATENCY),
    "vllm:inter_token_latency_seconds": ("histogram", (), PER_TOKEN),
    "vllm:request_time_per_output_token_seconds": ("histogram", (), PER_TOKEN),
    "vllm:e2e_request_latency_seconds": ("histogram", (), REQUEST),
    "vllm:request_queue_time_seconds": ("histogram", (), REQUEST),
    "vllm:request_inference_time_seconds": ("histogram", (), REQUEST),
    "vllm:request_prefill_time_seconds": ("histogram", (), REQUEST),
    "vllm:request_decode_time_seconds": ("histogram", (), REQUEST),
    "vllm:request_num_preemptions": ("histogram", (), [1, 2, 3, 4, 5, 10, 20]),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", (), TOKENS),
}
# vLLM's always-registered families left out, and why (feature-dependent ones are not listed:
# LoRA, speculative decoding, diffusion, KV connectors and offload, watermarks, NaN checks)
LEFT_OUT = {
    "vllm:external_prefix_cache_queries": "no KV connector: no cache shared across instances",
    "vllm:external_prefix_cache_hits": "no KV connector",
    "vllm:mm_cache_queries": "text-only models: no multimodal cache",
    "vllm:mm_cache_hits": "text-only models",
    "vllm:admission_rejections": "no admission bound yet (queue limits come with the operations work)",
    "vllm:estimated_flops_per_gpu_total": "no MFU accounting",
    "vllm:estimated_read_bytes_per_gpu_total": "no MFU accounting",
    "vllm:estimated_write_bytes_per_gpu_total": "no MFU accounting",
}


def families() -> dict:
    metrics, _, _ = bound_metrics()
    metrics.cache_info = {"block_size": "4", "enable_prefix_caching": "True"}
    observe_requests(metrics)
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_every_vllm_family_with_a_meaning_here_has_its_type_labels_and_buckets():
    found = families()
    for name, (kind, labels, buckets) in VLLM_FAMILIES.items():
        family = found[name]
        assert family.type == kind, name
        for sample in family.samples:
            assert {"model_name", "engine", *labels} <= set(sample.labels), name
        if buckets is not None:
            bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert bounds == [*map(float, buckets), float("inf")], name
    assert not set(LEFT_OUT) & set(found)


def test_label_values_are_vllms():
    found = families()
    def values(name: str, label: str) -> set[str]:
        return {s.labels[label] for s in found[name].samples}

    assert values("vllm:request_success", "finished_reason") == {"stop", "length", "abort", "error",
                                                                 "repetition"}
    assert values("vllm:prompt_tokens_by_source", "source") == {"local_compute", "local_cache_hit",
                                                                "external_kv_transfer"}
    assert values("vllm:engine_sleep_state", "sleep_state") == {"awake", "weights_offloaded", "discard_all"}
    info = found["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels == {"block_size": "4", "enable_prefix_caching": "True",
                                               "engine": "0"}


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SUFFIXES = ("_bucket", "_sum", "_count")


def exposed_series() -> set[str]:
    """Every series name our /metrics text carries (counters with _total, histograms' parts)."""
    return {s.name for f in families().values() for s in f.samples}


def dashboard_metrics() -> set[str]:
    dashboard = json.loads((EXAMPLES / "grafana" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][0]["query"]["query"])
    return {m for e in exprs for m in re.findall(r"vllm:[A-Za-z0-9_]+", e)}


def test_every_metric_the_dashboard_queries_is_exposed():
    used = dashboard_metrics()
    assert len(used) >= 15  # the panels query a wide set, not one metric
    missing = sorted(m for m in used if m not in exposed_series())
    assert missing == []
    assert any(m.endswith("_bucket") for m in used)  # and the histograms as histograms


def test_the_scrape_config_reads_metrics():
    config = (EXAMPLES / "prometheus" / "prometheus.yml").read_text()
    assert "metrics_path: /metrics" in config and "127.0.0.1:8000" in config
