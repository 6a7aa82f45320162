"""The batched sampler: what each setting allows, seeds, penalties, min_tokens, logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from msgspec.structs import replace

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.kernels import cpu
from pypto_serving.kernels.sampling import (
    PORTABLE_SAMPLER,
    SamplerKernels,
    SamplerOutput,
    apply_penalties,
    apply_token_bitmask,
    draw_portable,
    sample,
    token_logprobs,
)
from pypto_serving.worker.sampler_state import sampling_tensors
from pypto_serving.worker.seq_state import SeqState, make_generator

CPU = torch.device("cpu")
PROBS = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
LOGITS = PROBS.log()
needs_c = pytest.mark.skipif(not cpu.available(), reason="the C kernels do not run here")


def c_kernels() -> SamplerKernels:
    from pypto_serving.kernels.cpu.sampling import argmax_cpu, draw_cpu, logprobs_cpu, mask_tokens_cpu

    return SamplerKernels(argmax_cpu, draw_cpu, mask_tokens_cpu, logprobs_cpu)


KERNELS = [PORTABLE_SAMPLER]  # the ones `run` uses: every test here runs with each


@pytest.fixture(autouse=True, params=["portable", "portable-float32", pytest.param("c", marks=needs_c)])
def each_kernel_set(request):
    """The portable kernels as the host runs them and as an accelerator does (float32 draws and
    running sums), and the C ones."""
    KERNELS[0] = {"c": c_kernels, "portable-float32": lambda: SamplerKernels(precision=torch.float32)}.get(
        request.param, lambda: PORTABLE_SAMPLER)()
    yield
    KERNELS[0] = PORTABLE_SAMPLER


def states(
    params: list[SamplingParams], prompt: Sequence[int] = (), output: Sequence[int] = ()
) -> list[SeqState]:
    """One fresh sequence per params (generator seeded from params.seed)."""
    return [SeqState([], [*prompt, *output], len(prompt), p, make_generator(p, CPU)) for p in params]


def run(logits: torch.Tensor, seqs: list[SeqState]) -> SamplerOutput:
    return sample(logits, sampling_tensors(seqs, logits.shape[1], CPU), KERNELS[0])


def draws(params: SamplingParams, n: int = 2000, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """n independent draws: n rows, each with its own seed."""
    rows = [replace(params, seed=i) for i in range(n)]
    return run(logits.expand(n, -1), states(rows)).token_ids


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50)
    out = run(logits, states([SamplingParams()] * 6))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_plain_sampling_follows_the_distribution() -> None:
    counts = torch.bincount(draws(SamplingParams(temperature=1.0), 4000), minlength=5) / 4000
    torch.testing.assert_close(counts, PROBS, atol=0.03, rtol=0)


def test_low_temperature_sharpens() -> None:
    cold = (draws(SamplingParams(temperature=0.3)) == 0).float().mean()
    hot = (draws(SamplingParams(temperature=2.0)) == 0).float().mean()
    assert cold > 0.8 and hot < 0.45


def test_top_k_never_leaves_the_k_most_likely() -> None:
    tokens = draws(SamplingParams(temperature=1.0, top_k=2))
    assert set(tokens.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    tokens = draws(SamplingParams(temperature=1.0, top_p=0.85))  # 0.5 + 0.3 < 0.85 <= + 0.1
    assert set(tokens.tolist()) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    tokens = draws(SamplingParams(temperature=1.0, min_p=0.15))  # threshold 0.075
    assert set(tokens.tolist()) == {0, 1, 2}


def test_cuts_combine_per_row() -> None:
    rows = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(200)]
    rows += [SamplingParams(temperature=1.0, seed=i) for i in range(200)]
    tokens = run(LOGITS.expand(400, -1), states(rows)).token_ids
    assert set(tokens[:200].tolist()) == {0}
    assert len(set(tokens[200:].tolist())) == 5


def test_penalties_follow_the_formulas() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    seq = states([params], prompt=[1], output=[2, 2])
    out = apply_penalties(logits, sampling_tensors(seq, 4, CPU))
    # token 1: in the prompt, negative -> x2; token 2: output twice, positive -> /2 - 2*0.25 - 0.5
    assert out.tolist() == [[2.0, -4.0, 1.0 / 2 - 0.5 - 0.5, 0.5]]


def test_repetition_penalty_steers_greedy_away_from_repeats() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert run(logits, states([SamplingParams()], output=[0])).token_ids.item() == 0
    seq = states([SamplingParams(repetition_penalty=1.2)], output=[0])
    assert run(logits, seq).token_ids.item() == 1


def test_frequency_penalty_lowers_the_chance_of_repeated_tokens() -> None:
    n = 2000
    plain = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    penalised = [SamplingParams(temperature=1.0, seed=i, frequency_penalty=1.0) for i in range(n)]
    before = run(LOGITS.expand(n, -1), states(plain, output=[0, 0])).token_ids
    after = run(LOGITS.expand(n, -1), states(penalised, output=[0, 0])).token_ids
    assert (after == 0).float().mean() < (before == 0).float().mean() - 0.2


def test_eos_is_never_sampled_before_min_tokens() -> None:
    logits = torch.tensor([[0.0, 8.0, 0.0, 0.0]])  # eos (1) is the obvious choice
    for temperature in (0.0, 1.0):
        early = SamplingParams(temperature=temperature, min_tokens=3, eos_token_ids=(1,))
        for output in ([], [2], [2, 3]):
            seqs = states([replace(early, seed=s) for s in range(50)], output=output)
            assert 1 not in run(logits.expand(50, -1), seqs).token_ids.tolist()
        assert run(logits, states([early], output=[2, 3, 0])).token_ids.item() == 1


def test_same_seed_same_tokens_alone_or_batched_and_different_seeds_differ() -> None:
    logits = torch.randn(30, 64)  # one row of logits per step
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    alone = states([mine])
    others = states(
        [
            SamplingParams(temperature=0.8, seed=1),
            SamplingParams(),
            mine,
            SamplingParams(temperature=1.0, top_k=5),
        ]
    )
    other_seed = states([SamplingParams(temperature=1.0, top_p=0.9, seed=8)])
    a, b, c = [], [], []
    for row in logits:
        a.append(run(row[None], alone).token_ids.item())
        b.append(run(torch.stack([row.roll(1), row, row, row * 2]), others).token_ids[2].item())
        c.append(run(row[None], other_seed).token_ids.item())
    assert a == b
    assert a != c


def test_logprobs_are_of_the_raw_logits() -> None:
    logits = torch.randn(3, 20)
    params = [
        SamplingParams(temperature=0.7, logprobs=4, repetition_penalty=1.5, seed=1),
        SamplingParams(logprobs=0),
        SamplingParams(),
    ]
    out = run(logits, states(params, prompt=[3, 4]))
    expected = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, expected.topk(4).values)
    assert out.top_ids.tolist() == expected.topk(4).indices.tolist()


def test_no_logprobs_computed_when_none_asked() -> None:
    out = run(torch.randn(2, 10), states([SamplingParams()] * 2))
    assert out.logprobs is None and out.top_ids is None


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the draws' counts against `probs` (tokens of probability 0
    must not be drawn at all)."""
    counts = torch.bincount(tokens, minlength=probs.shape[0]).float()
    assert counts[probs == 0].sum() == 0, "drew a token the settings remove"
    expected = probs[probs > 0] * tokens.shape[0]
    return float(((counts[probs > 0] - expected) ** 2 / expected).sum())


