"""Incremental detokenization equals one-shot decoding and never shows a broken character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pypto_serving.tokenizer.detokenizer import IncrementalDetokenizer
from pypto_serving.tokenizer.tokenizer import Tokenizer

FFFD = "\ufffd"
# Multi-byte characters that byte-level BPE splits over several tokens: emoji (with skin tone
# and ZWJ sequences), CJK, combining marks, and some ASCII and whitespace between them.
PIECES = [
    "a", "Z", " ", "  ", "\n", "\t", ".", "'", "0", "Hello", " world", "é", "e\u0301", "n\u0303",
    "\u0928\u093f", "你", "好", "世界", "こんにちは", "한", "🙂", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷",
    "\U0001f9ea", "Ω", "√", "\u200b", "\ufffd",
]  # fmt: skip


@pytest.fixture(scope="session", params=["smollm2", "qwen", "metaspace", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    match request.param:
        case "metaspace":
            return Tokenizer.from_hf_dir(request.getfixturevalue("metaspace_dir"))
        case "sentencepiece":
            return Tokenizer.from_hf_dir(request.getfixturevalue("sentencepiece_dir"))
    return request.getfixturevalue(request.param)


@st.composite
def generated_ids(draw: st.DrawFn, tok: Tokenizer) -> list[int]:
    """Ids of a random text, with some random ids (stray bytes, special tokens) mixed in."""
    text = "".join(draw(st.lists(st.sampled_from(PIECES), max_size=25)))
    ids = tok.encode(text, add_special_tokens=False)
    extras = st.integers(0, tok.vocab_size - 1) | st.sampled_from(sorted(tok.eos_token_ids))
    for _ in range(draw(st.integers(0, 3))):
        ids.insert(draw(st.integers(0, len(ids))), draw(extras))
    return ids


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip_special=st.booleans())
def test_streamed_text_equals_one_shot_decode(
    tokenizer: Tokenizer, data: st.DataObject, skip_special: bool
) -> None:
    ids = data.draw(generated_ids(tokenizer))
    chunks = chunked(ids, data.draw(st.lists(st.integers(0, 10_000), max_size=len(ids))))
    final = tokenizer.decode(ids, skip_special_tokens=skip_special)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[1, 2, 3], skip_special_tokens=skip_special)
    emitted, seen = "", []
    for chunk in chunks:
        emitted += detok.push(chunk)
        seen += chunk
        now = tokenizer.decode(seen, skip_special_tokens=skip_special)
        # Nothing shown ever changes later (so no U+FFFD stands in for a split character)...
        assert final.startswith(emitted)
        assert now.startswith(emitted)
        # ...and only an unfinished character is held back.
        held = now[len(emitted) :]
        assert held == "" or held.endswith(FFFD), (held, now)
    assert emitted + detok.flush() == final
    assert detok.flush() == ""


def test_split_emoji_is_held_until_complete(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("ok 🦩", add_special_tokens=False)
    assert len(ids) == 4  # "ok", then the emoji's four bytes over three tokens
    detok = IncrementalDetokenizer(smollm2, prompt_ids=[])
    outputs = [detok.push([i]) for i in ids]
    assert all(FFFD not in out for out in outputs)
    assert outputs == ["ok", "", "", " 🦩"]


def test_incomplete_character_at_the_end_is_flushed_as_decode_shows_it(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("🦩", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(smollm2, prompt_ids=[])
    assert detok.push(ids) == ""
    assert detok.flush() == smollm2.decode(ids) != ""


def test_sentencepiece_leading_space_matches_one_shot(sentencepiece_dir: object) -> None:
    tok = Tokenizer.from_hf_dir(sentencepiece_dir)  # type: ignore[arg-type]
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[0].startswith("\u2581")
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Say:"))
    assert [detok.push([i]) for i in ids] == ["Hello", " world"]


def test_skipped_special_tokens_keep_the_following_space(sentencepiece_dir: object) -> None:
    tok = Tokenizer.from_hf_dir(sentencepiece_dir)  # type: ignore[arg-type]
    ids = tok.encode("Hello world", add_special_tokens=False)
    ids.insert(1, tok.token_to_id("<|user|>"))  # type: ignore[arg-type]
    detok = IncrementalDetokenizer(tok, prompt_ids=[])
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == "Hello world"
