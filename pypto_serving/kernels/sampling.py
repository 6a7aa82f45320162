"""Batched sampler: one row of logits per sampled sequence.

Order (as vLLM v1): grammar mask -> min_tokens EOS mask -> penalties -> greedy argmax, or
temperature -> min-p -> top-k/top-p -> one draw. Each sampled row draws one uniform number a
step from its own `torch.Generator`, so a seeded row gives the same tokens alone or in any
batch; the token is the first whose running sum of kept probabilities passes it (inverse
transform sampling: one random number a row, where noise for every token cost ~1 ms a row of
a 49152-token vocabulary on the CPU). A backend may bring its own `Draw` (the CPU's is in C).
Logprobs are those of the model's raw logits (log_softmax before any processing, the grammar
mask included): a constrained token's logprob is what the model gave it, unconstrained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Argmax = Callable[[torch.Tensor], torch.Tensor]  # [B, V] -> [B] int64, torch.argmax's answer


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """One step's sampling settings, rows aligned with the logits. None = not used this step."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    generators: list[torch.Generator | None]  # [B], None for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] int64, 0 = no cut
    top_p: torch.Tensor | None = None  # [B] float32
    min_p: torch.Tensor | None = None  # [B] float32
    presence: torch.Tensor | None = None  # [B] float32 (penalties: all three or none)
    frequency: torch.Tensor | None = None  # [B] float32
    repetition: torch.Tensor | None = None  # [B] float32
    # The penalised and banned tokens, as indices row * V + token into the flattened logits
    # (a few per row: dense [B, V] tables cost a batch-16 step milliseconds to build and apply)
    seen: torch.Tensor | None = None  # [S] int64: each token of a row's prompt or output, once
    counted: torch.Tensor | None = None  # [O] int64: each token a row generated, once
    counts: torch.Tensor | None = None  # [O] float32: how many times it did
    banned: torch.Tensor | None = None  # [N] int64: EOS before min_tokens
    grammar_rows: torch.Tensor | None = None  # [R] int64: the rows under a grammar
    grammar_bitmask: torch.Tensor | None = None  # [R, ceil(V / 32)] int32: bit set = allowed
    logprobs: bool = False  # compute the chosen tokens' logprobs
    top_logprobs: int = 0  # the largest top-k any row asked for


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] chosen token's logprob
    top_ids: torch.Tensor | None  # [B, k]
    top_logprobs: torch.Tensor | None  # [B, k]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """What the logprobs fields report of rows of raw logits (`Logprobs`)."""

    chosen: torch.Tensor  # [N] float32: each row's chosen token's log-probability
    ranks: torch.Tensor | None  # [N] int64: 1 + the tokens with a larger logit (when asked)
    top_ids: torch.Tensor | None  # [N, k] int64: the k most likely, descending (None: k = 0)
    top_values: torch.Tensor | None  # [N, k] float32: their log-probabilities


Logprobs = Callable[[torch.Tensor, torch.Tensor, int, bool], TokenLogprobs]
"""(raw logits [N, V] float32, the chosen tokens [N] int64, k <= V, whether to rank) ->
`TokenLogprobs`, as `token_logprobs`"""


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int, ranks: bool = False) -> TokenLogprobs:
    """log_softmax's values for the chosen tokens and the k most likely (portable); a rank
    counts the tokens whose logit is larger (a log_softmax value can round two of them equal)."""
    lp = logits.log_softmax(dim=-1)
    column = chosen.unsqueeze(1)
    rank = (logits > logits.gather(1, column)).sum(dim=1) + 1 if ranks else None
    top_values, top_ids = lp.topk(k, dim=-1) if k else (None, None)
    return TokenLogprobs(lp.gather(1, column).squeeze(1), rank, top_ids, top_values)


Draw = Callable[[torch.Tensor, SamplingTensors, torch.Tensor], torch.Tensor]
"""(the logits after masks and penalties [B, V] float32, the settings, a uniform draw in
[0, 1) per row [B], `SamplerKernels.precision`) -> [B] int64, as `draw_portable`; rows
whose temperature is 0 may answer anything (`sample` takes their argmax)"""


