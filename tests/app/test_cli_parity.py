"""vLLM's common serve flags: a vLLM launch line parses, each flag means what it means there
(or says why it cannot apply here), every flag has help text, `--version` answers."""

from __future__ import annotations

import pytest

from pypto_serving.app.cli import REFUSED_VLLM_FLAGS, build_parser
from pypto_serving.app.launch import load_tokenizer
from pypto_serving.app.settings import FlagError, check_flags

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def smollm2(smollm2_source):
    return smollm2_source


def parse(*flags: str):
    return build_parser().parse_args(list(flags))


def test_every_flag_has_help_text() -> None:
    missing = [a.option_strings for a in build_parser()._actions if not a.help]
    assert missing == []


def test_version(capsys) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        parse("--version")
    printed = capsys.readouterr().out.strip()
    assert done.value.code == 0 and printed == f"pypto-serving {version('pypto-serving')}"


def test_a_vllm_launch_line_parses() -> None:
    args = parse("--model", "smollm2", "--chat-template", "{{ messages }}", "--enable-auto-tool-choice",
                 "--tool-call-parser", "hermes", "--seed", "0", "--trust-remote-code", "--disable-log-stats",
                 "--max-log-len", "100", "--uvicorn-log-level", "critical", "--enforce-eager")
    assert args.seed == 0 and args.log_level == "error" and args.enable_auto_tool_choice
    check_flags(args)
    assert parse().log_level == "info" and parse("--uvicorn-log-level", "trace").log_level == "debug"


@pytest.mark.parametrize("flag", sorted(REFUSED_VLLM_FLAGS))
def test_a_vllm_flag_that_cannot_apply_says_why(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        parse(flag, "x")
    err = capsys.readouterr().err
    assert done.value.code == 2 and REFUSED_VLLM_FLAGS[flag] in err and "unrecognized" not in err


def test_auto_tool_choice_needs_a_parser() -> None:
    with pytest.raises(FlagError, match="--enable-auto-tool-choice"):
        check_flags(parse("--enable-auto-tool-choice", "--tool-call-parser", "none"))


def test_chat_template_inline_or_from_a_file(smollm2, tmp_path) -> None:
    inline = load_tokenizer(parse("--chat-template", "[{% for m in messages %}{{ m.content }}{% endfor %}]"),
                            smollm2)
    assert inline.apply_chat_template(USER, add_generation_prompt=False) == "[Hi]"
    path = tmp_path / "t.jinja"
    path.write_text("<{{ messages[0].role }}>")
    assert load_tokenizer(parse("--chat-template", str(path)), smollm2).apply_chat_template(USER) == "<user>"
    own = load_tokenizer(parse(), smollm2).apply_chat_template(USER)
    assert own.startswith("<|im_start|>")  # the model's ChatML template without the flag
    with pytest.raises(FlagError, match="neither a file nor a Jinja template"):
        load_tokenizer(parse("--chat-template", str(tmp_path / "missing.jinja")), smollm2)


def test_tokenizer_from_another_file(smollm2, tmp_path) -> None:
    other = load_tokenizer(parse("--tokenizer", str(smollm2.path)), smollm2)
    assert other.encode("Hello") == load_tokenizer(parse(), smollm2).encode("Hello")
    with pytest.raises(FlagError, match="--tokenizer"):
        load_tokenizer(parse("--tokenizer", str(tmp_path / "nothing")), smollm2)
