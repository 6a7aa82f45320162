"""The device worker's half of n-gram speculation (core/speculative.py has the proposals).

A sequence with k proposals has k + 1 sampled rows: after its last known token and after
each proposal. Each row is sampled as usual, on its own; the proposals are kept up to the
first that differs from the token sampled in its place, and that sampled token ends the
run. Kept tokens are therefore exactly what decoding one token at a time would have drawn.
"""

from __future__ import annotations

import torch

from pypto_serving.kernels.sampling import SamplerOutput
from pypto_serving.messages.worker import ScheduledSeq
from pypto_serving.worker.seq_state import SeqState


def row_states(seqs: list[ScheduledSeq], states: list[SeqState]) -> list[SeqState]:
    """The state of each sampled row, in the order of the step's sample rows."""
    return [st for s, st in zip(seqs, states, strict=True) if s.sample for _ in range(s.num_draft + 1)]


def verify(seqs: list[ScheduledSeq], states: list[SeqState], tokens: list[int]) -> list[int]:
    """The sampled rows to keep (`tokens`: one per row); each speculating sequence's state
    forgets the proposals it did not keep."""
    keep, row = [], 0
    for s, st in zip(seqs, states, strict=True):
        if not s.sample:
            continue
        k, known = s.num_draft, len(s.token_ids) - s.num_draft
        accepted = 0
        while accepted < k and tokens[row + accepted] == s.token_ids[known + accepted]:
            accepted += 1
        keep.extend(range(row, row + accepted + 1))
        if k:
            del st.token_ids[s.start_pos + known + accepted:]
        row += k + 1
    return keep


def kept(out: SamplerOutput, rows: list[int]) -> SamplerOutput:
    index = torch.tensor(rows, dtype=torch.int64, device=out.token_ids.device)

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index)

    return SamplerOutput(pick(out.token_ids), pick(out.logprobs), pick(out.top_ids), pick(out.top_logprobs))
