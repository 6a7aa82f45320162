"""Tokenizers built from GGUF metadata encode and decode as transformers' GGUF tokenizer does:
the two packaged byte-level BPE models, and a SentencePiece vocabulary written here."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pypto_serving.app.packaged_models import qwen_coder_path, smollm2_path
from pypto_serving.loader.errors import UnsupportedModel
from pypto_serving.loader.gguf_tokenizer import GGUFTokenizerData, read_gguf_tokenizer
from tests.oracles import transformers_tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "tabs\tand\nnewlines\n\n  indented\r\n",
    "   ",
    "",
    "numbers 3.14159 1,000,000 -42 2024",
    "def f(x):\n    return x ** 2  # square\n",
    "I'm sure you're right; we've SEEN it",
    "emoji 😀🎉 and CJK 你好，世界 and ÀÉÎõü ß",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "text<|endoftext|>more",
]


# --- the packaged byte-level BPE models ---------------------------------------------------


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5-coder"])
def pair(request: pytest.FixtureRequest) -> tuple[GGUFTokenizerData, object]:
    """(ours, transformers') for one packaged model."""
    path = smollm2_path() if request.param == "smollm2" else qwen_coder_path()
    return read_gguf_tokenizer(path), transformers_tokenizer(path)



@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair: tuple, add_special_tokens: bool) -> None:
    ours, theirs = pair
    for text in TEXTS:
        expected = theirs.encode(text, add_special_tokens=add_special_tokens)
        assert ours.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair: tuple, skip_special_tokens: bool) -> None:
    ours, theirs = pair
    for text in TEXTS:
        ids = theirs.encode(text)
        expected = theirs.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text


def test_special_token_fields_match_transformers(pair: tuple) -> None:
    ours, theirs = pair
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert (ours.add_bos_token, ours.add_eos_token) == (False, False)
    assert ours.chat_template == theirs.chat_template
    assert "<|im_start|>" in ours.chat_template


def test_smollm2_splits_digits_like_llama_cpp() -> None:
    """llama.cpp's `smollm` pre-tokenizer (and the model's own tokenizer.json) splits every
    digit off first, so the two spaces before a digit become one "ĠĠ" token. transformers'
    GGUF loader skips that split and gives "Ġ", "Ġ" here: a known difference."""
    tokenizer = read_gguf_tokenizer(smollm2_path()).tokenizer
    expected = [tokenizer.token_to_id(t) for t in ["x", "ĠĠ", "1", "2"]]
    assert tokenizer.encode("x  12").ids == expected


def test_chat_markers_are_single_ids_and_tool_tags_survive_decoding() -> None:
    data = read_gguf_tokenizer(qwen_coder_path())
    ids = data.tokenizer.encode("<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>").ids
    assert ids[0] == 151644 and ids[-1] == data.eos_token_id == 151645
    assert 151657 in ids and 151658 in ids  # <tool_call>, </tool_call>: user-defined, one id each
    # user-defined tokens are not special: the tool-call parser needs them in the text
    assert data.tokenizer.decode(ids) == "assistant\n<tool_call>{}</tool_call>"


# --- the packaged Gemma 3: a real SentencePiece ("llama") vocabulary of 262k pieces ------------


def test_gemma3_encodes_and_decodes_as_transformers(gemma3_gguf: str, hf_gemma3_tokenizer: object) -> None:
    ours = read_gguf_tokenizer(Path(gemma3_gguf))
    theirs = hf_gemma3_tokenizer
    turn = "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    for text in [*TEXTS, turn]:
        ids = theirs.encode(text)
        assert ours.tokenizer.encode(text).ids == ids, text
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    assert ours.tokenizer.encode(turn, add_special_tokens=False).ids[0] == theirs.convert_tokens_to_ids(
        "<start_of_turn>")
    assert ours.chat_template is None  # a base model: its GGUF carries no template


# --- a SentencePiece ("llama") vocabulary -------------------------------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Beautiful is better than ugly. Explicit is better than implicit.",
    "Simple is better than complex. Complex is better than complicated.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Readability counts. Special cases are not special enough to break the rules.",
] * 3
SPM_TEXTS = [
    "Hello world",
    "the better fox",
    " leading space",
    "  two spaces",
    "tabs\tand\nnewlines",
    "",
    "emoji 😀 and CJK 你好",
    "<s>inside</s> text",
    "ZZZ qqq",
]


