"""What the worker remembers about each running sequence between steps."""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import msgspec
import torch

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.messages.worker import PLACEHOLDER, ScheduledSeq
from pypto_serving.worker.grammar import Grammars


@dataclass(slots=True)
class SeqState:
    block_table: list[int]
    token_ids: list[int]  # every token the scheduler has sent: prompt, then earlier outputs
    num_prompt_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None  # None for greedy sequences
    matcher: llguidance.LLMatcher | None = None  # None without a grammar; has consumed every output
    # prompt logprobs: the logits [1, V] of the last chunk's last row, which predicts the
    # next chunk's first token (worker/prompt_logprobs.py)
    held_prompt_row: torch.Tensor | None = None
    last_sampled: int | None = None  # what a PLACEHOLDER in its next chunk stands for

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def record_chunk(self, start_pos: int, token_ids: list[int]) -> None:
        """Tokens at start_pos.. replace whatever was there (a sampled token comes back here)."""
        if start_pos > len(self.token_ids):
            raise ValueError(f"chunk at {start_pos} leaves a gap after {len(self.token_ids)} tokens")
        del self.token_ids[start_pos:]
        self.token_ids.extend(token_ids)


def make_generator(params: SamplingParams, device: torch.device,
                   seeds: torch.Generator | None = None) -> torch.Generator | None:
    """One generator per sequence, seeded once; an unseeded request gets the next seed of
    `seeds` (`--seed`: a repeatable run), or a random one."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    elif seeds is not None:
        gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=seeds)))
    else:
        gen.seed()
    return gen


def apply_scheduled(
    states: dict[int, SeqState], s: ScheduledSeq, device: torch.device, grammars: Grammars | None = None,
    seeds: torch.Generator | None = None,
) -> SeqState:
    """Update (or, with `reset`, start) a sequence's state from its share of a step.

    A sequence with a grammar needs `grammars` (to build its matcher); `seeds`: see
    `make_generator`.
    """
    if s.reset:
        states[s.seq_id] = _restart(states.get(s.seq_id), s, device, grammars, seeds)
    else:
        states[s.seq_id].block_table.extend(s.new_block_ids)
    state = states[s.seq_id]
    state.record_chunk(s.start_pos, s.token_ids)
    return state


def resolve_placeholders(states: dict[int, SeqState], s: ScheduledSeq) -> ScheduledSeq:
    """`s` with its PLACEHOLDER (the token a plan made while the step before ran could not
    know) replaced by the token this worker sampled for the sequence in that step."""
    if PLACEHOLDER not in s.token_ids:
        return s
    state = states.get(s.seq_id)
    if s.reset or state is None or state.last_sampled is None or s.token_ids != [PLACEHOLDER]:
        raise ValueError(f"seq {s.seq_id}: a placeholder token with no sampled token to stand for")
    return msgspec.structs.replace(s, token_ids=[state.last_sampled])


def _restart(
    old: SeqState | None, s: ScheduledSeq, device: torch.device, grammars: Grammars | None,
    seeds: torch.Generator | None,
) -> SeqState:
    if s.sampling is None:
        raise ValueError(f"seq {s.seq_id}: reset without sampling params")
    if len(s.prefix_ids) != s.start_pos:
        raise ValueError(f"seq {s.seq_id}: {len(s.prefix_ids)} prefix ids, start_pos {s.start_pos}")
    # A preempted sequence being recomputed continues its random stream, and its matcher has
    # already consumed the outputs being recomputed.
    gen = old.generator if old is not None and old.generator is not None else None
    matcher = old.matcher if old is not None else None
    return SeqState(
        block_table=list(s.new_block_ids),
        token_ids=list(s.prefix_ids),
        num_prompt_tokens=s.num_prompt_tokens,
        sampling=s.sampling,
        generator=gen or make_generator(s.sampling, device, seeds),
        matcher=matcher if matcher is not None else make_matcher(s.sampling, grammars),
    )


def make_matcher(params: SamplingParams, grammars: Grammars | None) -> llguidance.LLMatcher | None:
    if params.grammar is None:
        return None
    if grammars is None:
        raise ValueError("a request has a grammar but this worker cannot build matchers")
    return grammars.matcher(params.grammar)
