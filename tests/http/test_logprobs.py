"""Token text and exact bytes for logprobs, on the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest

from pypto_serving.tokenizer.logprobs import token_text
from pypto_serving.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.mark.parametrize("text", [" Paris café", "ok 🦩 你好", "<|im_end|>"])
def test_token_bytes_concatenate_to_the_text(smollm2: Tokenizer, text: str):
    ids = smollm2.encode(text, add_special_tokens=False)
    assert b"".join(token_text(smollm2, i)[1] for i in ids) == text.encode()


def test_a_split_character_shows_in_text_but_not_in_bytes(smollm2: Tokenizer):
    ids = smollm2.encode(" 🦩", add_special_tokens=False)
    assert len(ids) > 1
    first_text, first_bytes = token_text(smollm2, ids[0])
    assert "\ufffd" in first_text and b"\xef\xbf\xbd" not in first_bytes
