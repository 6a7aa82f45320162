"""One tokenizer interface over Hugging Face checkpoint directories and GGUF files.

A directory gives `tokenizer.json` (the `tokenizers` library) or else `tokenizer.model`
(SentencePiece), special tokens and the chat template from `tokenizer_config.json` (the
template may instead be in `chat_template.jinja` or `chat_template.json`), and extra
end-of-turn ids from `generation_config.json`. A GGUF file gives all of it in its metadata.
Encoding and chat rendering match transformers' `AutoTokenizer` on the same files.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from pypto_serving.loader.gguf_tokenizer import read_gguf_tokenizer
from pypto_serving.tokenizer.backends import Backend, HFBackend, SentencePieceBackend
from pypto_serving.tokenizer.chat_template import ChatTemplateError, render_chat_template

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Besides EOS, llama.cpp ends generation at any of these tokens (it matches them by text);
# a GGUF carries no generation_config.json to list them.
_GGUF_END_OF_TURN = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
        "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
    }
)  # fmt: skip


class TokenizerError(ValueError):
    """The tokenizer files are missing or unreadable."""


class Tokenizer:
    """Encode, decode and chat-format text for one model. Immutable after construction."""

    def __init__(
        self,
        backend: Backend,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._chat_templates = dict(chat_templates)
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        ends = {*extra_eos_ids, self.eos_token_id} - {None}
        self.eos_token_ids: frozenset[int] = frozenset(ends)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """From a checkpoint directory or a `.gguf` file."""
        path = Path(path)
        return cls.from_hf_dir(path) if path.is_dir() else cls.from_gguf(path)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_dir():
            raise TokenizerError(f"{path} is not a checkpoint directory")
        config = _read_json(path / "tokenizer_config.json")
        special = _special_tokens(config, _read_json(path / "special_tokens_map.json"))
        backend = _hf_backend(path, config, special)
        eos = _generation_eos_ids(_read_json(path / "generation_config.json"))
        return cls(backend, special, _hf_chat_templates(path, config), eos)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        if not Path(path).is_file():
            raise TokenizerError(f"GGUF file {path} does not exist")
        data = read_gguf_tokenizer(path)
        special = {"bos_token": data.bos_token, "eos_token": data.eos_token}
        special = {k: v for k, v in special.items() if v is not None}
        # The reader has already set the post-processor from the file's add_bos/add_eos flags.
        backend = HFBackend(data.tokenizer)
        templates = {"default": data.chat_template} if data.chat_template else {}
        return cls(backend, special, templates, _gguf_end_of_turn_ids(data.tokenizer, backend))

    # --- text <-> ids --------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS only where the model's files ask for them."""
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        tokens = [self._backend.id_to_token(i) for i in ids]
        if None in tokens:
            bad = ids[tokens.index(None)]
            raise TokenizerError(f"token id {bad} is outside the vocabulary of {self.vocab_size}")
        return tokens  # type: ignore[return-value]  # None was ruled out above

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Whether `decode(..., skip_special_tokens=True)` drops this id."""
        return self._backend.is_special(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.vocab_size

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most input characters one token can stand for (None: no such bound)."""
        return self._backend.max_token_chars()

    def tokenizers_json(self) -> str | None:
        """The tokenizer in the Hugging Face tokenizers JSON format (what grammar engines
        index the vocabulary from); None for SentencePiece-only checkpoints."""
        return self._backend.to_json() if isinstance(self._backend, HFBackend) else None

    # --- special tokens and chat ---------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def chat_template(self) -> str | None:
        return self._chat_templates.get("default")

    def use_chat_template(self, template: str) -> None:
        """`--chat-template`: this template for every chat, instead of the model's own."""
        self._chat_templates = {"default": template}

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`; `kwargs` are chat_template_kwargs."""
        template = chat_template or self._template_for(tools)
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self._special_tokens,
            **kwargs,
        )

    def _template_for(self, tools: object) -> str | None:
        # Named templates: transformers picks "tool_use" when tools are given, else "default".
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" not in self._chat_templates and self._chat_templates:
            names = ", ".join(sorted(self._chat_templates))
            raise ChatTemplateError(f"the model has several chat templates ({names}), no default")
        return self._chat_templates.get("default")

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


# --- Hugging Face directory ----------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc


def _token_text(value: object) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(config: Mapping[str, Any], legacy_map: Mapping[str, Any]) -> dict[str, str]:
    found = {name: _token_text(config.get(name, legacy_map.get(name))) for name in _SPECIAL_NAMES}
    return {name: text for name, text in found.items() if text is not None}


def _hf_backend(path: Path, config: Mapping[str, Any], special: Mapping[str, str]) -> Backend:
    if (path / "tokenizer.json").is_file():
        try:
            return HFBackend(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")))
        except Exception as exc:  # the Rust side raises a bare Exception on a malformed file
            raise TokenizerError(f"cannot read {path / 'tokenizer.json'}: {exc}") from exc
    if (path / "tokenizer.model").is_file():
        return _sentencepiece_backend(path / "tokenizer.model", config, special)
    raise TokenizerError(f"{path} has neither tokenizer.json nor tokenizer.model")


def _sentencepiece_backend(
    model_file: Path, config: Mapping[str, Any], special: Mapping[str, str]
) -> SentencePieceBackend:
    added = {
        int(i): (entry["content"], bool(entry.get("special", False)))
        for i, entry in config.get("added_tokens_decoder", {}).items()
    }
    # transformers' LlamaTokenizer defaults: BOS on, EOS off.
    flags = (bool(config.get("add_bos_token", True)), bool(config.get("add_eos_token", False)))
    bos_eos = (special.get("bos_token"), special.get("eos_token"))
    return SentencePieceBackend(model_file, added, bos_eos, flags, bool(config.get("legacy")))


def _hf_chat_templates(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    # transformers' order: chat_template.jinja (and additional_chat_templates/) over the config.
    templates = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    for extra in sorted((path / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text(encoding="utf-8")
    if templates:
        return templates
    source = config.get("chat_template")
    if source is None:
        source = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        return {entry["name"]: entry["template"] for entry in source}
    return {"default": source} if isinstance(source, str) else {}


def _generation_eos_ids(generation_config: Mapping[str, Any]) -> list[int]:
    ids = generation_config.get("eos_token_id")
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else [int(i) for i in ids]


# --- GGUF -----------------------------------------------------------------------------------


def _gguf_end_of_turn_ids(tok: tokenizers.Tokenizer, backend: HFBackend) -> list[int]:
    added = tok.get_added_tokens_decoder()
    return [i for i, t in added.items() if t.content in _GGUF_END_OF_TURN and backend.is_special(i)]
