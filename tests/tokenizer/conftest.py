"""Tokenizers for the tests: the two packaged GGUF models, and tiny ones trained here.

Everything is session-scoped: reading a GGUF vocabulary (and transformers' conversion of it,
the oracle) is the slow part of these tests, so each happens once.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import sentencepiece
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pypto_serving.app import packaged_models
from pypto_serving.tokenizer.tokenizer import Tokenizer

CORPUS = [
    "Hello world, this is a small test corpus.",
    "The quick brown fox jumps over the lazy dog.",
    "Unicode: héllo wörld, naïve café, 你好世界, こんにちは, 🙂👍🏽.",
    "def add(a, b):\n    return a + b\n",
] * 20
SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _packaged(path_fn: object) -> Path:
    try:
        return path_fn()  # type: ignore[operator]
    except packaged_models.PackagedModelMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _packaged(packaged_models.smollm2_path)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return _packaged(packaged_models.qwen_coder_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def qwen(qwen_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(qwen_path)


def write_config(directory: Path, **config: object) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def _train(tok: HFTokenizer) -> HFTokenizer:
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def byte_level_bpe() -> HFTokenizer:
    """A GPT-2 style tokenizer whose post-processor adds `<s>`."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok = _train(tok)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def metaspace_bpe() -> HFTokenizer:
    """A SentencePiece-style (`▁` for space, prefix space only at the start) tokenizer."""
    tok = HFTokenizer(models.BPE(unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    return _train(tok)


@pytest.fixture(scope="session")
def byte_level_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("byte_level")
    byte_level_bpe().save(str(directory / "tokenizer.json"))
    write_config(directory, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return directory


@pytest.fixture(scope="session")
def metaspace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("metaspace")
    metaspace_bpe().save(str(directory / "tokenizer.json"))
    write_config(
        directory, bos_token="<s>", eos_token={"__type": "AddedToken", "content": "</s>", "special": True}
    )
    return directory


def train_sentencepiece() -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=500,
        hard_vocab_limit=False,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.98,  # leaves the rarest characters to the <0xNN> byte pieces
        # Llama's settings: text is kept as is, runs of spaces included.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    return model.getvalue()


@pytest.fixture(scope="session")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sentencepiece")
    (directory / "tokenizer.model").write_bytes(train_sentencepiece())
    added = {"500": {"content": "<|user|>", "special": True}, "501": {"content": "<tool>", "special": False}}
    write_config(directory, bos_token="<s>", eos_token="</s>", unk_token="<unk>", added_tokens_decoder=added)
    return directory
