"""The tokenizer a GGUF file describes in its metadata, built with the `tokenizers` library.

Two vocabularies exist: `gpt2` (byte-level BPE with merges; the split regex depends on
`tokenizer.ggml.pre`) and `llama` (SentencePiece BPE: `▁` for spaces, byte fallback, merges
recovered from the token scores). The result encodes and decodes as `transformers` does when
it loads the same file (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`); the one place we
differ on purpose is noted at `_DIGITS_FIRST`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.processors import TemplateProcessing

from pypto_serving.loader.errors import UnsupportedModel
from pypto_serving.loader.gguf_reader import read_gguf
from pypto_serving.process.cache_dirs import cache_dir

log = structlog.get_logger()
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# Bump when _merges_from_scores changes what it returns: cached merges of older code are unused.
MERGES_VERSION = 1
_NAMED_SPECIAL = ("bos", "eos", "unknown", "padding")  # tokenizer.ggml.{name}_token_id

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
}
# These vocabularies were trained with every digit split off before the GPT-2 regex (the
# models' own tokenizer.json has `Digits(individual_digits=True)`; llama.cpp splits `\p{N}`
# first). transformers' GGUF loader omits the digit split, so "a  1" differs from it.
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")


@dataclass(frozen=True, slots=True)
class GGUFTokenizerData:
    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizerData:
    return tokenizer_from_metadata(read_gguf(path).metadata)


def tokenizer_from_metadata(meta: dict[str, Any]) -> GGUFTokenizerData:
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise UnsupportedModel(
            f"GGUF tokenizer model {kind!r} is not supported; supported: {', '.join(builders)}"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    tokenizer = builders[kind](meta)
    _register_added_tokens(tokenizer, meta)
    tokenizer.post_processor = _post_processor(tokens, bos if add_bos else None, eos if add_eos else None)
    return GGUFTokenizerData(
        tokenizer=tokenizer,
        bos_token_id=bos,
        eos_token_id=eos,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos] if eos is not None else None,
    )


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    vocab = _byte_level_vocab(meta["tokenizer.ggml.tokens"], _token_types(meta))
    merges = _file_merges(meta)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """Vocabulary keys in the byte alphabet. Control and user-defined tokens keep their
    spelling: they are matched whole in the raw text, before any byte mapping."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    return vocab


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_FIRST:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    split = _SPLITS.get(pre)
    if split is None:  # "default", "gpt2", or one we do not know: GPT-2's own regex
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelling = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in spelling)
    spelling.update({b: chr(256 + n) for n, b in enumerate(others)})
    return spelling


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.merges" in meta:
        merges = _file_merges(meta)
    else:
        merges = _merges_from_scores(tokens, meta["tokenizer.ggml.scores"])
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    _set_metaspace(tokenizer, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    return tokenizer


def _set_metaspace(tokenizer: Tokenizer, add_space_prefix: bool) -> None:
    scheme = "first" if add_space_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the space the encoder prepended is not part of the text
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """`_recover_merges`, kept on disk under the vocabulary's digest: for Gemma 3's 262k pieces
    the recovery takes ~1.6 s of a start, reading them back ~0.2 s. A missing, unreadable or
    malformed entry is recovered (and written) again; an unwritable cache only costs the time."""
    path = merges_cache_dir() / f"{_vocabulary_digest(tokens, scores)}.json"
    try:
        merges = orjson.loads(path.read_bytes())
        if isinstance(merges, list) and all(
                isinstance(m, list) and len(m) == 2 and isinstance(m[0], str) and isinstance(m[1], str)
                for m in merges):
            return [(left, right) for left, right in merges]
    except (OSError, orjson.JSONDecodeError):
        pass
    merges = _recover_merges(tokens, scores)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
            try:
                tmp.write(orjson.dumps(merges))
            except OSError:
                os.unlink(tmp.name)
                raise
        os.replace(tmp.name, path)  # whole or not at all, whoever else writes it
    except OSError as exc:
        log.warning("could not cache the tokenizer's merges", path=str(path), error=str(exc))
    return merges


def merges_cache_dir() -> Path:
    return cache_dir("tokenizers")


def _vocabulary_digest(tokens: list[str], scores: list[float]) -> str:
    data = orjson.dumps([MERGES_VERSION, tokens, scores], option=orjson.OPT_SERIALIZE_NUMPY)
    return hashlib.sha256(data).hexdigest()[:32]


def _recover_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files carry no merges: every split of a token into two vocabulary
    pieces is a merge, ranked by the whole token's score (the order transformers uses)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    found = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [
            (token[:k], token[k:], score)
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        found += sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))
    found.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _file_merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]


def _token_types(meta: dict[str, Any]) -> list[int]:
    count = len(meta["tokenizer.ggml.tokens"])
    return meta.get("tokenizer.ggml.token_type") or [1] * count


def _register_added_tokens(tokenizer: Tokenizer, meta: dict[str, Any]) -> None:
    """Control tokens (and the named bos/eos/unk/pad) become special tokens, user-defined
    ones plain added tokens; both are then matched whole, so `<|im_start|>` is one id."""
    named = {meta.get(f"tokenizer.ggml.{name}_token_id") for name in _NAMED_SPECIAL}
    special, added = [], []
    for index, (token, kind) in enumerate(
        zip(meta["tokenizer.ggml.tokens"], _token_types(meta), strict=True)
    ):
        if kind == _CONTROL or index in named:
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(added)


def _post_processor(tokens: list[str], bos: int | None, eos: int | None) -> TemplateProcessing | None:
    """Adds BOS/EOS around the text when `encode(..., add_special_tokens=True)`."""
    if bos is None and eos is None:
        return None
    ends = [(tokens[i], i) for i in (bos, eos) if i is not None]
    single = [*([tokens[bos]] if bos is not None else []), "$A"]
    single += [tokens[eos]] if eos is not None else []
    return TemplateProcessing(single=single, special_tokens=ends)
