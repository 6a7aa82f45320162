"""Speculative decoding without a draft model: n-gram proposals (vLLM's `ngram` method,
also called prompt lookup) from the sequence's own prompt and output.

Pure: no torch or I/O. The scheduler keeps one `NgramIndex` per sequence that can speculate.
At each decode step the longest suffix of the sequence's tokens (at most `prompt_lookup_max`,
at least `prompt_lookup_min` tokens) that occurred before proposes the tokens that followed
its latest earlier occurrence. The step then computes the last token and the k proposed ones
together; the device worker samples a token after each of them as usual and keeps the
proposals up to the first one it did not sample itself, plus that sampled token. Each kept
token is what plain decoding would have drawn there (for greedy the same token; for sampling
a draw from the same distribution), so speculation changes speed, never the text's law.

Sequences whose next tokens depend on more than the logits of their own position (penalties,
grammars, min_tokens still masking EOS) do not speculate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pypto_serving.core.sampling_params import SamplingParams

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
LOOKUP_MIN, LOOKUP_MAX = 2, 5  # the n-gram lengths matched when the flag names neither
# A prompt is indexed from its last LOOKBACK tokens: indexing runs on the scheduler's event
# loop at admission (~0.5 us per token and n-gram length).
LOOKBACK = 4096


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int = LOOKUP_MIN
    prompt_lookup_max: int = LOOKUP_MAX
    disable_by_batch_size: int | None = None  # no proposals while this many sequences run


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config` as vLLM spells it: a JSON object with `method` "ngram",
    `num_speculative_tokens`, `prompt_lookup_min/max` and `disable_by_batch_size`."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    raw = dict(raw)
    method = raw.pop("method", None)
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not supported; supported: "
                         f"{', '.join(METHODS)} (no draft model is needed)")
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--speculative-config: unknown key {unknown[0]!r}; known: method, "
                         f"{', '.join(sorted(known))}")
    if "num_speculative_tokens" not in raw:
        raise ValueError("--speculative-config needs num_speculative_tokens")
    lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if lo is not None and hi is None:
        raw["prompt_lookup_max"] = max(lo, LOOKUP_MAX) if type(lo) is int else lo
    if hi is not None and lo is None:
        raw["prompt_lookup_min"] = min(hi, LOOKUP_MIN) if type(hi) is int else hi
    config = SpeculativeConfig(**raw)
    _check(config)
    return config


def _check(c: SpeculativeConfig) -> None:
    def whole(name: str, value: object, lo: int, hi: int) -> None:
        if type(value) is not int or not lo <= value <= hi:
            raise ValueError(f"--speculative-config: {name} must be an integer in {lo}..{hi}, "
                             f"not {value!r}")

    whole("num_speculative_tokens", c.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
    whole("prompt_lookup_min", c.prompt_lookup_min, 1, 64)
    whole("prompt_lookup_max", c.prompt_lookup_max, c.prompt_lookup_min, 64)
    if c.disable_by_batch_size is not None:
        whole("disable_by_batch_size", c.disable_by_batch_size, 1, 1 << 20)


def can_speculate(sampling: SamplingParams) -> bool:
    """Whether a sequence's token at a position depends only on that position's logits."""
    p = sampling
    return (p.grammar is None and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and p.repetition_penalty == 1.0)


class NgramIndex:
    """Where each n-gram (lo <= n <= hi) of a token sequence last ended, kept as tokens come,
    and the continuation of the longest one that ends the sequence and occurred before."""

    __slots__ = ("lo", "hi", "tokens", "_ends", "_match")

    def __init__(self, lo: int, hi: int, tokens: tuple[int, ...] | list[int] = ()) -> None:
        self.lo, self.hi = lo, hi
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}
        self._match: int | None = None  # where the continuation of the current suffix starts
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        tokens, ends = self.tokens, self._ends
        tokens.append(token)
        end, match = len(tokens), None
        for n in range(min(self.hi, end), self.lo - 1, -1):
            key = tuple(tokens[end - n:])
            before = ends.get(key)
            if match is None and before is not None:
                match = before  # the longest n-gram seen before wins
            ends[key] = end
        self._match = match

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix."""
        if self._match is None or k <= 0:
            return []
        return self.tokens[self._match:self._match + k]
