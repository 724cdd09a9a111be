"""StopStringMatcher against a brute-force model of the stream, over every 1-3 chunk split."""

from __future__ import annotations

import random
from itertools import combinations_with_replacement

import pytest

from pipeline.stop_strings import StopStringMatcher


def decided_state(seen: str, stops: list[str]) -> tuple[str, int, str | None]:
    """Brute force on the text seen so far. Scanning left to right, the first position where a
    stop is complete decides a match (the shortest complete one there); the first position where a
    stop could still start (the rest of `seen` is a proper prefix of it) must be held back."""
    for start in range(len(seen) + 1):
        complete = [s for s in stops if s and seen.startswith(s, start)]
        if complete:
            return "match", start, min(complete, key=len)
        rest = seen[start:]
        if rest and any(s.startswith(rest) for s in stops if s):
            return "hold", start, None
    return "hold", len(seen), None


def final_output(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """What the whole text must produce: truncated at the earliest stop (shortest on a tie)."""
    hits = [(text.find(s), len(s), s) for s in stops if s and s in text]
    if not hits:
        return text, None
    start, _, stop = min(hits)
    return text[:start] + (stop if include else ""), stop


def run_and_check(text: str, chunks: list[str], stops: list[str], include: bool) -> str:
    """Feed chunks, checking after every feed that the matcher is exactly as eager as allowed."""
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted, seen, done = "", "", False
    for chunk in chunks:
        out, matched = matcher.feed(chunk)
        if done:
            assert (out, matched) == ("", True)
            continue
        seen += chunk
        emitted += out
        state, start, stop = decided_state(seen, stops)
        if state == "hold":
            assert not matched and matcher.matched is None
            assert emitted == seen[:start], (seen, emitted)
            assert len(seen) - len(emitted) < max((len(s) for s in stops), default=1)
        else:
            assert matched and matcher.matched == stop
            assert emitted == seen[:start] + (stop if include else "")
            done = True
    emitted += matcher.flush()
    expected, expected_stop = final_output(text, stops, include)
    assert emitted == expected, (text, chunks, stops)
    assert matcher.matched == expected_stop
    assert matcher.flush() == ""
    if not include:
        assert not any(s in emitted for s in stops if s)
    return emitted


def chunkings(text: str):
    """Every split of text into 1, 2 or 3 chunks (empty chunks included)."""
    n = len(text)
    yield [text]
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    for i, j in combinations_with_replacement(range(n + 1), 2):
        yield [text[:i], text[i:j], text[j:]]


CASES = [
    ("Hello world. Bye", ["."]),
    ("Hello world. Bye", ["world", "o w"]),  # earlier start wins over earlier end
    ("abcd", ["abcd", "bc"]),  # "bc" completes first but "abcd" starts earlier
    ("abcx", ["abcd", "bc"]),  # the longer candidate dies: "bc" wins
    ("xabc", ["ab", "abc"]),  # same start: the shorter complete one wins
    ("xaaab", ["aab"]),  # self-overlapping stop
    ("aaaa", ["aaa", "aa"]),
    ("abababc", ["ababc"]),
    ("no stop here", ["STOP", "\n\n"]),
    ("line1\n\nline2", ["\n\n"]),
    ("a</s>b<|im_end|>", ["<|im_end|>", "</s>"]),  # several stops in one text
    ("日本語です。次", ["。", "本語で"]),
    ("emoji 👨‍👩‍👧 end", ["👩", "‍👧"]),
    ("café crème", ["é c", "crème"]),
    ("   ", [" "]),
    ("", ["x"]),
    ("abc", []),
    ("abc", ["", "c"]),  # an empty stop string is ignored
    ("x::y::z", ["::", "::z"]),
]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(("text", "stops"), CASES)
def test_every_split_into_up_to_three_chunks(text: str, stops: list[str], include: bool) -> None:
    outputs = {run_and_check(text, chunks, stops, include) for chunks in chunkings(text)}
    assert len(outputs) == 1


def test_stop_spanning_many_deltas_and_the_match_report() -> None:
    matcher = StopStringMatcher(["<|im_end|>"])
    fed = [matcher.feed(c) for c in ["Hi", " <", "|im", "_", "end", "|", ">", "more"]]
    assert fed == [("Hi", False), (" ", False), ("", False), ("", False), ("", False),
                   ("", False), ("", True), ("", True)]
    assert matcher.matched == "<|im_end|>" and matcher.flush() == ""


def test_false_start_is_released_when_it_diverges() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a ST") == ("a ", False)
    assert matcher.feed("ART") == ("START", False)
    assert matcher.feed(" STO") == (" ", False)
    assert matcher.flush() == "STO" and matcher.matched is None


def test_deferred_match_is_decided_at_flush() -> None:
    matcher = StopStringMatcher(["abcd", "bc"], include_stop_str_in_output=True)
    assert matcher.feed("xabc") == ("x", False)  # "bc" is complete, "abcd" may still win
    assert matcher.flush() == "abc" and matcher.matched == "bc"


def test_whitespace_only_deltas_pass_through() -> None:
    matcher = StopStringMatcher(["###"])
    assert [matcher.feed(d) for d in ["\n", "  ", "\t"]] == [("\n", False), ("  ", False), ("\t", False)]


@pytest.mark.parametrize("include", [False, True])
def test_random_streams_against_brute_force(include: bool) -> None:
    rng = random.Random(1234 + include)
    alphabet = "ab\n😀é"
    for _ in range(1500):
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 24)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        run_and_check(text, chunks, stops, include)


def test_long_stream_holds_back_less_than_the_longest_stop() -> None:
    matcher = StopStringMatcher(["aaaaab", "xyz"])
    emitted = ""
    for i in range(20_000):
        out, matched = matcher.feed("a")
        assert not matched
        emitted += out
        assert i + 1 - len(emitted) == min(i + 1, 5)  # only the 5 'a's that could start "aaaaab" are held
    out, matched = matcher.feed("b")
    assert matched and emitted + out == "a" * 19_995
