"""Chat template features that real model templates rely on."""

from __future__ import annotations

import dataclasses
from datetime import datetime

import pytest

from pypto_serving.tokenizer.chat_template import (
    ChatTemplateError,
    compile_template,
    render_chat_template,
)

USER = [{"role": "user", "content": "hi"}]


def render(template: str, messages: list[dict] = USER, /, **kwargs: object) -> str:
    return render_chat_template(template, messages, **kwargs)


def test_loop_controls_break_and_continue() -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }};{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    )
    messages = [{"role": "system", "content": "s"}] + [{"role": "user", "content": str(i)} for i in range(5)]
    assert render(template, messages) == "0;1;"


def test_raise_exception_becomes_chat_template_error_with_the_message() -> None:
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}"
    with pytest.raises(ChatTemplateError) as info:
        render(template)
    assert str(info.value) == "System first!"
    assert isinstance(info.value, ValueError)


def test_tojson_keeps_non_ascii_and_takes_json_dumps_options() -> None:
    tools = [{"name": "météo", "description": "天气 🌦", "b": 1, "a": [1, 2]}]
    plain = render("{{ tools[0] | tojson }}", tools=tools)
    assert plain == '{"name": "météo", "description": "天气 🌦", "b": 1, "a": [1, 2]}'
    sorted_ = render("{{ tools[0] | tojson(sort_keys=True, separators=(',', ':')) }}", tools=tools)
    assert sorted_ == '{"a":[1,2],"b":1,"description":"天气 🌦","name":"météo"}'
    assert render("{{ tools[0].a | tojson(indent=2) }}", tools=tools) == "[\n  1,\n  2\n]"


def test_tojson_does_not_html_escape() -> None:
    assert render("{{ '<a & b>' | tojson }}") == '"<a & b>"'


def test_strftime_now_renders_the_current_date() -> None:
    before = datetime.now().strftime("%Y-%m-%d")
    out = render("{{ strftime_now('%Y-%m-%d') }}")
    assert out in {before, datetime.now().strftime("%Y-%m-%d")}


def test_extra_kwargs_and_special_tokens_reach_the_template() -> None:
    template = "{{ bos_token }}{% if enable_thinking is false %}/no_think{% endif %}{{ eos_token }}"
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    assert render(template, special_tokens=specials, enable_thinking=False) == "<s>/no_think</s>"
    assert render(template, special_tokens=specials) == "<s></s>"
    # A kwarg overrides a special token of the same name, as in transformers.
    assert render(template, special_tokens=specials, bos_token="[B]") == "[B]</s>"


def test_add_generation_prompt_and_block_trimming() -> None:
    template = (
        "  {% for m in messages %}\n"
        "<{{ m.role }}>{{ m.content }}\n"
        "  {% endfor %}\n"
        "    {% if add_generation_prompt %}\n"
        "<assistant>\n"
        "\t{% endif %}"
    )
    assert render(template, add_generation_prompt=True) == "<user>hi\n<assistant>\n"
    assert render(template, add_generation_prompt=False) == "<user>hi\n"


def test_none_fields_are_dropped_but_content_and_reasoning_is_aliased() -> None:
    """A null field is dropped, except content, which templates without tool support
    concatenate unconditionally: it renders as "" (vLLM's rendering of an assistant turn that
    only called tools)."""
    template = ("{% for m in messages %}{{ m.name is defined }}|{{ m.content is defined }}:{{ m.content }}|"
                "{{ m.reasoning_content }}{% endfor %}")
    messages = [{"role": "assistant", "content": None, "name": None, "reasoning": "because"}]
    assert render(template, messages) == "False|True:|because"
    concatenating = "{% for m in messages %}{{ '<' + m.role + '>' + m.content }}{% endfor %}"
    assert render(concatenating, messages) == "<assistant>"


def test_dataclass_and_enum_values_are_plain_data_to_the_template() -> None:
    @dataclasses.dataclass
    class Call:
        name: str

    messages = [{"role": "assistant", "tool_calls": [Call("f")], "content": ""}]
    assert render("{{ messages[0].tool_calls[0] | tojson }}", messages) == '{"name": "f"}'


def test_reserved_names_in_kwargs_are_rejected() -> None:
    # chat_template_kwargs come from the request; they must not replace the conversation.
    with pytest.raises(ChatTemplateError, match="messages"):
        render("x", **{"messages": USER})
    with pytest.raises(ChatTemplateError, match="documents"):
        render("x", documents=[])


def test_sandbox_blocks_python_internals() -> None:
    with pytest.raises(ChatTemplateError):
        render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        render("{% set ns = namespace(_x=1) %}")
    with pytest.raises(ChatTemplateError):  # immutable sandbox: no mutating the inputs
        render("{{ messages.append(1) }}")


def test_render_errors_are_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="syntax"):
        render("{% for %}")
    with pytest.raises(ChatTemplateError):
        render("{{ messages[0].content + 1 }}")
    with pytest.raises(ChatTemplateError, match="at least one"):
        render("x", [])


def test_missing_template_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat_template(None, USER)


def test_templates_are_compiled_once() -> None:
    source = "{{ messages | length }} compiled-once"
    assert compile_template(source) is compile_template(source)


def test_namespace_and_dict_work_as_in_qwen3_style_templates() -> None:
    template = (
        "{% set ns = namespace(last_user=-1) %}{% for m in messages %}"
        "{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
        "{{ ns.last_user }} {{ dict(a=1) | tojson }}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2
    assert render(template, messages) == '2 {"a": 1}'
