"""Prompt logprobs from the worker: every prompt token scored once, given the tokens before
it, equal to transformers' logits over the whole prompt, however the prompt is chunked."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.messages.worker import PromptLogprobs

PROMPT = [(7 * i + 3) % 256 for i in range(23)]


def scored(results: list[PromptLogprobs]) -> tuple[list[float], list[int], list[list[int]]]:
    """The chunks' entries, joined in position order (checking that they tile 1..)."""
    logprobs, ranks, tops, expected_first = [], [], [], 1
    for r in results:
        assert r.first == expected_first
        expected_first += len(r.logprobs)
        logprobs += r.logprobs
        ranks += r.ranks
        tops += [[t.token_id for t in top] for top in r.top]
    return logprobs, ranks, tops


@pytest.mark.parametrize("chunks", [[23], [8, 8, 7], [1, 21, 1], [5, 18]])
def test_prompt_logprobs_equal_the_oracle_however_chunked(driver, chunks: list[int]) -> None:
    d, oracle = driver("llama")
    params = SamplingParams(prompt_logprobs=3)
    results = [d.step([d.add(1, PROMPT, chunks[0], params)])[0]]
    results += [d.step([d.next(1, n)])[0] for n in chunks[1:]]
    assert results[-1].seq_ids == [1]  # the last chunk samples the first output token
    entries = [p for r in results for p in r.prompt_logprobs]
    logprobs, ranks, tops = scored(entries)
    assert len(logprobs) == len(PROMPT) - 1
    expected = oracle.logits(PROMPT).log_softmax(-1)[:-1]  # row i predicts token i + 1
    target = torch.tensor(PROMPT[1:])
    chosen = expected.gather(1, target[:, None])[:, 0]
    assert logprobs == pytest.approx(chosen.tolist(), abs=1e-4)
    assert ranks == ((expected > chosen[:, None] + 1e-5).sum(1) + 1).tolist()
    assert tops == expected.topk(3).indices.tolist()


def test_only_sequences_that_ask_are_scored_and_decode_steps_score_nothing(driver) -> None:
    d, _ = driver("llama")
    result, _ = d.step([d.add(1, PROMPT, 23, SamplingParams(prompt_logprobs=0)),
                        d.add(2, PROMPT[:9], 9)])
    [entry] = result.prompt_logprobs
    assert entry.seq_id == 1 and entry.top == [[] for _ in range(22)]
    result, _ = d.step([d.next(1), d.next(2)])
    assert result.prompt_logprobs == []
