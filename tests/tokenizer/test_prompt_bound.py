"""The proof that a prompt is too long from its characters alone: sound (never more tokens
promised than a text has) for the byte-level BPE tokenizers it is used with, and withheld for
tokenizers that can drop or fold input characters."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from pypto_serving.tokenizer.backends import HFBackend
from pypto_serving.tokenizer.encode import PromptTooLong, encode_prompt


def wordlevel(pre) -> HFTokenizer:
    tok = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre
    return tok


def folding_bpe() -> HFTokenizer:
    return HFTokenizer(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True))


@pytest.mark.parametrize("tok", [
    wordlevel(pre_tokenizers.WhitespaceSplit()),
    wordlevel(pre_tokenizers.Split(",", "removed")),
    folding_bpe(),
    HFTokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
], ids=["whitespace-split", "split-removed", "bpe-fusing-unknowns", "wordpiece"])
def test_no_bound_for_tokenizers_that_drop_or_fold_characters(tok: HFTokenizer) -> None:
    assert HFBackend(tok).max_token_chars() is None


def test_no_bound_with_a_normalizer(smollm2_tokenizer) -> None:
    tok = HFTokenizer.from_str(smollm2_tokenizer.tokenizers_json())
    tok.normalizer = normalizers.NFC()
    assert HFBackend(tok).max_token_chars() is None


def test_the_bound_holds_for_byte_level_bpe(smollm2_tokenizer) -> None:
    per_token = smollm2_tokenizer.max_token_chars
    assert per_token is not None and per_token > 1
    rng = random.Random(0)
    pieces = ["    ", "\n\n\n", "-" * 40, " " * 200, "é", "日本語", "<|im_end|>", "word", "1234567",
              "\t\t", "😀", "=" * 100]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) >= -(-len(text) // per_token), text


def test_a_prompt_proved_too_long_is_refused_unencoded(smollm2_tokenizer, monkeypatch) -> None:
    per_token = smollm2_tokenizer.max_token_chars
    calls = []
    monkeypatch.setattr(smollm2_tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    with pytest.raises(PromptTooLong, match="at least 64 tokens"):
        encode_prompt(smollm2_tokenizer, "x" * (64 * per_token), None, 64)
    assert calls == []


def test_a_prompt_encoded_too_long_sends_no_ids(smollm2_tokenizer) -> None:
    with pytest.raises(PromptTooLong, match="the prompt has 9 tokens but --max-model-len is 8"):
        encode_prompt(smollm2_tokenizer, "one two three four five six seven eight nine", False, 8)


def test_byte_level_decoder_is_irrelevant_to_the_bound() -> None:
    tok = HFTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    assert HFBackend(tok).max_token_chars() == 2
