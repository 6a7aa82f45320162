"""Stop strings over streamed text: cut before the first match, hold back partial matches."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pypto_serving.tokenizer.stop import StopMatcher

ALPHABET = "ab c\n🙂é"  # small, so random stops often occur in random text


def stream(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    """Everything emitted, piece by piece, and whether a stop was reached."""
    emitted = []
    for piece in pieces:
        out, stopped = matcher.push(piece)
        emitted.append(out)
        assert stopped == matcher.stopped
    emitted.append(matcher.flush())
    return emitted, matcher.stopped


def expected_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@st.composite
def text_stops_pieces(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    text = draw(st.text(ALPHABET, max_size=40))
    stops = draw(st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3))
    if text and draw(st.booleans()):  # a stop that surely occurs
        start = draw(st.integers(0, len(text) - 1))
        stops.append(text[start : start + draw(st.integers(1, 5))])
    cuts = draw(st.lists(st.integers(0, 1000), max_size=12))
    return text, stops, split_at(text, cuts)


@settings(max_examples=400, deadline=None)
@given(text_stops_pieces())
def test_output_is_text_up_to_the_first_stop(case: tuple[str, list[str], list[str]]) -> None:
    text, stops, pieces = case
    emitted, stopped = stream(StopMatcher(stops), pieces)
    want, want_stopped = expected_cut(text, stops)
    assert "".join(emitted) == want
    assert stopped == want_stopped
    so_far = ""
    for out in emitted:  # no client ever sees a stop string, not even for a moment
        so_far += out
        assert not any(s in so_far for s in stops if s)


def test_match_spanning_pushes_is_cut_and_partial_is_held() -> None:
    matcher = StopMatcher(["</end>"])
    assert matcher.push("Hello </") == ("Hello ", False)
    assert matcher.push("en") == ("", False)
    assert matcher.push("d> more") == ("", True)
    assert matcher.push("later") == ("", True)
    assert matcher.flush() == ""


def test_held_partial_is_released_when_it_stops_matching() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("go ST") == ("go ", False)
    assert matcher.push("ART") == ("START", False)
    assert matcher.push("S") == ("", False)
    assert matcher.flush() == "S"


def test_a_longer_stop_starting_earlier_is_waited_for() -> None:
    matcher = StopMatcher(["a a", " "])
    assert matcher.push("a ") == ("", False)  # " " matched, but "a a" may still start at 0
    assert matcher.push("a") == ("", True)
    matcher = StopMatcher(["a a", " "])
    assert matcher.push("a ") == ("", False)
    assert matcher.push("b") == ("a", True)
    matcher = StopMatcher(["a a", " "])
    assert matcher.push("a ") == ("", False)
    assert (matcher.flush(), matcher.stopped) == ("a", True)


def test_earliest_of_several_stops_wins_inside_one_push() -> None:
    matcher = StopMatcher(["world", "lo w"])
    assert matcher.push("hello world") == ("hel", True)


def test_no_stops_is_a_pass_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("any") == ("any", False)
    assert matcher.push("") == ("", False)
    assert matcher.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    assert StopMatcher(["", "x"]).push("abxc") == ("ab", True)
    assert StopMatcher([""]).push("abc") == ("abc", False)


def test_unsearched_text_cannot_hold_a_stop_but_can_start_one() -> None:
    """min_tokens' text (search=False): a stop string inside it does not stop, one that starts
    in it and ends in searched text does (vLLM's rule)."""
    m = StopMatcher(["\n\n"])
    assert m.push("one", search=False) == ("on", False)  # its tail stays held
    assert m.push("\n", search=False) == ("e", False)
    assert m.push("\n") == ("", True)  # the held "\n" and this one
    m = StopMatcher(["\n\n"])
    out = [m.push("a\n\nb", search=False), m.push("c"), m.push("\n")]
    assert out == [("a\n\n", False), ("bc", False), ("", False)]
    assert (m.flush(), m.stopped) == ("\n", False)
    m = StopMatcher(["ab"])  # reaching the end unsearched: nothing in the held tail may stop it
    assert m.push("xa", search=False) == ("x", False) and m.push("b", search=False) == ("a", False)
    assert (m.flush(), m.stopped) == ("b", False)