def write_sentencepiece_gguf(path: Path, **flags: bool) -> Path:
    """A llama-arch GGUF whose vocabulary is BPE learned on CORPUS, laid out as llama.cpp
    writes SentencePiece models: <unk>, <s>, </s>, 256 byte tokens, pieces scored by rank."""
    learned = _learned_pieces()
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *learned]
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 8)]:
        writer.add_uint32(f"llama.{key}", value)
    for key, value in [("feed_forward_length", 16), ("attention.head_count", 2)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(learned))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(learned))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for key, value in flags.items():
        writer.add_bool(f"tokenizer.ggml.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return path


def _learned_pieces() -> list[str]:
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    learner.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    return [token for token, _ in sorted(learner.get_vocab().items(), key=lambda item: item[1])]


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[GGUFTokenizerData, object]:
    from transformers import AutoTokenizer

    path = write_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
    return read_gguf_tokenizer(path), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_sentencepiece_encode_matches_transformers(spm_pair: tuple, add_special_tokens: bool) -> None:
    ours, theirs = spm_pair
    for text in SPM_TEXTS:
        expected = theirs.encode(text, add_special_tokens=add_special_tokens)
        assert ours.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_decode_matches_transformers(spm_pair: tuple, skip_special_tokens: bool) -> None:
    ours, theirs = spm_pair
    for text in SPM_TEXTS:
        ids = theirs.encode(text)
        expected = theirs.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text


def test_sentencepiece_adds_bos_by_default_and_falls_back_to_bytes(spm_pair: tuple) -> None:
    ours, _ = spm_pair
    assert (ours.add_bos_token, ours.bos_token, ours.eos_token) == (True, "<s>", "</s>")
    encoding = ours.tokenizer.encode("ZZZ 你")
    assert encoding.ids[0] == 1
    assert encoding.tokens[-3:] == ["<0xE4>", "<0xBD>", "<0xA0>"]  # 你 is not in the vocabulary


def test_sentencepiece_flags_control_prefix_space_and_eos(tmp_path: Path) -> None:
    """transformers ignores add_space_prefix; llama.cpp honours it, and so do we."""
    path = write_sentencepiece_gguf(tmp_path / "f.gguf", add_space_prefix=False, add_eos_token=True)
    data = read_gguf_tokenizer(path)
    encoding = data.tokenizer.encode("better fox")
    assert not encoding.tokens[1].startswith("▁") and encoding.tokens[-1] == "</s>"
    assert data.tokenizer.decode(encoding.ids) == "better fox"


def test_unknown_tokenizer_model_is_rejected(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "bert.gguf", "llama")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[CLS]", "a"])
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    with pytest.raises(UnsupportedModel, match=r"'bert'.*gpt2, llama"):
        read_gguf_tokenizer(tmp_path / "bert.gguf")


def test_recovered_merges_are_cached_per_vocabulary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SentencePiece vocabulary's merges are recovered once (Gemma 3's 262k pieces take
    ~1.6 s): the next load reads them back and builds the same tokenizer; a damaged entry is
    recovered and written again."""
    from pypto_serving.loader import gguf_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []
    recover = gguf_tokenizer._recover_merges
    monkeypatch.setattr(gguf_tokenizer, "_recover_merges", lambda *a: calls.append(1) or recover(*a))
    path = write_sentencepiece_gguf(tmp_path / "spm.gguf")
    first = read_gguf_tokenizer(path).tokenizer.to_str()
    assert read_gguf_tokenizer(path).tokenizer.to_str() == first
    assert len(calls) == 1
    (entry,) = gguf_tokenizer.merges_cache_dir().iterdir()
    for damage in (b'[["a lone piece"]]', b"\x00 not json", b"{}"):
        entry.write_bytes(damage)
        assert read_gguf_tokenizer(path).tokenizer.to_str() == first
    assert len(calls) == 4
    assert read_gguf_tokenizer(path).tokenizer.to_str() == first  # rewritten whole
    assert len(calls) == 4


def test_merges_cache_keys_on_pieces_and_scores_and_may_be_unwritable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pypto_serving.loader import gguf_tokenizer

    digest = gguf_tokenizer._vocabulary_digest
    assert digest(["a", "b", "ab"], [0.0, -1.0, -2.0]) != digest(["a", "b", "ab"], [0.0, -1.0, -3.0])
    assert digest(["a", "b", "ab"], [0.0, -1.0, -2.0]) != digest(["a", "c", "ac"], [0.0, -1.0, -2.0])
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache cannot be created
    path = write_sentencepiece_gguf(tmp_path / "spm.gguf")
    assert read_gguf_tokenizer(path).tokenizer.encode("the better fox").ids[0] == 1
