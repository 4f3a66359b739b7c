"""Stop strings cut the text at the first match and never publish a stop string's start."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_worker.output.stops import StopStrings

pytestmark = pytest.mark.fast


def stream(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    checker = StopStrings(stops)
    published = ""
    for piece in pieces:
        text, stopped = checker.feed(piece)
        published += text
        if stopped:
            return published, True
    return published + checker.flush(), False


def test_a_stop_string_spanning_two_pieces_is_cut_and_never_published() -> None:
    checker = StopStrings(["END"])
    assert checker.feed("abcE") == ("abc", False)
    assert checker.feed("N") == ("", False)  # "EN" may still begin "END"
    assert checker.feed("D and more") == ("", True)
    assert checker.flush() == ""


def test_a_false_start_is_released_once_it_cannot_be_a_stop() -> None:
    checker = StopStrings(["STOP"])
    assert checker.feed("xST") == ("x", False)
    assert checker.feed("Ay") == ("STAy", False)


def test_the_earliest_of_several_stop_strings_wins() -> None:
    assert stream(["one two", " three four"], ["four", "two"]) == ("one ", True)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcS!", max_size=60),
    cuts=st.lists(st.integers(0, 60)),
    stop=st.text(alphabet="abcS!", min_size=1, max_size=4),
)
def test_streamed_result_equals_cutting_the_whole_text(
    text: str, cuts: list[int], stop: str
) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    position = text.find(stop)
    expected = (text[:position], True) if position >= 0 else (text, False)
    assert stream(pieces, [stop]) == expected
