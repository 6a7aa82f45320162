"""The two tokenizer engines behind `Tokenizer`: the `tokenizers` library and SentencePiece.

Both give the same small surface (`Backend`), so `Tokenizer` does not care where a model's
vocabulary came from. The SentencePiece backend follows what transformers does with a
`tokenizer.model` (it converts it to a `tokenizers` pipeline): added and control tokens are
matched whole in the text, only the text at the very start gets SentencePiece's dummy-prefix
space (unless the config says `legacy`), and decoding joins pieces, turns `<0xNN>` pieces into
bytes and drops the one leading space the dummy prefix put there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import tokenizers

_SPACE = "\u2581"  # SentencePiece's visible space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Backend(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def token_to_id(self, token: str) -> int | None: ...

    def is_special(self, token_id: int) -> bool: ...

    def max_token_chars(self) -> int | None: ...


class HFBackend:
    """A `tokenizers.Tokenizer` (from tokenizer.json or built from GGUF metadata)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tok = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._special = frozenset(i for i, tok in added.items() if tok.special)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        return self._tok.to_str()

    def max_token_chars(self) -> int | None:
        """No token stands for more characters of input than this, so a text of C characters
        has at least C / this many tokens. Promised only for what keeps every input character
        in some token's text: no normalizer, pre-tokenizers that split without dropping
        (ByteLevel maps a character to one or more, Metaspace a space to one), a BPE model
        that never folds unknown characters into one token, no added token that strips
        whitespace. None otherwise (whitespace splitters, WordPiece, Unigram, ...)."""
        added = self._tok.get_added_tokens_decoder().values()
        spec = json.loads(self._tok.to_str())
        model = spec.get("model") or {}
        folds_unknown = model.get("unk_token") is not None and model.get("fuse_unk") \
            and not model.get("byte_fallback")
        if (spec.get("normalizer") is not None or model.get("type") != "BPE" or folds_unknown
                or not _keeps_every_char(spec.get("pre_tokenizer"))
                or any(t.lstrip or t.rstrip for t in added)):
            return None
        return max(len(self._tok.id_to_token(i) or "") for i in range(self.vocab_size))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special


_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation"})


def _keeps_every_char(pre: dict | None) -> bool:
    """A pre-tokenizer that splits the text without dropping any of it."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_every_char(p) for p in pre.get("pretokenizers", ()))
    if kind == "Split":
        return pre.get("behavior") != "Removed"
    if kind == "Punctuation":
        return pre.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


class SentencePieceBackend:
    """A SentencePiece `tokenizer.model` plus the added tokens of tokenizer_config.json."""

    def __init__(
        self,
        model_file: Path,
        added_tokens: Mapping[int, tuple[str, bool]],
        bos_eos: tuple[str | None, str | None],
        add_bos_eos: tuple[bool, bool],
        legacy: bool = False,
    ) -> None:
        import sentencepiece  # only SentencePiece models load it (a few MiB of resident memory)

        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        controls = {i: (self._sp.id_to_piece(i), True) for i in self._control_ids()}
        self._added = {**controls, **added_tokens}  # id -> (content, special)
        self._added_ids = {content: i for i, (content, _) in self._added.items()}
        self._split = _added_token_pattern(self._added_ids)
        self._add_bos, self._add_eos = add_bos_eos
        self._legacy = legacy
        # The ids SentencePiece produces for a bare "<unk>" string: a prefix we encode and then
        # cut off, so text after an added token gets no dummy-prefix space (transformers' trick).
        self._unk_text = self._sp.id_to_piece(self._sp.unk_id())
        self._unk_len = len(self._sp.encode(self._unk_text))
        self._bos, self._eos = (None if t is None else self.token_to_id(t) for t in bos_eos)

    def _control_ids(self) -> list[int]:
        size = self._sp.get_piece_size()
        return [i for i in range(size) if self._sp.is_control(i) or self._sp.is_unknown(i)]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        for index, part in enumerate(self._split.split(text) if self._split else [text]):
            if index % 2:  # odd parts are the captured added tokens
                ids.append(self._added_ids[part])
            elif part:
                ids.extend(self._encode_text(part, at_start=index == 0))
        if add_special_tokens:
            ids = self._with_bos_eos(ids)
        return ids

    def _encode_text(self, text: str, at_start: bool) -> list[int]:
        if at_start or self._legacy:
            return self._sp.encode(text)
        return self._sp.encode(self._unk_text + text)[self._unk_len :]

    def _with_bos_eos(self, ids: list[int]) -> list[int]:
        bos = [self._bos] if self._add_bos and self._bos is not None else []
        eos = [self._eos] if self._add_eos and self._eos is not None else []
        return bos + ids + eos

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        out = bytearray()
        for token_id in ids:
            if token_id in self._added:
                content, special = self._added[token_id]
                if not (special and skip_special_tokens):
                    out += content.encode()
            elif 0 <= token_id < self._sp.get_piece_size():  # unknown ids vanish, as in `tokenizers`
                out += self._piece_bytes(token_id)
        text = out.decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self._sp.id_to_piece(token_id)
        if self._sp.is_byte(token_id) and (match := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(match.group(1), 16)])
        return piece.replace(_SPACE, " ").encode()

    @property
    def vocab_size(self) -> int:
        return max(self._sp.get_piece_size(), max(self._added, default=-1) + 1)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added:
            return self._added[token_id][0]
        if 0 <= token_id < self._sp.get_piece_size():
            return self._sp.id_to_piece(token_id)
        return None

    def token_to_id(self, token: str) -> int | None:
        if token in self._added_ids:
            return self._added_ids[token]
        token_id = self._sp.piece_to_id(token)
        return None if token_id == self._sp.unk_id() and token != self._unk_text else token_id

    def is_special(self, token_id: int) -> bool:
        return self._added.get(token_id, ("", False))[1]

    def max_token_chars(self) -> None:
        """No bound: SentencePiece's normalizer may fold runs of whitespace."""
        return None


def _added_token_pattern(tokens: Mapping[str, int]) -> re.Pattern[str] | None:
    # Longest first, so a token wins over the tokens it contains.
    alternatives = sorted(tokens, key=len, reverse=True)
    if not alternatives:
        return None
    return re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
