"""SSE text events and HTTP chunks: compiled == twin == the orjson / %-format definitions."""
import random

import orjson
import pytest

from tests.ext.twins import twin_and_compiled

MODULES = twin_and_compiled("sse_text")

BEFORE = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":'
AFTER = b',"finish_reason":null}]}\n\n'
SURROUNDINGS = [(b"", b""), (b"x", b""), (b"", b"y"), (BEFORE, AFTER), (b"\x00\xff", b"\r\n")]


def expected_event(before: bytes, text: str, after: bytes) -> bytes:
    return b"%b%b%b" % (before, orjson.dumps(text), after)


def expected_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def check(module, text: str) -> None:
    for before, after in SURROUNDINGS:
        event = expected_event(before, text, after)
        assert module.text_event(before, text, after) == event


def non_surrogates(start: int, stop: int) -> list[str]:
    return [chr(c) for c in range(start, stop) if not 0xD800 <= c <= 0xDFFF]


@pytest.mark.parametrize("module", MODULES)
def test_every_code_point(module):
    for start in range(0, 0x110000, 1000):
        text = "".join(non_surrogates(start, min(start + 1000, 0x110000)))
        assert module.text_event(b"a", text, b"b") == expected_event(b"a", text, b"b")
    for char in non_surrogates(0, 0x800) + non_surrogates(0x800, 0x110000)[::997]:
        assert module.text_event(b"", char, b"") == orjson.dumps(char)
    for char in ["\u2028", "\u2029", "\ufeff", "\uffff", "\U0010ffff"]:
        check(module, char)


@pytest.mark.parametrize("module", MODULES)
def test_every_ascii_char_alone_and_in_text(module):
    for c in range(128):
        check(module, chr(c))
        check(module, f"ab{chr(c)}cd")
        check(module, f"é{chr(c)}{chr(c)}😀")


@pytest.mark.parametrize("module", MODULES)
def test_random_mixed_text(module):
    rng = random.Random(0)
    pools = [[chr(c) for c in range(0x20, 0x7F)], [chr(c) for c in range(0x20)] + ["\x7f"], ['"', "\\", "/"],
             non_surrogates(0x80, 0x800), non_surrogates(0x800, 0x10000)[::7], non_surrogates(0x10000, 0x110000)[::101]]
    for _ in range(3000):
        text = "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 40)))
        before, after = rng.choice(SURROUNDINGS)
        assert module.text_event(before, text, after) == expected_event(before, text, after)


@pytest.mark.parametrize("module", MODULES)
def test_empty_and_long_text(module):
    check(module, "")
    check(module, "x" * 100_000)
    check(module, ("héllo \"wörld\"\n\\ 😀 \x1f" * 5000)[:100_000])


@pytest.mark.parametrize("module", MODULES)
def test_http_chunk(module):
    for size in (1, 15, 16, 255, 256, 4096, 70000):
        data = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
        assert module.http_chunk(data) == expected_chunk(data)
    assert module.http_chunk(b"abc") == b"3\r\nabc\r\n"
    assert module.http_chunk(b"q" * 26) == b"1a\r\n" + b"q" * 26 + b"\r\n"  # lowercase hex
    with pytest.raises(ValueError):
        module.http_chunk(b"")


@pytest.mark.parametrize("module", MODULES)
def test_lone_surrogate_raises_type_error(module):
    for text in ["a\ud800b", "\udfff", "x" * 50 + "\udc00"]:
        with pytest.raises(TypeError):
            module.text_event(b"a", text, b"b")


@pytest.mark.parametrize("module", MODULES)
def test_wrong_types_raise_type_error(module):
    for args in [(None, "x", b""), (b"", None, b""), (b"", "x", None), (bytearray(b"a"), "x", b""), (b"", 1, b"")]:
        with pytest.raises(TypeError):
            module.text_event(*args)
    for data in [None, bytearray(b"a"), "a"]:
        with pytest.raises(TypeError):
            module.http_chunk(data)


@pytest.mark.parametrize("module", MODULES)
def test_text_event_chunk_is_the_event_framed(module):
    rng = random.Random(1)
    pool = ["a", "é", '"', "\\", "\n", "\x01", "😀", " ", "x" * 40]
    for before, after in SURROUNDINGS + [(b"p" * 300, b"q" * 5000)]:
        for _ in range(200):
            text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 30)))
            assert module.text_event_chunk(before, text, after) == expected_chunk(expected_event(before, text, after))
    assert module.text_event_chunk(b"", "", b"") == b'2\r\n""\r\n'  # never an empty (terminating) chunk
    with pytest.raises(TypeError):
        module.text_event_chunk(b"a", "\ud800", b"b")
    for args in [(None, "x", b""), (b"", None, b""), (b"", "x", None)]:
        with pytest.raises(TypeError):
            module.text_event_chunk(*args)
