"""Per-request sampling settings, as the device worker's sampler applies them."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    """What the sampler needs for one sequence. Stop conditions live in the main process.

    temperature 0 means greedy; top_k 0 means no top-k cut; logprobs None means none
    are returned, 0 means the chosen token's logprob only, k > 0 adds the top k.
    prompt_logprobs is the same for the prompt's tokens (each given the tokens before it).
    grammar is an llguidance grammar string (see pypto_serving/grammar.py); the sampler only
    picks tokens it accepts, and EOS once it is complete. None means unconstrained.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
