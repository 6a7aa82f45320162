"""HTTP request metrics: what the edge middleware saw, per route, method and status.

The edge (http/edge.py) calls `observe` once per finished request, on the event loop. Labels
are bounded by construction: `path` is the route's canonical path (or `unmatched`, so random
404 paths add no series) and `method` one of a fixed set (or `other`).

Prometheus families, for `/metrics` next to the engine's (`families()`):
- `pypto:http_requests_total{method,path,status}` and
  `pypto:http_request_duration_seconds{method,path}` (ours);
- `http_requests_total{handler,method,status}` and `http_request_duration_seconds{handler,method}`
  as prometheus-fastapi-instrumentator (vLLM's server) names them, its defaults included:
  status grouped as `2xx`/`4xx`/..., an unmatched route as handler `none`; so vLLM's
  dashboards work. Both duration families share one set of buckets.
`snapshot()` is the same numbers for `/metrics/json`, with a `by_status` roll-up so a burst
of 400s (or 401s, 499s) stands out without summing series.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from pypto_serving.telemetry.metrics import Histogram

UNMATCHED = "unmatched"
_DURATION = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
             300.0, 600.0)


class HttpMetrics:
    """Counters and latency histograms of HTTP requests; owned by the server, fed by the edge."""

    def __init__(self, buckets: tuple[float, ...] = _DURATION):
        self.buckets = buckets
        self.requests: Counter[tuple[str, str, int]] = Counter()  # (method, path, status)
        self.durations: dict[tuple[str, str], Histogram] = {}  # (method, path)

    def observe(self, method: str, path: str, status: int, seconds: float) -> None:
        self.requests[method, path, status] += 1
        histogram = self.durations.get((method, path))
        if histogram is None:
            histogram = self.durations[method, path] = Histogram(self.buckets)
        histogram.observe(seconds)

    def by_status(self) -> dict[str, int]:
        totals: Counter[str] = Counter()
        for (_, _, status), count in self.requests.items():
            totals[str(status)] += count
        return dict(sorted(totals.items()))

    def families(self) -> list[Metric]:
        return [self._requests_ours(),
                self._durations("pypto:http_request_duration_seconds", ("method", "path"),
                                lambda method, path: [method, path]),
                self._requests_instrumentator(),
                self._durations("http_request_duration_seconds", ("handler", "method"),
                                lambda method, path: [_handler(path), method])]

    def snapshot(self) -> dict[str, Any]:
        requests = [{"method": m, "path": p, "status": s, "count": n}
                    for (m, p, s), n in sorted(self.requests.items())]
        durations = [{"method": m, "path": p, **_histogram_json(h)}
                     for (m, p), h in sorted(self.durations.items())]
        return {"requests": requests, "by_status": self.by_status(), "durations": durations}

    def _requests_ours(self) -> CounterMetricFamily:
        family = CounterMetricFamily("pypto:http_requests_total",
                                     "HTTP requests by route, method and status.",
                                     labels=("method", "path", "status"))
        for (method, path, status), count in sorted(self.requests.items()):
            family.add_metric([method, path, str(status)], count)
        return family

    def _requests_instrumentator(self) -> CounterMetricFamily:
        grouped: Counter[tuple[str, str, str]] = Counter()
        for (method, path, status), count in self.requests.items():
            grouped[_handler(path), method, f"{status // 100}xx"] += count
        family = CounterMetricFamily("http_requests_total", "Total number of requests by method, status "
                                     "and handler.", labels=("handler", "method", "status"))
        for labels, count in sorted(grouped.items()):
            family.add_metric(list(labels), count)
        return family

    def _durations(self, name: str, labels: tuple[str, str],
                   values: Callable[[str, str], list[str]]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, "HTTP request duration, in seconds.", labels=labels)
        for (method, path), h in sorted(self.durations.items()):
            buckets = [(floatToGoString(le), count) for le, count in h.cumulative()]
            family.add_metric(values(method, path), buckets, sum_value=h.sum)
        return family


def _handler(path: str) -> str:
    """The instrumentator's name for a request no route matched."""
    return "none" if path == UNMATCHED else path


def _histogram_json(h: Histogram) -> dict[str, Any]:
    buckets = [{"le": "+Inf" if math.isinf(le) else le, "count": n} for le, n in h.cumulative()]
    return {"buckets": buckets, "count": h.count, "sum": h.sum}
