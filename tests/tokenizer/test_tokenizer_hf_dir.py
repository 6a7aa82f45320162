"""`Tokenizer.from_hf_dir` on tiny checkpoints written here, against transformers' AutoTokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pypto_serving.tokenizer.chat_template import ChatTemplateError
from pypto_serving.tokenizer.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "Hello world",
    " leading space and  double  spaces ",
    "<s>specials</s> inside <|user|>text<|assistant|>",
    "Unicode: naïve café 你好 🙂👍🏽 e\u0301",
    "def add(a, b):\n    return a + b\n",
    "",
]
MESSAGES = [
    {"role": "user", "content": "Hello 🙂"},
    {"role": "assistant", "content": "Hi! 你好"},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="module", params=["byte_level_dir", "metaspace_dir"])
def pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, object]:
    directory = request.getfixturevalue(request.param)
    return Tokenizer.from_hf_dir(directory), AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(pair: tuple[Tokenizer, object], text: str) -> None:
    ours, theirs = pair
    ids = theirs(text)["input_ids"]  # type: ignore[operator]
    assert ours.encode(text) == ids
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)  # type: ignore[attr-defined]


def test_special_tokens_match_transformers(pair: tuple[Tokenizer, object]) -> None:
    ours, theirs = pair
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)  # type: ignore[attr-defined]
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)  # type: ignore[attr-defined]
    assert ours.vocab_size == len(theirs)  # type: ignore[arg-type]
    ids = ours.encode("Hello world")
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)  # type: ignore[attr-defined]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(byte_level_dir: Path, add_generation_prompt: bool) -> None:
    ours = Tokenizer.from_hf_dir(byte_level_dir)
    theirs = AutoTokenizer.from_pretrained(str(byte_level_dir))
    kwargs = {"add_generation_prompt": add_generation_prompt}
    text = ours.apply_chat_template(MESSAGES, **kwargs)
    assert text == theirs.apply_chat_template(MESSAGES, tokenize=False, **kwargs)
    want_ids = theirs.apply_chat_template(MESSAGES, return_dict=False, **kwargs)
    assert ours.encode(text, add_special_tokens=False) == want_ids


def test_generation_config_adds_end_of_turn_ids(byte_level_dir: Path) -> None:
    tok = Tokenizer.from_hf_dir(byte_level_dir)
    assert tok.eos_token_id == 1
    assert tok.eos_token_ids == frozenset({1, 3})


def write_config(directory: Path, **config: object) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def copy_dir(source: Path, target: Path, **config: object) -> Path:
    shutil.copytree(source, target)
    write_config(target, bos_token="<s>", eos_token="</s>", **config)
    return target


def test_chat_template_files_take_precedence_like_transformers(byte_level_dir: Path, tmp_path: Path) -> None:
    directory = copy_dir(byte_level_dir, tmp_path / "ckpt", chat_template="config")
    assert Tokenizer.from_hf_dir(directory).chat_template == "config"
    (directory / "chat_template.jinja").write_text("jinja {{ messages | length }}")
    tok = Tokenizer.from_hf_dir(directory)
    assert tok.chat_template == AutoTokenizer.from_pretrained(str(directory)).chat_template
    assert tok.apply_chat_template(MESSAGES) == "jinja 3"


def test_chat_template_json_is_read_when_nothing_else_has_one(byte_level_dir: Path, tmp_path: Path) -> None:
    directory = copy_dir(byte_level_dir, tmp_path / "ckpt")
    assert Tokenizer.from_hf_dir(directory).chat_template is None
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert Tokenizer.from_hf_dir(directory).apply_chat_template(MESSAGES) == "from json"


def test_named_templates_pick_tool_use_when_tools_are_given(byte_level_dir: Path, tmp_path: Path) -> None:
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    directory = copy_dir(byte_level_dir, tmp_path / "ckpt", chat_template=named)
    ours, theirs = Tokenizer.from_hf_dir(directory), AutoTokenizer.from_pretrained(str(directory))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}):
        assert ours.apply_chat_template(MESSAGES, **kwargs) == theirs.apply_chat_template(
            MESSAGES, tokenize=False, **kwargs
        )
    assert ours.apply_chat_template(MESSAGES, tools=tools) == "tools"


def test_no_chat_template_is_a_chat_template_error(metaspace_dir: Path) -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_hf_dir(metaspace_dir).apply_chat_template(MESSAGES)


def test_missing_tokenizer_files_are_named(tmp_path: Path) -> None:
    write_config(tmp_path, bos_token="<s>")
    with pytest.raises(TokenizerError, match="tokenizer.json nor tokenizer.model"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(TokenizerError, match="not a checkpoint directory"):
        Tokenizer.from_hf_dir(tmp_path / "absent")
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_out_of_vocabulary_id_is_a_tokenizer_error(byte_level_dir: Path) -> None:
    tok = Tokenizer.load(byte_level_dir)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([0, tok.vocab_size])


# --- SentencePiece tokenizer.model (transformers needs protobuf to read one, so no oracle) ---


def test_sentencepiece_specials_bos_and_added_tokens(sentencepiece_dir: Path) -> None:
    tok = Tokenizer.from_hf_dir(sentencepiece_dir)
    ids = tok.encode("Hi</s>there<|user|>x<tool>")
    assert ids[0] == tok.bos_token_id == tok.token_to_id("<s>")
    assert tok.eos_token_id in ids and 500 in ids and ids[-1] == 501
    assert tok.is_special(500) and not tok.is_special(501)
    # Only the text at the very start gets the dummy-prefix space (transformers' legacy=False).
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[1].startswith("\u2581") and pieces[ids.index(tok.eos_token_id) + 1] == "t"
    assert tok.decode(ids) == "Hithere" + "x<tool>"
    assert tok.decode(ids, skip_special_tokens=False) == "<s> Hi</s>there<|user|>x<tool>"


def test_sentencepiece_add_bos_token_false_is_honoured(sentencepiece_dir: Path, tmp_path: Path) -> None:
    shutil.copy(sentencepiece_dir / "tokenizer.model", tmp_path / "tokenizer.model")
    write_config(tmp_path, bos_token="<s>", eos_token="</s>", add_bos_token=False, add_eos_token=True)
    tok = Tokenizer.from_hf_dir(tmp_path)
    ids = tok.encode("Hello")
    assert ids[0] != tok.bos_token_id and ids[-1] == tok.eos_token_id


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.sampled_from(list("ab \n\tZ你🙂é\u0301<>|/s")), max_size=30))
def test_sentencepiece_round_trips_text(sentencepiece_dir: Path, text: str) -> None:
    tok = Tokenizer.from_hf_dir(sentencepiece_dir)
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
