"""Incremental detokenization: generated token ids in, newly readable text out.

The prefix/read offset window of vLLM and TGI: every step decodes a short window of recent
tokens twice, once up to the last emitted token (`prefix`) and once to the end, and emits the
difference. The prefix tokens give the new tokens their context (a SentencePiece token's
leading space survives only when it is not first), so each step costs O(window), not O(text).
A window whose text ends in U+FFFD stops at an incomplete UTF-8 sequence (a byte-level token
can hold part of a character): it is held until a later token completes it, or until `flush`.

Invariant: the concatenation of every `push` and the final `flush` equals
`tokenizer.decode(all generated ids, skip_special_tokens)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, piece by piece."""

    def __init__(
        self, tokenizer: _Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        # The prompt is deliberately not used as decode context: with it, the first generated
        # SentencePiece token would keep its leading space, and the text would no longer equal
        # the one-shot decode of the generated ids.
        del prompt_ids
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are settled and never decoded again
        self._read = 0  # tokens before it have been emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that `token_ids` (appended to those seen so far) make readable."""
        self._ids.extend(token_ids)
        prefix_text, full_text = self._window_texts()
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """The remaining text at the end of generation, incomplete characters included."""
        prefix_text, full_text = self._window_texts()
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix :]
        read = self._read - self._prefix
        decode = self._tokenizer.decode
        return (
            decode(window[:read], skip_special_tokens=self._skip_special),
            decode(window, skip_special_tokens=self._skip_special),
        )
