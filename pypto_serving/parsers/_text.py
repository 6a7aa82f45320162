"""Holding back the end of streamed text that may be the start of a tag."""

from __future__ import annotations


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could still grow into `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def safe_end(text: str, tag: str) -> int:
    """How much of `text` can go out now: neither a partial `tag` at its end nor the
    whitespace before that, which is dropped if the tag completes."""
    cut = len(text) - partial_tag_len(text, tag)
    return len(text[:cut].rstrip())
