"""What a message's `reply_to` is: anything that takes a message without blocking."""

from __future__ import annotations

from typing import Protocol


class Mailbox(Protocol):
    def tell(self, msg: object) -> None: ...