def argmax_only(t: SamplingTensors) -> bool:
    """Whether every row's token is its raw logits' argmax, and nothing else is wanted of them
    (greedy, no mask, no penalty, no logprobs)."""
    return (t.all_greedy and t.grammar_rows is None and t.banned is None and t.repetition is None
            and not t.logprobs)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (portable)."""
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, t: SamplingTensors, kernels: SamplerKernels | None = None) -> SamplerOutput:
    """logits [B, V] -> one token per row (plus logprobs when asked), with the backend's
    `kernels` (default: the portable ones)."""
    kernels = kernels or PORTABLE_SAMPLER
    logits = logits.float()
    raw = logits
    if t.grammar_rows is not None:
        logits = kernels.mask(logits, t.grammar_rows, t.grammar_bitmask)
    if t.banned is not None:
        logits = logits.reshape(-1).index_fill(0, t.banned, float("-inf")).view_as(logits)
    if t.repetition is not None:
        logits = apply_penalties(logits, t)
    tokens = kernels.argmax(logits)
    if not t.all_greedy:
        sampled = kernels.draw(logits, t, uniforms(t.generators, logits.device, kernels.precision))
        tokens = torch.where(t.temperature > 0, sampled, tokens)
    if not t.logprobs:
        return SamplerOutput(tokens, None, None, None)
    lp = kernels.logprobs(raw, tokens, t.top_logprobs, False)
    return SamplerOutput(tokens, lp.chosen, lp.top_ids, lp.top_values)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Tokens whose bit is clear get -inf in `rows`; other rows are left as they are.

    bitmask [R, ceil(V / 32)] int32: token j's bit is bit j % 32 of word j // 32 (llguidance's
    layout). Plain torch ops: llguidance's own torch.compile'd kernel costs seconds on first use.
    """
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition (prompt + output, HF/vLLM rule), then OpenAI frequency and presence, on the
    tokens they touch only."""
    vocab = logits.shape[1]
    out = logits.reshape(-1).clone()
    picked = out[t.seen]
    rep = t.repetition[t.seen // vocab]
    out[t.seen] = torch.where(picked > 0, picked / rep, picked * rep)
    rows = t.counted // vocab
    out[t.counted] -= t.frequency[rows] * t.counts
    out[t.counted] -= t.presence[rows]
    return out.view_as(logits)


def process_for_sampling(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature, then the cuts; removed tokens get -inf."""
    temp = torch.where(t.temperature > 0, t.temperature, 1.0)
    logits = logits / temp.unsqueeze(1)
    if t.min_p is not None:
        logits = apply_min_p(logits, t.min_p)
    if t.top_k is not None or t.top_p is not None:
        logits = apply_top_k_top_p(logits, t.top_k, t.top_p)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's k most likely tokens, then the smallest set reaching mass top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        rank = torch.arange(logits.shape[1], device=logits.device)
        k = torch.where(top_k > 0, top_k, logits.shape[1])
        sorted_logits = sorted_logits.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before a token; the token that crosses top_p stays.
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(before > top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def uniforms(generators: list[torch.Generator | None], device: torch.device,
             dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[B] `dtype` on `device`: a draw in [0, 1) from each row's generator (0 for greedy rows)."""
    draws = [torch.rand((), dtype=dtype, generator=g, device=g.device) if g is not None
             else torch.zeros((), dtype=dtype, device=device) for g in generators]
    return torch.stack([d.to(device) for d in draws])


def draw_portable(logits: torch.Tensor, t: SamplingTensors, u: torch.Tensor) -> torch.Tensor:
    """One token per row from its processed distribution: the first whose running sum of
    probabilities passes u times their total (u [B] in [0, 1)). A row with nothing to weigh
    (a NaN or +inf logit, or every token removed) takes its argmax, as the greedy path would."""
    processed = process_for_sampling(logits, t)
    probs = processed.softmax(dim=-1, dtype=u.dtype)  # the running sums in the draws' precision
    running = probs.cumsum(dim=-1)
    target = (u * running[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(running, target, right=True).squeeze(1).clamp_max(logits.shape[1] - 1)
    nothing = ~running[:, -1].isfinite()  # a NaN or +inf logit, or every token removed
    return torch.where(nothing, logits.argmax(dim=-1), tokens)


Mask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits [B, V], rows [R], bitmask [R, ceil(V / 32)]) -> a copy with the rows' disallowed
tokens at -inf, as `apply_token_bitmask`"""


@dataclass(frozen=True, slots=True)
class SamplerKernels:
    """What `sample` runs where a backend has faster kernels than torch's."""

    argmax: Argmax = greedy  # greedy rows
    draw: Draw = draw_portable  # the others
    mask: Mask = apply_token_bitmask  # grammars' token masks
    logprobs: Logprobs = token_logprobs  # the logprobs fields, sampled rows' and prompts'
    # The draws' and the portable draw's running sums' type: float64 on the host (a sequential
    # float32 sum over a vocabulary can drift by ~1e-5 of the total); an accelerator's scans
    # sum in a tree, and [B, V] float64 tensors would double a step's transient memory there.
    precision: torch.dtype = torch.float64


PORTABLE_SAMPLER = SamplerKernels()