def first(weights: torch.Tensor, k: int) -> torch.Tensor:
    """The distribution over the k most likely tokens (weights sorted, descending)."""
    kept = torch.cat([weights[:k], torch.zeros(weights.shape[0] - k)])
    return kept / kept.sum()


# 99.9% quantiles of chi-square (scipy.stats.chi2.ppf(0.999, df)): a right sampler fails one
# run in a thousand; the draws are seeded, so a given run passes or fails every time
CHI2_999 = {1: 10.83, 2: 13.82, 4: 18.47}


@pytest.mark.parametrize(("params", "probs"), [
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=0.7), (LOGITS / 0.7).softmax(-1)),
    (SamplingParams(temperature=1.0, top_k=3), first(PROBS, 3)),
    (SamplingParams(temperature=1.0, top_p=0.85), first(PROBS, 3)),  # 0.5 + 0.3 < 0.85 <= + 0.1
    (SamplingParams(temperature=2.0, top_k=2), first(PROBS.sqrt(), 2)),  # p^(1/T), then the cut
])
def test_draws_pass_a_chi_square_test_against_the_distribution_the_settings_ask_for(params, probs) -> None:
    tokens = draws(params, 3000)
    df = int((probs > 0).sum()) - 1
    assert chi_square(tokens, probs) < CHI2_999[df]


