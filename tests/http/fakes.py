"""Stand-ins around real RequestStreams: a letters tokenizer, a recording scheduler, an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pypto_serving.actors.request import RequestLimits, RequestStream
from pypto_serving.core.request import Finished, GenerateRequest, Started, TextDelta

EOS = 2


class Letters:
    """A tokenizer stand-in: token i is the letter chr(97 + i % 26); EOS is special."""

    vocab_size = 100
    bos_token_id = 1
    eos_token_ids = frozenset({EOS})

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if i == EOS and skip_special_tokens else chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(97 + i % 26) for i in ids]


class Recorder:
    """The scheduler's side: remembers what request actors tell it."""

    def __init__(self) -> None:
        self.messages: list[object] = []

    def tell(self, msg: object) -> None:
        self.messages.append(msg)

    def of(self, kind: type) -> list:
        return [m for m in self.messages if isinstance(m, kind)]


class FakeEngine:
    def __init__(self) -> None:
        self.scheduler = Recorder()
        self.seq_ids = iter(range(100))

    def generate(self, request: GenerateRequest) -> AsyncIterator[Started | TextDelta | Finished]:
        actor = RequestStream(request, next(self.seq_ids), Letters(), None, self.scheduler,
                             RequestLimits(max_model_len=64, default_max_tokens=8))
        return actor.events()
