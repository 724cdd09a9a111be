"""IncrementalDetokenizer: streamed text equals the full decode of the output ids, for any chunking.

Tokenizers: SmolLM2's byte-level BPE (the embedded model, via transformers), plus two trained here
so nothing is SmolLM2-specific: a byte-level BPE and a Llama-2 style SentencePiece BPE (Metaspace,
byte fallback, a decoder that strips the first token's leading space).
"""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from pipeline.detokenizer import ADVANCE_EVERY, MAX_HELD_TOKENS, PREFIX_CONTEXT_TOKENS, IncrementalDetokenizer

FFFD = "\ufffd"

CORPUS = [
    'def main(argv):\n    if not argv:\n        return {"a": [1, 2]}\n\treturn std::vector<int>{}; // ::\n',
    "Family: 👨‍👩‍👧‍👦, flags: 🇺🇸🇯🇵🏳️‍🌈, skin: 👍🏽, keycap: 1️⃣",
    "日本語のテキスト、中文文本，한국어 텍스트。",
    "Café, naïve, résumé, Ångström, Zürich, São Paulo, e\u0301 (combining)",
    "spaces:     five, tabs:\t\t\tthree, newlines:\n\n\n\nend\r\n",
    "   leading spaces and trailing   ",
    "\n\n\n",
    "math: ∑ x² ≤ ∞, arrows → ⇒, quotes “smart” ‘single’ — dash",
    "mixed 😀日本 café\t::{}\n  x",
]
@pytest.fixture(params=["smollm2", "trained_byte_level", "trained_sentencepiece"])
def backend(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


class CountingBackend:
    """Delegates to a real tokenizer and records how many ids each decode call was given."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.decode_lengths = inner, []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return self.inner.get_added_tokens_decoder()

    def id_to_token(self, token_id: int) -> str | None:
        return self.inner.id_to_token(token_id)


def special_ids(tokenizer: Tokenizer) -> list[int]:
    return sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)


def must_be_emitted(tokenizer: Any, ids: list[int], skip: bool) -> str:
    """Text a streamer may not hold back: the decode minus a trailing U+FFFD run, and minus the
    text of a trailing run of <0xNN> byte-fallback tokens (decoded all-or-nothing per run)."""
    dropped = set(special_ids(tokenizer)) if skip else set()
    kept = [i for i in ids if i not in dropped]
    end = len(kept)
    while end and re.fullmatch(r"<0x[0-9A-F]{2}>", tokenizer.id_to_token(kept[end - 1]) or ""):
        end -= 1
    return tokenizer.decode(kept[:end], skip_special_tokens=skip).rstrip(FFFD)


def with_specials(ids: list[int], specials: list[int], every: int = 5) -> list[int]:
    """Specials at both ends and after every `every` tokens, often inside a multi-byte character."""
    mixed = [specials[0]]
    for k, token in enumerate(ids):
        mixed.append(token)
        if k % every == every - 1:
            mixed.append(specials[(k // every) % len(specials)])
    return [*mixed, specials[-1]]


def chunkings(ids: list[int], seed: int) -> list[list[list[int]]]:
    """One token at a time, three seeded random chunkings, and everything at once."""
    result = [[[t] for t in ids], [ids]]
    rng = random.Random(seed)
    for _ in range(3):
        chunks, start = [], 0
        while start < len(ids):
            size = rng.randint(0, 6)  # empty pushes included
            chunks.append(ids[start : start + size])
            start += size
        result.append(chunks)
    return result


def check_stream(tokenizer: Any, ids: list[int], chunks: list[list[int]], skip: bool,
                 detokenizer: Any = None) -> list[str]:
    """The property. With P = decode(ids pushed so far) and D = decode(all ids), after every push
    the emitted text E satisfies  must_be_emitted(P) <= E <= D  (<= meaning "is a prefix of"):
    nothing is emitted that a later token could change (so a U+FFFD is emitted only where the final
    decode has one), and only a trailing U+FFFD run (or byte-fallback run) is ever held. After
    flush, E == D. `detokenizer` defaults to an IncrementalDetokenizer."""
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    if detokenizer is None:
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    emitted, pushed, deltas = "", 0, []
    for chunk in chunks:
        delta = detokenizer.push(chunk)
        deltas.append(delta)
        emitted += delta
        pushed += len(chunk)
        assert full.startswith(emitted), (full, emitted)
        assert emitted.startswith(must_be_emitted(tokenizer, ids[:pushed], skip)), emitted
    emitted += detokenizer.flush()
    assert emitted == full
    assert detokenizer.text == full
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_corpus_streams_exactly_the_full_decode(backend: Tokenizer, skip: bool) -> None:
    specials = special_ids(backend)
    for seed, text in enumerate(CORPUS):
        plain = backend.encode(text, add_special_tokens=False).ids
        for ids in (plain, with_specials(plain, specials)):
            for chunks in chunkings(ids, seed):
                check_stream(backend, ids, chunks, skip)
        assert FFFD not in backend.decode(plain)  # so no delta of the plain stream held a U+FFFD


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_with_broken_utf8(backend: Tokenizer, skip: bool) -> None:
    rng = random.Random(7 + skip)
    vocab, specials = backend.get_vocab_size(), special_ids(backend)
    broken = 0
    for _ in range(6):
        ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(vocab) for _ in range(120)]
        broken += FFFD in backend.decode(ids, skip_special_tokens=skip)
        for chunks in chunkings(ids, rng.randrange(1 << 30))[:3]:
            check_stream(backend, ids, chunks, skip)
    assert broken  # the property was exercised on invalid UTF-8, not only on clean text


def single_byte_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Id of the token for each byte 0..255 under GPT-2's byte-to-unicode map (byte-level BPE)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    char_of = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    return [tokenizer.token_to_id(char_of[b]) for b in range(256)]  # None: not in this vocab


@pytest.mark.parametrize("tokenizer_name", ["smollm2", "trained_byte_level"])
def test_byte_soup_exercises_reanchoring(tokenizer_name: str, request: pytest.FixtureRequest) -> None:
    """Single-byte tokens, mostly UTF-8 continuation bytes: long tails that keep ending in U+FFFD
    with complete characters inside them, so the window must re-anchor without cutting one."""
    tokenizer = request.getfixturevalue(tokenizer_name)
    byte_ids = single_byte_token_ids(tokenizer)
    continuation = [i for i in byte_ids[0x80:0xC0] if i is not None]
    lead = [i for i in byte_ids[0xC2:0xF5] if i is not None]
    rng = random.Random(11)
    for _ in range(5):
        ids = []
        for _ in range(200):
            roll = rng.random()
            ids.append(rng.choice(continuation) if roll < 0.7 else rng.choice(lead) if roll < 0.95 else byte_ids[0x61])
        counting = CountingBackend(tokenizer)
        for chunks in chunkings(ids, rng.randrange(1 << 30))[:3]:
            check_stream(counting, ids, chunks, skip=True)
        one_by_one = CountingBackend(tokenizer)
        detokenizer = IncrementalDetokenizer(one_by_one)
        assert "".join(detokenizer.push([t]) for t in ids) + detokenizer.flush() == tokenizer.decode(ids)
        assert max(one_by_one.decode_lengths) <= PREFIX_CONTEXT_TOKENS + MAX_HELD_TOKENS + 1


def test_token_by_token_decoding_is_wrong_and_we_are_not(smollm2: Tokenizer, trained_sentencepiece: Tokenizer) -> None:
    """The bugs this module exists for: lost spaces (SentencePiece) and split characters (byte BPE)."""
    for tokenizer, text in [(trained_sentencepiece, "hello world, the fox"), (smollm2, "hi 👨‍👩‍👧 日本")]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        naive = "".join(tokenizer.decode([t]) for t in ids)
        assert naive != tokenizer.decode(ids)
        deltas = check_stream(tokenizer, ids, [[t] for t in ids], skip=True)
        assert not any(FFFD in d for d in deltas)


def test_whitespace_only_deltas_are_kept(backend: Tokenizer) -> None:
    ids = backend.encode("a\n\n\n    b\t\tc  ", add_special_tokens=False).ids
    deltas = check_stream(backend, ids, [[t] for t in ids], skip=True)
    assert any(d and not d.strip() for d in deltas)


def test_split_character_is_held_and_text_before_it_is_not(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("ok 😀!", add_special_tokens=False).ids  # 'ok', ' 😀' split over 2+ tokens, '!'
    detokenizer = IncrementalDetokenizer(smollm2)
    deltas = [detokenizer.push([t]) for t in ids]
    emoji_at = next(k for k, d in enumerate(deltas) if "😀" in d)
    assert emoji_at > 1 and " " in "".join(deltas[:emoji_at])  # the space is not held with the emoji
    assert "".join(deltas) + detokenizer.flush() == "ok 😀!"


def test_flush_releases_an_incomplete_character_as_the_full_decode_does(backend: Tokenizer) -> None:
    ids = backend.encode("end 😀", add_special_tokens=False).ids[:-1]
    full = backend.decode(ids)
    assert full.endswith(FFFD)
    detokenizer = IncrementalDetokenizer(backend)
    streamed = "".join(detokenizer.push([t]) for t in ids)
    assert FFFD not in streamed and streamed + detokenizer.flush() == full
    assert detokenizer.flush() == ""
    with pytest.raises(RuntimeError):
        detokenizer.push(ids[:1])


def test_prompt_is_never_emitted_and_first_token_matches_full_decode(trained_sentencepiece: Tokenizer) -> None:
    prompt = trained_sentencepiece.encode("the quick brown", add_special_tokens=False).ids
    output = trained_sentencepiece.encode("fox jumps", add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(trained_sentencepiece, prompt_token_ids=prompt)
    text = "".join(detokenizer.push([t]) for t in output) + detokenizer.flush()
    assert text == trained_sentencepiece.decode(output) == "fox jumps"


def longest_byte_fallback_run(tokenizer: Tokenizer, ids: list[int]) -> int:
    longest = run = 0
    for token_id in ids:
        run = run + 1 if re.fullmatch(r"<0x[0-9A-F]{2}>", tokenizer.id_to_token(token_id)) else 0
        longest = max(longest, run)
    return longest


def test_cost_per_step_is_bounded_by_the_window(backend: Tokenizer) -> None:
    """Each decode sees a bounded window, on long clean text and on garbage that keeps ending in
    U+FFFD (a lone UTF-8 continuation byte, repeated, with lead bytes thrown in). An open
    byte-fallback run is held whole, so it widens the window (this tiny tokenizer spells all CJK
    in bytes; real SentencePiece vocabularies make such runs short)."""
    clean = backend.encode("".join(CORPUS) * 4, add_special_tokens=False).ids
    lone_continuation = backend.encode("😀", add_special_tokens=False).ids[-1]
    lead = backend.encode("日", add_special_tokens=False).ids[0]
    garbage = [lone_continuation] * 200 + ([lone_continuation] * 7 + [lead]) * 40
    for ids in (clean, garbage):
        counting = CountingBackend(backend)
        check_stream(counting, ids, [[t] for t in ids], skip=True)
        assert len(ids) > 400 and max(counting.decode_lengths) <= len(ids)
        detokenizer_calls = CountingBackend(backend)
        detokenizer = IncrementalDetokenizer(detokenizer_calls)
        streamed = "".join(detokenizer.push([t]) for t in ids) + detokenizer.flush()
        assert streamed == backend.decode(ids)
        bound = PREFIX_CONTEXT_TOKENS + MAX_HELD_TOKENS + ADVANCE_EVERY + 1 + longest_byte_fallback_run(backend, ids)
        assert max(detokenizer_calls.decode_lengths) <= bound


def test_accepts_numpy_ids_and_empty_pushes(smollm2: Tokenizer) -> None:
    ids = np.array(smollm2.encode("x = 1\n", add_special_tokens=False).ids, dtype=np.int64)
    detokenizer = IncrementalDetokenizer(smollm2)
    assert detokenizer.push([]) == ""
    assert detokenizer.push(ids[:2]) + detokenizer.push(ids[2:]) + detokenizer.flush() == "x = 1\n"


def test_special_tokens_are_text_only_when_not_skipped(smollm2: Tokenizer) -> None:
    ids = [1, *smollm2.encode("assistant\nHi", add_special_tokens=False).ids, 2]
    for skip, expected in [(True, "assistant\nHi"), (False, "<|im_start|>assistant\nHi<|im_end|>")]:
        detokenizer = IncrementalDetokenizer(smollm2, skip_special_tokens=skip)
        assert "".join(detokenizer.push([t]) for t in ids) + detokenizer.flush() == expected
