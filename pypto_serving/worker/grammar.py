"""Grammar-constrained sampling on the worker: one llguidance matcher per constrained sequence.

Before sampling, each constrained row's matcher fills one row of a token bitmask (bit set =
its grammar accepts that token next); the sampler masks the other tokens to -inf. After
sampling, each matcher consumes its row's token. A complete grammar allows only EOS, so the
sequence ends by sampling it. A matcher in error (or with nothing left to allow) lets its row
sample EOS only, with a warning, rather than failing the step.
"""

from __future__ import annotations

import llguidance
import llguidance.numpy  # not llguidance.torch: importing it loads torch.compile (~120 MiB)
import structlog
import torch

log = structlog.get_logger()


class Grammars:
    """The model's vocabulary as llguidance sees it, built on first use (~1.5 s for 150k
    tokens) and kept for the worker's life; makes one matcher per constrained sequence."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher; an invalid grammar gives a matcher in error, not an exception."""
        # log_level 0: llguidance would print warnings to stderr; `bitmask` logs them instead.
        return llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)

    @property
    def eos_token_id(self) -> int:
        """The configured EOS, else the one llguidance found in the tokenizer."""
        return self._llg_tokenizer().eos_token

    def bitmask(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """[R, ceil(V / 32)] int32 on the CPU: row i's allowed next tokens for matchers[i]."""
        array = llguidance.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row, matcher in enumerate(matchers):
            llguidance.numpy.fill_next_token_bitmask(matcher, array, row)
        mask = torch.from_numpy(array)
        empty = (~mask.any(dim=1)).tolist()
        for row, matcher in enumerate(matchers):
            if empty[row] or matcher.is_error():
                self._eos_only(mask, row, matcher)
        return mask

    def _eos_only(self, mask: torch.Tensor, row: int, matcher: llguidance.LLMatcher) -> None:
        log.warning("grammar cannot continue; ending the sequence with EOS",
                    error=matcher.get_error() or "no token allowed")
        eos = self.eos_token_id
        mask[row] = 0
        mask[row, eos // 32] = _bit(eos % 32)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if not self._tokenizer_json:
                raise ValueError("a request has a grammar but the device worker has no tokenizer "
                                 "(WorkerConfig.tokenizer_json is empty); constrained decoding "
                                 "needs the model's Hugging Face tokenizer JSON")
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self._eos_token_id)
        return self._tokenizer


def advance(matchers: list[llguidance.LLMatcher | None], token_ids: list[int]) -> None:
    """Each constrained row's matcher consumes the token sampled for it."""
    for matcher, token in zip(matchers, token_ids, strict=True):
        if matcher is not None and not matcher.is_error():
            matcher.consume_token(token)  # a refused token leaves it in error: EOS next step


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as a Python int torch accepts (bit 31 is negative)."""
    return (1 << index) - (1 << 32 if index == 31 else 0)
