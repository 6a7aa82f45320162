"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

A chunk's hidden rows at positions p predict the tokens at p + 1. Those inside the chunk are
scored as the chunk runs; the chunk's last row predicts the next chunk's first token, which
the worker has not seen yet, so its logits wait in the sequence's state until that chunk
comes. The logits go through the same lm_head as sampling, in pieces of `PIECE_ROWS` rows (a
2,048-token prompt over a 150K vocabulary would be 1.2 GB of float32 at once), and are scored
by the backend's `Logprobs` kernel, as sampled tokens' logprobs are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pypto_serving.kernels.sampling import Logprobs
from pypto_serving.messages.worker import PromptLogprobs, ScheduledSeq, TopLogprob
from pypto_serving.worker.seq_state import SeqState

PIECE_ROWS = 256
Logits = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, H] -> logits [N, V]


def _scores_prompt(s: ScheduledSeq, st: SeqState) -> bool:
    """`s`'s chunk covers prompt tokens and its sequence asked for their logprobs."""
    return st.sampling.prompt_logprobs is not None and s.start_pos < st.num_prompt_tokens


def wants_prompt_logprobs(seqs: list[ScheduledSeq], states: list[SeqState]) -> bool:
    """Whether score_prompts reads hidden states of this step (any chunk's rows)."""
    return any(_scores_prompt(s, st) for s, st in zip(seqs, states, strict=True))


def score_prompts(seqs: list[ScheduledSeq], states: list[SeqState], hidden: torch.Tensor,
                  logits: Logits, kernel: Logprobs) -> list[PromptLogprobs]:
    """The prompt logprobs this step's chunks give (none when no chunk of a sequence that
    asked covers prompt tokens); `hidden` has every row of the step."""
    out, begin = [], 0
    for s, st in zip(seqs, states, strict=True):
        n = len(s.token_ids)
        if _scores_prompt(s, st):
            scored = _score_chunk(s, st, hidden[begin:begin + n], logits, kernel)
            if scored is not None:
                out.append(scored)
        begin += n
    return out


def _score_chunk(s: ScheduledSeq, st: SeqState, hidden: torch.Tensor, logits: Logits,
                 kernel: Logprobs) -> PromptLogprobs | None:
    start, n, prompt_len = s.start_pos, len(s.token_ids), st.num_prompt_tokens
    rows = min(n, prompt_len - start - 1)  # row r predicts the token at start + r + 1
    held, st.held_prompt_row = st.held_prompt_row, None
    scores = _Scores(s.seq_id, start if held is not None else start + 1, st.sampling.prompt_logprobs, kernel)
    if held is not None:  # the last chunk's last row predicts this chunk's first token
        scores.add(held, st.token_ids[start:start + 1])
    for i in range(0, rows, PIECE_ROWS):
        end = min(i + PIECE_ROWS, rows)
        piece = logits(hidden[i:end]).float()
        if end == n and start + n < prompt_len:  # its last row waits for the next chunk
            st.held_prompt_row, piece = piece[-1:].clone(), piece[:-1]
        scores.add(piece, st.token_ids[start + i + 1:start + i + 1 + piece.shape[0]])
    return scores.result() if scores.logprobs else None


class _Scores:
    """One chunk's scores, gathered piece by piece (only the small results are kept)."""

    def __init__(self, seq_id: int, first: int, k: int, kernel: Logprobs) -> None:
        self.seq_id, self.first, self.k, self.kernel = seq_id, first, k, kernel
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top: list[list[TopLogprob]] = []

    def add(self, logits: torch.Tensor, targets: list[int]) -> None:
        """Scores `targets`, the tokens that logits' rows [len(targets), V] predict."""
        if not targets:
            return
        tokens = torch.tensor(targets, dtype=torch.int64, device=logits.device)
        scored = self.kernel(logits, tokens, self.k, True)
        self.logprobs += scored.chosen.tolist()
        self.ranks += scored.ranks.tolist()
        if self.k == 0:
            self.top += [[] for _ in targets]
            return
        self.top += [[TopLogprob(t, v) for t, v in zip(ti, vi, strict=True)]
                     for ti, vi in zip(scored.top_ids.tolist(), scored.top_values.tolist(), strict=True)]

    def result(self) -> PromptLogprobs:
        return PromptLogprobs(self.seq_id, self.first, self.logprobs, self.ranks, self.top)
