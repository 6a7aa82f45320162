"""Server-side sampling defaults (`--generate-config`).

An inline JSON object or `@path.json`. msgspec checks every key while decoding: an unknown key
or a wrong type or range stops startup with a message naming the field ("Expected `float`
>= 0.0 - at `$.temperature`"). How a request overrides these is in http/protocol.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

MAX_STOP_STRINGS = 32  # the same limits as a request's `stop`
MAX_STOP_LENGTH = 256

_StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LENGTH)]


class GenerateConfigError(ValueError):
    pass


class GenerateDefaults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_new_tokens: Annotated[int, Meta(ge=1)] | None = 256
    temperature: Annotated[float, Meta(ge=0.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # 0 and -1: no cut, as in a request
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Annotated[list[_StopString], Meta(max_length=MAX_STOP_STRINGS)] = []
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
        return msgspec.json.decode(text, type=GenerateDefaults)
    except msgspec.ValidationError as exc:
        raise GenerateConfigError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise GenerateConfigError(f"not a JSON object: {exc}") from None
