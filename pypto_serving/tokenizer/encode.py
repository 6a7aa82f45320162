"""A prompt to token ids: the chat template, a cheap proof of "too long", the encoding.

Pure and synchronous: the tokenizer actor runs it in a thread for ordinary prompts and in
the encoder process (encoder_process.py) for big ones.
"""

from __future__ import annotations

from pypto_serving.core.request import ChatInput
from pypto_serving.tokenizer.tokenizer import Tokenizer


class PromptTooLong(ValueError):
    """The prompt's characters alone prove it has more tokens than fit the context."""


def encode_prompt(tokenizer: Tokenizer, prompt: str | ChatInput, add_special_tokens: bool | None,
                  max_model_len: int | None) -> tuple[str, list[int]]:
    """(the text the model reads, its token ids); special tokens by default for a prompt,
    not for a chat (the template already wrote any BOS it wants). With `max_model_len`, a
    text whose length proves it too long is refused before it is encoded."""
    if isinstance(prompt, str):
        text, special = prompt, True if add_special_tokens is None else add_special_tokens
    else:
        text = tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=prompt.add_generation_prompt,
            tools=list(prompt.tools) if prompt.tools else None, **prompt.template_kwargs)
        special = bool(add_special_tokens)
    _check_length(tokenizer, text, max_model_len)
    ids = tokenizer.encode(text, add_special_tokens=special)
    if max_model_len is not None and len(ids) >= max_model_len:  # not millions of ids sent on
        raise PromptTooLong(too_long_message(len(ids), max_model_len))
    return text, ids


def too_long_message(tokens: int, max_model_len: int) -> str:
    return (f"the prompt has {tokens} tokens but --max-model-len is {max_model_len}: shorten "
            f"the prompt to at most {max_model_len - 1} tokens")


def _check_length(tokenizer: Tokenizer, text: str, max_model_len: int | None) -> None:
    per_token = tokenizer.max_token_chars
    if max_model_len is None or per_token is None:
        return
    at_least = -(-len(text) // per_token)
    if at_least >= max_model_len:
        raise PromptTooLong(
            f"the prompt has {len(text)} characters, so at least {at_least} tokens, but "
            f"--max-model-len is {max_model_len}: shorten the prompt")


def prompt_chars(prompt: str | ChatInput) -> int:
    """About how many characters the prompt will render to: its text, or its messages'."""
    if isinstance(prompt, str):
        return len(prompt)
    total = len(repr(prompt.tools)) if prompt.tools else 0
    for message in prompt.messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return total
