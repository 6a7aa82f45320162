"""Ways to cut a scripted reply into streamed pieces."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import strategies as st


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


def every_split(text: str) -> Iterator[list[str]]:
    """The whole text, one character at a time, and cut once at every point."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def random_cuts() -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(min_value=0, max_value=10_000), max_size=12)
