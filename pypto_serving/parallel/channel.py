"""Rank 0 hands each message it receives to the other ranks of its group.

A broadcast over the default (gloo, host) group: the length, then the bytes. The other ranks
wait in `receive` with no deadline; when rank 0's process ends, the broadcast fails and they
end too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def send(data: bytes) -> None:
    """From rank 0."""
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0)


def receive() -> bytes:
    """On the other ranks: the next message rank 0 sent."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src=0)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0)
    return payload.numpy().tobytes()
