"""N-gram speculation's pure half: proposals, the flag, and the scheduler's bookkeeping of
steps whose sequences carry proposals."""

from __future__ import annotations

import pytest

from pypto_serving.core.block_allocator import BlockAllocator
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.core.scheduler import Scheduler, SchedulerConfig
from pypto_serving.core.sequence import Sequence
from pypto_serving.core.speculative import NgramIndex, SpeculativeConfig, parse_speculative_config
from pypto_serving.messages.worker import StepResult


def test_the_longest_suffix_seen_before_proposes_what_followed_it_last():
    index = NgramIndex(1, 3, [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    assert index.propose(3) == [7, 5, 2]  # (2, 3) ended last at 7; (1, 2, 3) does not end here
    index.append(7)
    assert index.propose(2) == [5, 2]  # (2, 3, 7) seen before
    assert NgramIndex(1, 3, [4, 5, 6]).propose(3) == []  # nothing repeats
    assert NgramIndex(2, 3, [4, 5, 4]).propose(3) == []  # only a unigram repeats: below the minimum
    assert NgramIndex(1, 2, [8, 8, 8]).propose(4) == [8]  # what follows is what exists


def test_speculative_config_is_vllms_json():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert c == SpeculativeConfig(3, 2, 4)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, '
                                    '"prompt_lookup_min": 7}') == SpeculativeConfig(2, 7, 7)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}') == \
        SpeculativeConfig(2)
    for bad, words in [("{", "not JSON"), ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
                       ('{"method": "ngram"}', "num_speculative_tokens"),
                       ('{"method": "ngram", "num_speculative_tokens": 0}', "1..16"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "'model'"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                        '"prompt_lookup_max": 2}', "prompt_lookup_max")]:
        with pytest.raises(ValueError, match=words):
            parse_speculative_config(bad)


PATTERN = (10, 11, 12, 13, 14, 15)


def scheduler(k: int = 3, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(speculative=SpeculativeConfig(k, 2, 3), **cfg), BlockAllocator(64, 4))


def run_step(s: Scheduler, answer) -> tuple:
    """One step; `answer(scheduled seq)` -> the tokens the worker returns for it."""
    plan = s.schedule()
    seq_ids, tokens = [], []
    for seq in plan.seqs:
        if seq.sample:
            got = answer(seq)
            seq_ids += [seq.seq_id] * len(got)
            tokens += got
    events = s.apply(StepResult(plan.step_id, seq_ids, tokens))
    s.allocator.check_integrity()
    return plan, events


def test_proposals_ride_on_decode_steps_and_only_kept_ones_count_as_computed():
    s = scheduler()
    seq = Sequence(1, PATTERN * 2, max_tokens=20)
    s.add(seq)
    run_step(s, lambda _: [10])  # the prefill samples 10: (14, 15, 10) is in the prompt
    plan, events = run_step(s, lambda sch: [11, 12, 99])  # kept 11, 12; sampled 99 instead of 13
    [sch] = plan.seqs
    assert sch.token_ids == [10, 11, 12, 13] and sch.num_draft == 3 and sch.start_pos == 12
    assert [e.token_id for e in events] == [11, 12, 99]
    assert seq.output_ids == [10, 11, 12, 99] and seq.num_computed == 15  # 10, 11, 12 have KV
    plan, _ = run_step(s, lambda sch: [5])
    assert plan.seqs[0].token_ids[0] == 99 and plan.seqs[0].start_pos == 15
    assert plan.seqs[0].num_draft == 0  # (12, 99) never occurred before
    assert (s.spec.num_drafts, s.spec.num_draft_tokens, s.spec.num_accepted_tokens) == (1, 3, 2)
    assert s.spec.accepted_per_pos == [1, 1, 0]


def test_no_proposals_past_max_tokens_or_for_penalized_sequences():
    s = scheduler(k=8)
    capped = Sequence(1, PATTERN * 2, max_tokens=3)
    penalized = Sequence(2, PATTERN * 2, max_tokens=20, sampling=SamplingParams(repetition_penalty=1.2))
    s.add(capped)
    s.add(penalized)
    run_step(s, lambda sch: [10])
    plan, _ = run_step(s, lambda sch: sch.token_ids[1:] + [7] if sch.num_draft else [7])
    drafts = {sch.seq_id: sch.num_draft for sch in plan.seqs}
    assert drafts == {1: 1, 2: 0}  # 3 tokens at most: 10 out, one proposal and its bonus token
    assert capped.output_ids == [10, 11, 7] and capped.finish_reason == "length"


def test_an_eos_among_kept_tokens_ends_the_sequence_there():
    s = scheduler()
    seq = Sequence(1, PATTERN * 2, max_tokens=20, stop_token_ids=frozenset({12}))
    s.add(seq)
    run_step(s, lambda _: [10])
    _, events = run_step(s, lambda sch: [11, 12, 13, 14])
    assert seq.output_ids == [10, 11, 12] and seq.finish_reason == "eos"
    assert [e.finish_reason for e in events] == [None, "eos"]
    assert not s.has_work and s.allocator.num_available == 64


def test_speculation_pauses_for_big_batches():
    s = Scheduler(SchedulerConfig(speculative=SpeculativeConfig(3, 2, 3, disable_by_batch_size=2)),
                  BlockAllocator(64, 4))
    for i in (1, 2):
        s.add(Sequence(i, PATTERN * 2, max_tokens=20))
    run_step(s, lambda _: [10])
    plan, _ = run_step(s, lambda sch: [11])
    assert all(sch.num_draft == 0 for sch in plan.seqs)
