"""Weight-loading progress: a bar on a terminal, a log line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

import structlog
from tqdm import tqdm

T = TypeVar("T")
log = structlog.get_logger()


def with_progress(items: Iterable[T], total: int, label: str, every_s: float = 2.0) -> Iterator[T]:
    if sys.stderr.isatty():
        yield from tqdm(items, total=total, desc=label, unit="tensor", file=sys.stderr)
        return
    start = last = time.monotonic()
    done = 0
    for item in items:
        yield item
        done += 1
        if time.monotonic() - last >= every_s:
            last = time.monotonic()
            log.info(label, tensors=f"{done}/{total}", percent=round(100 * done / max(total, 1)))
    log.info(label + " done", tensors=f"{done}/{total}", seconds=round(time.monotonic() - start, 2))
