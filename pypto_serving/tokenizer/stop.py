"""Stop strings over streamed text, with hold-back.

`StopMatcher` receives text pieces as they are detokenized and returns what is safe to send:
the generated text up to (not including) the first occurrence of any stop string, where an
occurrence may span pieces and "first" means the earliest start. A tail that is still a prefix
of some stop string is held until later text settles it; so is a found match while a longer
stop string that starts before it may still complete. Invariant: everything emitted so far
contains no stop string, and a stop string can only start inside the held tail or new text.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    """Cuts a text stream before the first stop string; a pass-through without stops."""

    def __init__(self, stops: Iterable[str]) -> None:
        # An empty stop string would match before any text: it is ignored rather than
        # ending every request at once.
        self._stops = tuple(sorted({s for s in stops if s}))
        self._prefixes = frozenset(s[:i] for s in self._stops for i in range(1, len(s)))
        self._longest_prefix = max((len(p) for p in self._prefixes), default=0)
        self._held = ""
        self._unsearched = 0  # leading characters of _held that no stop string may end in
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, text: str, search: bool = True) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string has been reached). With `search`
        False (the text of a reply's first min_tokens tokens, as vLLM treats it) no stop
        string may end in `text`, but its tail stays held: a stop string may start there and
        end in text searched later."""
        if self._stopped:
            return "", True
        pending = self._held + text
        if not search:
            keep = min(len(pending), self._longest_prefix)
            self._held, self._unsearched = pending[len(pending) - keep:], keep
            return pending[: len(pending) - keep], False
        cut = self._first_match(pending)
        self._unsearched = 0
        undecided = len(pending) - self._held_tail_length(pending)
        if cut is not None and cut <= undecided:
            self._held, self._stopped = "", True
            return pending[:cut], True
        # Either no match yet, or a longer stop string starting before the match may still
        # complete and would cut earlier: hold everything from where it starts.
        self._held = pending[undecided:]
        return pending[:undecided], False

    def flush(self) -> str:
        """What remains at the end of generation; `stopped` then says whether a stop cut it."""
        held, self._held = self._held, ""
        if self._stopped:
            return ""
        cut = self._first_match(held)
        self._stopped = cut is not None
        return held if cut is None else held[:cut]

    def _first_match(self, text: str) -> int | None:
        """The earliest start of a stop string in `text` that ends past its unsearched head."""
        found = [i for i in (text.find(s, max(0, self._unsearched - len(s) + 1)) for s in self._stops)
                 if i >= 0]
        return min(found, default=None)

    def _held_tail_length(self, text: str) -> int:
        # The longest suffix that could still grow into a stop string.
        for size in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-size:] in self._prefixes:
                return size
        return 0
