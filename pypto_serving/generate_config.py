"""Server-side sampling defaults (`--generate-config`) and how a request overrides them."""

from __future__ import annotations

from pathlib import Path

import msgspec


class GenerateConfigError(ValueError):
    pass


class GenerateDefaults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_new_tokens: int | None = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = []
    stream: bool = False
    ignore_eos: bool = False


def parse_generate_config(value: str | None) -> GenerateDefaults:
    """Inline JSON object, or `@path.json`; unknown keys and wrong types name the field."""
    if value is None:
        return GenerateDefaults()
    text = value
    if value.startswith("@"):
        try:
            text = Path(value[1:]).read_text()
        except OSError as exc:
            raise GenerateConfigError(f"cannot read {value[1:]!r}: {exc.strerror}") from None
    try:
        config = msgspec.json.decode(text, type=GenerateDefaults)
    except msgspec.ValidationError as exc:
        raise GenerateConfigError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise GenerateConfigError(f"not a JSON object: {exc}") from None
    _check(config)
    return config


def _check(config: GenerateDefaults) -> None:
    if config.max_new_tokens is not None and config.max_new_tokens < 1:
        raise GenerateConfigError("max_new_tokens must be a positive integer")
    if config.temperature < 0:
        raise GenerateConfigError("temperature must be >= 0")
    if not 0 < config.top_p <= 1:
        raise GenerateConfigError("top_p must be in (0, 1]")
    if config.top_k is not None and config.top_k < 1:
        raise GenerateConfigError("top_k must be a positive integer or null")
