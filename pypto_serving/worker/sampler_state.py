"""Per-step sampling tensors from the sampled sequences' settings and token histories.

Each optional tensor is built only when some row of the step needs it.
"""

from __future__ import annotations

from array import array
from itertools import chain

import torch

from pypto_serving.kernels.sampling import SamplingTensors
from pypto_serving.worker.grammar import Grammars
from pypto_serving.worker.seq_state import SeqState

# Above this every token's chance is the same to a few parts in a thousand; an infinite
# temperature (float32 overflows from 3.4e38) would turn masked tokens' -inf into NaN.
MAX_TEMPERATURE = 1e4


def sampling_tensors(
    states: list[SeqState], vocab_size: int, device: torch.device, grammars: Grammars | None = None
) -> SamplingTensors:
    """Rows aligned with `states` (the sequences sampled this step, in plan order).

    `grammars` fills the token masks of rows with a matcher (needed when some row has one).
    """
    params = [s.sampling for s in states]
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingTensors(
        temperature=_f32([min(p.temperature, MAX_TEMPERATURE) for p in params], device),
        generators=[s.generator for s in states],
        all_greedy=all(p.greedy for p in params),
        top_k=_unless_all([p.top_k for p in params], 0, torch.int64, device),
        top_p=_unless_all([p.top_p for p in params], 1.0, torch.float32, device),
        min_p=_unless_all([p.min_p for p in params], 0.0, torch.float32, device),
        **_penalties(states, vocab_size, device),
        **_grammar_masks(states, grammars, device),
        banned=_banned_eos(states, vocab_size, device),
        logprobs=bool(asked),
        top_logprobs=max(asked, default=0),
    )


def _unless_all(
    values: list[float] | list[int], noop: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """The rows' values, or None when every row has the no-op value (skip that step)."""
    if all(v == noop for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def _penalties(states: list[SeqState], vocab_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    params = [s.sampling for s in states]
    if not any(_has_penalty(s) for s in states):
        return {}
    return dict(
        presence=_f32([p.presence_penalty for p in params], device),
        frequency=_f32([p.frequency_penalty for p in params], device),
        repetition=_f32([p.repetition_penalty for p in params], device),
        **_penalised([s.prompt_ids for s in states], [s.output_ids for s in states], vocab_size, device),
    )


def _penalised(prompts: list[list[int]], outputs: list[list[int]], vocab_size: int,
               device: torch.device) -> dict[str, torch.Tensor]:
    """SamplingTensors' seen, counted and counts, from each row's prompt and output ids."""
    made = _flat(outputs, vocab_size)
    counted, counts = made.unique(return_counts=True)
    return dict(seen=torch.cat([_flat(prompts, vocab_size), made]).unique().to(device),
                counted=counted.to(device), counts=counts.float().to(device))


def _has_penalty(state: SeqState) -> bool:
    p = state.sampling
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _grammar_masks(
    states: list[SeqState], grammars: Grammars | None, device: torch.device
) -> dict[str, torch.Tensor]:
    rows = [i for i, s in enumerate(states) if s.matcher is not None]
    if not rows:
        return {}
    bitmask = grammars.bitmask([states[i].matcher for i in rows])
    return dict(grammar_rows=_ints(rows, device), grammar_bitmask=bitmask.to(device))


def _banned_eos(states: list[SeqState], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """EOS ids of rows that have not yet produced min_tokens tokens.

    Not for rows under a grammar: it decides when they end (and may allow only EOS).
    """
    rows = [
        [eos for eos in s.sampling.eos_token_ids if eos < vocab_size]
        if s.num_output_tokens < s.sampling.min_tokens and s.matcher is None
        else []
        for s in states
    ]
    if not any(rows):
        return None
    return _flat(rows, vocab_size).unique().to(device)


def _flat(rows: list[list[int]], vocab_size: int) -> torch.Tensor:
    """[N] int64 row * vocab_size + id of each id of each row, in order (on the host)."""
    ids = array("q", chain.from_iterable(rows))  # torch.tensor of a list takes ~70 ns an id
    if not ids:
        return torch.empty(0, dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(r) for r in rows]))
    return row * vocab_size + torch.frombuffer(ids, dtype=torch.int64)


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _f32(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
