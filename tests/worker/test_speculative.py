"""The worker's half of speculation: a step with proposals keeps them up to the first one
the sampler disagrees with, plus the token it sampled there: greedy text is unchanged."""

from __future__ import annotations

import pytest

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.messages.worker import ScheduledSeq
from tests.worker.tiny_models import BLOCK_SIZE, Driver

PROMPT = [(5 * i + 11) % 256 for i in range(9)]


def plain_greedy(d: Driver, n: int, params: SamplingParams) -> list[int]:
    d.step([d.add(1, PROMPT, len(PROMPT), params)])
    while len(d.tokens[1]) < len(PROMPT) + n:
        d.step([d.next(1)])
    return d.tokens[1][len(PROMPT):]


def speculative_step(d: Driver, draft: list[int]) -> list[int]:
    """One decode step of sequence 1 with `draft` proposed after its last token."""
    tokens = d.tokens[1]
    start = len(tokens) - 1
    end = start + 1 + len(draft)
    blocks = d.blocks[1]
    new = d.alloc(max(0, -(-end // BLOCK_SIZE) - len(blocks)))
    blocks.extend(new)
    seq = ScheduledSeq(1, [tokens[-1], *draft], start, new, sample=True, num_draft=len(draft))
    result, _ = d.step([seq])
    assert set(result.seq_ids) == {1}
    return result.token_ids


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_greedy_text_is_the_same_with_right_and_wrong_proposals(driver, quantization: str) -> None:
    params = SamplingParams(logprobs=1)
    want = plain_greedy(driver("llama", quantization=quantization)[0], 24, params)
    d, _ = driver("llama", quantization=quantization)
    d.step([d.add(1, PROMPT, len(PROMPT), params)])
    kept_counts = []
    for wrong_at in [3, 0, 1, 5, 2]:  # proposals right up to `wrong_at`, then a wrong one
        out = d.tokens[1][len(PROMPT):]
        draft = want[len(out):len(out) + 4]
        if wrong_at < len(draft):
            draft[wrong_at] = (draft[wrong_at] + 1) % 256
        got = speculative_step(d, draft)
        assert got == want[len(out):len(out) + len(got)]
        kept_counts.append(len(got))
    assert kept_counts == [4, 1, 2, 5, 3]
    assert d.tokens[1][len(PROMPT):] == want[:len(d.tokens[1]) - len(PROMPT)]


def test_logprobs_come_per_kept_token(driver) -> None:
    d, _ = driver("llama")
    want = plain_greedy(driver("llama")[0], 4, SamplingParams(logprobs=2))
    d.step([d.add(1, PROMPT, len(PROMPT), SamplingParams(logprobs=2))])
    result_tokens = speculative_step(d, want[1:4])
    assert result_tokens == want[1:4] + result_tokens[3:]
    assert len(result_tokens) == 4  # three proposals kept and the token after them