def test_the_chi_square_test_catches_a_sampler_that_ignores_temperature() -> None:
    """The same 3000 draws against the untempered distribution: far outside its bound."""
    assert chi_square(draws(SamplingParams(temperature=0.7), 3000), PROBS) > 5 * CHI2_999[4]


def test_a_seeded_request_repeats_its_draws_step_after_step() -> None:
    """Two sequences with the same seed, each through 40 steps of its own: the same tokens,
    though the logits change every step (the generator advances once per step)."""
    steps = torch.randn(40, 1, 32)
    runs = []
    for _ in range(2):
        seq = states([SamplingParams(temperature=1.0, seed=1234)])
        runs.append([run(logits, seq).token_ids.item() for logits in steps])
    assert runs[0] == runs[1] and len(set(runs[0])) > 5


def midpoints(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token the portable draw gives `logits` [V] under `params` with a chance of
    1e-4 or more, the uniform draw in the middle of its share: (the tokens, the draws), in
    vocabulary order (a share that narrow lies far wider than any rounding's reach)."""
    t = sampling_tensors(states([params]), logits.shape[0], CPU)
    from pypto_serving.kernels.sampling import process_for_sampling

    probs = process_for_sampling(logits[None], t).softmax(dim=-1, dtype=torch.float64)[0]
    running = probs.cumsum(0)
    tokens = (probs / running[-1] >= 1e-4).nonzero()[:, 0]
    middle = (running[tokens] - probs[tokens] / 2) / running[-1]
    return tokens, middle


@needs_c
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=1.7, top_k=7),
    SamplingParams(temperature=0.8, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.02),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01),
    SamplingParams(temperature=1.0, top_k=500),  # more than the vocabulary
], ids=repr)
@pytest.mark.parametrize("vocab", [5, 100, 1003])
def test_the_c_draw_gives_the_portable_draws_token_for_each_share(params, vocab) -> None:
    """Every token the portable draw gives, at the draw in the middle of its share: the C draw
    keeps the same tokens with the same shares, in the same order (the two differ in rounding
    only)."""
    from pypto_serving.kernels.cpu.sampling import draw_cpu

    torch.manual_seed(vocab)
    logits = torch.randn(vocab) * 3
    logits[::9] = float("-inf")  # masked tokens (a grammar's) are never drawn
    tokens, middle = midpoints(logits, params)
    t = sampling_tensors(states([params] * len(tokens)), vocab, CPU)
    drawn = draw_cpu(logits.expand(len(tokens), -1), t, middle)
    assert drawn.tolist() == tokens.tolist()
    assert draw_portable(logits.expand(len(tokens), -1), t, middle).tolist() == tokens.tolist()


@pytest.mark.parametrize("cuts", [{}, {"top_p": 0.5}, {"top_k": 3, "min_p": 0.1}], ids=repr)
def test_a_row_with_nothing_to_weigh_gives_its_argmax_and_greedy_rows_theirs(cuts) -> None:
    """A NaN (the first NaN, as torch.argmax), every token masked (the first), one token left
    (that one), a +inf logit (the first +inf), and a greedy row in a sampled batch (its argmax)."""
    logits = torch.full((5, 20), float("-inf"))
    logits[0, 3:] = torch.randn(17)
    logits[0, 5] = float("nan")
    logits[2, 11] = 0.5
    logits[3] = torch.randn(20)
    logits[3, [8, 14]] = float("inf")
    logits[4] = torch.randn(20)
    rows = [SamplingParams(temperature=1.0, seed=i, **cuts) for i in range(4)] + [SamplingParams()]
    out = run(logits, states(rows)).token_ids.tolist()
    assert out == [5, 0, 11, 8, int(logits[4].argmax())]


