"""What the TokenizerActor receives."""

from __future__ import annotations

from dataclasses import dataclass

from pypto_serving.core.request import ChatInput
from pypto_serving.messages.mailbox import Mailbox


@dataclass(frozen=True, slots=True)
class Encode:
    prompt: str | ChatInput
    reply_to: Mailbox


TokenizerInbox = Encode
