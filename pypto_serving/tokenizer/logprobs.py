"""Per-token logprobs as typed values: the sampler's numbers plus each token's text and bytes.

A byte-level BPE token can hold part of a UTF-8 character, so decoding it alone shows U+FFFD.
Its exact bytes then come from its spelling: GPT-2's byte-to-unicode alphabet, or a
SentencePiece `<0xNN>` byte piece. Concatenated, a response's token bytes are its text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from pypto_serving.core.request import Candidate, PromptLogprob, TokenLogprob
from pypto_serving.messages.worker import TopLogprob
from pypto_serving.tokenizer.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@functools.lru_cache(maxsize=1 << 16)
def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    """(the token decoded alone, special tokens kept; its exact UTF-8 bytes)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text, text.encode()
    piece = tokenizer.convert_ids_to_tokens([token_id])[0]
    if match := _BYTE_PIECE.fullmatch(piece):
        return text, bytes([int(match.group(1), 16)])
    decoder = _byte_decoder()
    if all(c in decoder for c in piece):
        return text, bytes(decoder[c] for c in piece)
    return text, text.encode()


def candidate(tokenizer: Tokenizer, token_id: int, logprob: float) -> Candidate:
    text, utf8 = token_text(tokenizer, token_id)
    return Candidate(token_id, text, utf8, logprob)


def token_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[float],
                   tops: Sequence[Sequence[TopLogprob]]) -> tuple[TokenLogprob, ...]:
    """One entry per generated token; `tops` may be shorter (no top-k asked)."""
    out = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        top = tops[i] if i < len(tops) else ()
        out.append(TokenLogprob(candidate(tokenizer, token_id, logprob),
                                tuple(candidate(tokenizer, t.token_id, t.logprob) for t in top)))
    return tuple(out)


def prompt_logprobs(tokenizer: Tokenizer, prompt_ids: Sequence[int],
                    scores: Sequence[tuple[float, int, Sequence[TopLogprob]]]) -> tuple[PromptLogprob, ...]:
    """One entry per prompt token; `scores` are those of tokens 1, 2, ... (the first has none)."""
    out = []
    for i, token_id in enumerate(prompt_ids):
        text, utf8 = token_text(tokenizer, token_id)
        if i == 0 or i > len(scores):
            out.append(PromptLogprob(token_id, text, utf8, None, None))
            continue
        logprob, rank, top = scores[i - 1]
        out.append(PromptLogprob(token_id, text, utf8, logprob, rank,
                                 tuple(candidate(tokenizer, t.token_id, t.logprob) for t in top)))
    return tuple(out)
