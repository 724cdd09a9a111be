"""The byte-table detokenizer: compiled == twin (delta for delta) == a whole-sequence reference, on a
synthetic table full of split characters, invalid UTF-8, long and empty tokens, added and special
tokens, and ids outside the table."""
from __future__ import annotations

import random
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import pytest

from tests.ext.twins import compiled_module, twin_and_compiled

MODULES = twin_and_compiled("byte_detokenizer")


@dataclass(frozen=True)
class Table:
    """What the detokenizer reads of a pipeline ByteTable (ext does not import pipeline)."""
    token_bytes: tuple[bytes, ...]
    added_text: dict[int, str]
    special_ids: frozenset[int]


TOKEN_BYTES = (
    b"", b"a", b" hello", "é".encode(), b"\xc3", b"\xa9",  # 4 + 5: é split
    b"\xe6", b"\x97", b"\xa5", b"\xe6\x97",  # 日 split 1+1+1 and 2+1
    b"\xf0\x9f", b"\x98\x80", b"\xf0", b"\x9f\x98",  # 😀 split 2+2 and 1+2+1
    b"\x80", b"\xc0", b"\xe0\x80", b"\xf4\x90", b"\xff", b"\xbf",  # invalid: every kind of ill-formed start
    b"\xed\xa0\x80", "\ufffd".encode(), b"\xc2",  # a surrogate, a literal U+FFFD, a lead byte
    ("x" * 150 + "日本" * 60).encode(),  # long and valid
    b"\xa5" + b"y" * 400 + b"\xe6\x97",  # long: starts with a continuation byte, ends mid-character
    b"\x9f" * 300 + "😀".encode() + b"\xf0\x9f\x98",  # long invalid run, ends mid-character
    b"<special bytes>", b"", b"", b"",  # 26..29: ids the added tokens below take over
)
SPECIAL, TOOL, EMPTY_ADDED, PLAIN_SPECIAL, FAR_ADDED, NEGATIVE_SPECIAL = 26, 27, 28, 29, 40, -3
TABLE = Table(
    TOKEN_BYTES,
    {SPECIAL: "<|im_end|>", TOOL: "<tool>", EMPTY_ADDED: "", PLAIN_SPECIAL: "<s>", FAR_ADDED: "<far>",
     NEGATIVE_SPECIAL: "<neg>"},
    frozenset({SPECIAL, PLAIN_SPECIAL, NEGATIVE_SPECIAL, 2}),  # 2: a special with bytes but no added text
)
ODD_IDS = [-1, -3, -10 ** 30, 10 ** 30, 2 ** 63, len(TOKEN_BYTES), FAR_ADDED, 10 ** 9]


def ref(table: Table, ids: list[int], skip: bool) -> str:
    """The full decode by definition: runs of ordinary bytes decode with replacement; an added token
    that is kept ends the run and adds its text; dropped specials and unknown ids add nothing."""
    dropped = table.special_ids if skip else frozenset()
    out, run = [], b""
    for i in ids:
        if i in dropped:
            continue
        if i in table.added_text:
            out += [run.decode("utf-8", "replace"), table.added_text[i]]
            run = b""
        elif 0 <= i < len(table.token_bytes):
            run += table.token_bytes[i]
    return "".join(out) + run.decode("utf-8", "replace")


def random_ids(rng: random.Random) -> list[int]:
    pick = lambda: rng.choice(ODD_IDS) if rng.random() < 0.05 else rng.randrange(len(TOKEN_BYTES))  # noqa: E731
    return [pick() for _ in range(rng.randint(0, 60))]


def stream(module: ModuleType, ids: list[int], skip: bool, rng: random.Random, table: Table = TABLE) -> list[str]:
    """Every delta of one random chunking (push of 0..5 ids, or push_one), then flush()'s."""
    detokenizer = module.ByteLevelDetokenizer(table, skip)
    deltas, k = [], 0
    while k < len(ids):
        if rng.random() < 0.5:
            deltas.append(detokenizer.push_one(ids[k]))
            k += 1
        else:
            n = rng.randint(0, 5)
            deltas.append(detokenizer.push(ids[k : k + n]))
            k += n
    deltas.append(detokenizer.flush())
    assert detokenizer.text == "".join(deltas) == detokenizer.text
    return deltas


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("skip", [True, False])
def test_any_chunking_streams_exactly_the_reference(module: ModuleType, skip: bool) -> None:
    rng = random.Random(7 + skip)
    for _ in range(3000):
        ids = random_ids(rng)
        assert "".join(stream(module, ids, skip, rng)) == ref(TABLE, ids, skip), ids


@pytest.mark.skipif(compiled_module("byte_detokenizer") is None, reason="not built")
@pytest.mark.parametrize("skip", [True, False])
def test_compiled_and_twin_give_the_same_delta_for_every_call(skip: bool) -> None:
    import ext.byte_detokenizer_py as twin
    compiled = compiled_module("byte_detokenizer")
    for seed in range(3000):
        ids = random_ids(random.Random(seed))
        assert stream(twin, ids, skip, random.Random(seed)) == stream(compiled, ids, skip, random.Random(seed)), ids


@pytest.mark.parametrize("module", MODULES)
def test_held_bytes_and_added_tokens(module: ModuleType) -> None:
    detokenizer = module.ByteLevelDetokenizer(TABLE, True)
    assert [detokenizer.push_one(i) for i in (6, 7)] == ["", ""]  # 日 incomplete: held
    assert detokenizer.push_one(SPECIAL) == ""  # a dropped special leaves the held bytes held
    assert detokenizer.push_one(10 ** 30) == "" and detokenizer.push_one(-1) == ""
    assert detokenizer.push_one(8) == "日"
    assert detokenizer.push([4, TOOL, 5]) == "\ufffd<tool>\ufffd"  # the added token ends the run
    assert detokenizer.push([4, EMPTY_ADDED]) == "\ufffd"  # even one with no text
    assert detokenizer.push_one(np.int64(1)) == "a"
    assert detokenizer.push([4, 24]) == "å" + "y" * 400  # held + a long token: joined off the stack; its tail held
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == "日\ufffd<tool>\ufffd\ufffdaå" + "y" * 400 + "\ufffd"
    kept = module.ByteLevelDetokenizer(TABLE, skip_special_tokens=False)
    assert kept.push([4, SPECIAL, 2, NEGATIVE_SPECIAL, FAR_ADDED]) == "\ufffd<|im_end|> hello<neg><far>"


@pytest.mark.parametrize("module", MODULES)
def test_flush_ends_the_sequence(module: ModuleType) -> None:
    detokenizer = module.ByteLevelDetokenizer(TABLE)
    assert detokenizer.push([1, 10]) == "a"
    assert detokenizer.flush() == "\ufffd" and detokenizer.flush() == ""
    with pytest.raises(RuntimeError, match=r"push\(\) after flush\(\): the sequence has ended"):
        detokenizer.push_one(1)
    with pytest.raises(RuntimeError, match="the sequence has ended"):
        detokenizer.push([1])
    assert detokenizer.push([]) == "" and detokenizer.text == "a\ufffd"
    assert module.ByteLevelDetokenizer(TABLE).text == ""


@pytest.mark.parametrize("module", MODULES)
def test_a_table_given_as_lists_and_sets_works_too(module: ModuleType) -> None:
    table = Table(list(TOKEN_BYTES), dict(TABLE.added_text), set(TABLE.special_ids))  # type: ignore[arg-type]
    for seed in range(50):
        ids = random_ids(random.Random(seed))
        assert "".join(stream(module, ids, True, random.Random(seed), table)) == ref(TABLE, ids, True)