def test_an_unbounded_temperature_draws_every_allowed_token_alike() -> None:
    """1e39 overflows float32: every unmasked token about as often, a masked one never."""
    logits = torch.tensor([5.0, float("-inf"), 0.0, -5.0])
    tokens = draws(SamplingParams(temperature=1e39), 3000, logits)
    assert chi_square(tokens, torch.tensor([1 / 3, 0.0, 1 / 3, 1 / 3])) < CHI2_999[2]


@needs_c
def test_the_c_token_mask_is_the_portable_one() -> None:
    """Rows 0 and 2 of 3 under a grammar, a vocabulary that ends inside a word: the same
    -inf, and the logits given are left as they were."""
    from pypto_serving.kernels.cpu.sampling import mask_tokens_cpu

    torch.manual_seed(3)
    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32)
    bitmask[1, 0] = -1  # a word that allows all
    rows = torch.tensor([0, 2])
    masked = mask_tokens_cpu(logits, rows, bitmask)
    assert torch.equal(masked, apply_token_bitmask(logits, rows, bitmask))
    assert torch.equal(logits, before) and masked.isinf().sum() > 20


def awkward_rows(vocab: int) -> torch.Tensor:
    """Rows of logits with what a log_softmax must get right: a spread, ties everywhere, -inf
    logits, fewer finite logits than a top-k asks for, a wide range."""
    torch.manual_seed(vocab)
    rows = torch.stack([torch.randn(vocab) * 4, torch.randint(0, 4, (vocab,)).float(), torch.randn(vocab),
                        torch.full((vocab,), float("-inf")), torch.randn(vocab) * 1e4])
    rows[2, ::2] = float("-inf")
    rows[3, vocab // 2] = 1.5
    rows[3, -1] = 0.5
    return rows


@needs_c
@pytest.mark.parametrize("vocab", [3, 70, 1003, 49155])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_the_c_logprobs_are_log_softmax_s_values_ranks_and_most_likely(vocab, k) -> None:
    from pypto_serving.kernels.cpu.sampling import logprobs_cpu

    logits, k = awkward_rows(vocab), min(k, vocab)
    chosen = torch.tensor([0, vocab // 3, 0, vocab - 1, vocab // 2])  # row 2's is a -inf logit
    got, want = logprobs_cpu(logits, chosen, k, True), token_logprobs(logits, chosen, k, True)
    torch.testing.assert_close(got.chosen, want.chosen, rtol=1e-6, atol=1e-5)
    assert got.chosen[2] == float("-inf")
    assert got.ranks.tolist() == want.ranks.tolist()
    assert got.ranks[1] == (logits[1] > logits[1, chosen[1]]).sum() + 1
    if k == 0:
        assert got.top_ids is None and got.top_values is None
        return
    torch.testing.assert_close(got.top_values, want.top_values, rtol=1e-6, atol=1e-5)
    lp = logits.log_softmax(-1)
    torch.testing.assert_close(lp.gather(1, got.top_ids), got.top_values, rtol=1e-6, atol=1e-5)
    for row in got.top_ids.tolist():
        assert len(set(row)) == k
    ties = got.top_ids[1][got.top_values[1] == got.top_values[1, -1]]
    assert ties.tolist() == sorted(ties.tolist())  # among equal values, the lower ids first
    assert got.top_ids[0].tolist() == want.top_ids[0].tolist()


@needs_c
def test_the_c_logprobs_of_a_row_without_a_finite_logit_are_torch_s_nan() -> None:
    from pypto_serving.kernels.cpu.sampling import logprobs_cpu

    logits = torch.randn(3, 300)
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    got = logprobs_cpu(logits, torch.tensor([1, 2, 3]), 4, True)
    assert got.chosen[1:].isnan().all() and got.top_values[1:].isnan().all()
    torch.testing.assert_close(got.chosen[0], logits[0].log_softmax(-1)[1])
    with pytest.raises(RuntimeError):  # more than the vocabulary: torch's error, not garbage
        logprobs_cpu(logits[:, :3], torch.tensor([0, 1, 2]), 4)
    with pytest.raises(RuntimeError):  # a token outside it: torch's error, not a read past the row
        logprobs_cpu(logits, torch.tensor([0, 300, 2]), 2)
