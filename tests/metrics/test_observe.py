"""RequestObserver: one request's samples, from its event stream alone."""

from __future__ import annotations

from pypto_serving.core.request import Finished, Started, TextDelta
from pypto_serving.telemetry.metrics import EngineMetrics
from pypto_serving.telemetry.observe import RequestObserver
from pypto_serving.telemetry.profiling import SpanRecorder


def observed(*events: object, verbose: bool = False) -> tuple[EngineMetrics, SpanRecorder]:
    metrics, recorder = EngineMetrics("m"), SpanRecorder("api")
    if verbose:
        recorder.start(["verbose"])
    observer = RequestObserver("r1", metrics, recorder)
    for event in events:
        observer.on_event(event)
    observer.close()
    return metrics, recorder


def counts(metrics: EngineMetrics) -> dict[str, int]:
    return {k: h.count for k, h in metrics.histograms.items() if h.count}


def test_tokens_that_come_together_still_give_one_itl_sample_between_each_two():
    """Several tokens in one delta (speculation, or a stream's tokens merged under load):
    1 + 2 with the first delta, then 3: 5 inter-token samples for 6 tokens."""
    deltas = [TextDelta("ab", (1, 2)), TextDelta("cde", (3, 4, 5)), TextDelta("f", (6,))]
    metrics, _ = observed(Started(5, 10), *deltas, Finished("length", 5, 6))
    assert metrics.histograms["itl"].count == 5 and metrics.histograms["ttft"].count == 1
    assert metrics.generation_tokens == 6


def test_a_finished_request_gives_one_ttft_and_one_e2e_sample():
    deltas = [TextDelta("a", (1,)), TextDelta("", (2,)), TextDelta("b", (3,))]
    metrics, _ = observed(Started(5, 10), *deltas, Finished("eos", 5, 3))
    assert counts(metrics) == {"ttft": 1, "itl": 2, "tpot": 1, "e2e": 1, "request_prompt_tokens": 1,
                               "request_generation_tokens": 1, "request_max_num_generation_tokens": 1}
    assert metrics.histograms["request_max_num_generation_tokens"].sum == 10  # Started's max_tokens
    assert (metrics.prompt_tokens, metrics.generation_tokens) == (5, 3)
    assert metrics.finish_reasons["stop"] == 1


def test_a_closed_stream_counts_as_aborted_with_what_it_generated():
    metrics, _ = observed(Started(4, 10), TextDelta("a", (1,)))
    assert metrics.finish_reasons["aborted"] == 1 and metrics.generation_tokens == 1
    assert counts(metrics)["e2e"] == 1 and "tpot" not in counts(metrics)


def test_a_rejected_request_counts_nothing():
    metrics, _ = observed()
    assert sum(metrics.finish_reasons.values()) == 0 and counts(metrics) == {}


def test_verbose_profiles_record_each_token():
    _, recorder = observed(Started(1, 2), TextDelta("a", (1,)), TextDelta("b", (2,)),
                           Finished("length", 1, 2), verbose=True)
    tokens = [e for e in recorder.stop() if e["name"] == "token"]
    assert len(tokens) == 2 and tokens[0]["args"]["request_id"] == "r1"


def test_logged_chat_prompts_are_their_messages_as_json():
    from structlog.testing import capture_logs

    from pypto_serving.core.request import ChatInput

    observer = RequestObserver("r1", EngineMetrics("m"), SpanRecorder("api"))
    observer.log_content(ChatInput(({"role": "user", "content": "Hi"},)), 100)
    with capture_logs() as logs:
        observer.on_event(Started(5, 10))
    (received,) = [e for e in logs if e["event"] == "request received"]
    assert received["prompt"] == '[{"role":"user","content":"Hi"}]'
