"""ByteLevelDetokenizer: the byte-table detokenizer streams exactly the full decode, like the
windowed one, on the same corpus, broken UTF-8, byte soup, and special/added tokens."""
from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer

from pipeline.detokenizer import IncrementalDetokenizer, new_detokenizer
from pipeline.detokenizer_bytes import ByteLevelDetokenizer, byte_table
from tests.pipeline.test_detokenizer import (
    CORPUS,
    FFFD,
    check_stream,
    chunkings,
    single_byte_token_ids,
    special_ids,
    with_specials,
)


@pytest.fixture(params=["smollm2", "trained_byte_level"])
def byte_level(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


def streamed(tokenizer: Tokenizer, ids: list[int], chunks: list[list[int]], skip: bool) -> list[str]:
    table = byte_table(tokenizer)
    assert table is not None
    return check_stream(tokenizer, ids, chunks, skip, ByteLevelDetokenizer(table, skip))


@pytest.mark.parametrize("skip", [True, False])
def test_corpus_streams_exactly_the_full_decode(byte_level: Tokenizer, skip: bool) -> None:
    specials = special_ids(byte_level)
    for seed, text in enumerate(CORPUS):
        plain = byte_level.encode(text, add_special_tokens=False).ids
        for ids in (plain, with_specials(plain, specials)):
            for chunks in chunkings(ids, seed):
                streamed(byte_level, ids, chunks, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_and_byte_soup_with_broken_utf8(byte_level: Tokenizer, skip: bool) -> None:
    rng = random.Random(3 + skip)
    vocab, specials = byte_level.get_vocab_size(), special_ids(byte_level)
    byte_ids = [i for i in single_byte_token_ids(byte_level) if i is not None]
    broken = 0
    for trial in range(8):
        pick = (lambda: rng.randrange(vocab)) if trial % 2 else (lambda: rng.choice(byte_ids))
        ids = [rng.choice(specials) if rng.random() < 0.05 else pick() for _ in range(200)]
        broken += FFFD in byte_level.decode(ids, skip_special_tokens=skip)
        for chunks in chunkings(ids, rng.randrange(1 << 30))[:3]:
            streamed(byte_level, ids, chunks, skip)
    assert broken  # invalid UTF-8 was exercised, not only clean text


def test_added_tokens_end_a_byte_run_as_the_full_decode_does(trained_byte_level: Tokenizer) -> None:
    """A non-special added token splits the bytes around it (each side decodes alone); a skipped
    special does not. Built on a copy so the shared fixture keeps its vocabulary."""
    tokenizer = Tokenizer.from_str(trained_byte_level.to_str())
    tokenizer.add_tokens([AddedToken("<tool>", special=False)])
    tool, special = tokenizer.token_to_id("<tool>"), special_ids(tokenizer)[0]
    lead = tokenizer.encode("日", add_special_tokens=False).ids[:1]
    for skip in (True, False):
        for ids in ([*lead, tool, *lead], [*lead, special, *lead, tool], [tool, tool, *lead]):
            full = tokenizer.decode(ids, skip_special_tokens=skip)
            table = byte_table(tokenizer)
            assert table is not None
            for chunks in chunkings(ids, 5):
                check_stream(tokenizer, ids, chunks, skip, ByteLevelDetokenizer(table, skip))
            assert full  # held bytes are released around the added token


def test_the_factory_picks_the_byte_table_only_where_it_is_exact(
        smollm2: Tokenizer, trained_sentencepiece: Tokenizer) -> None:
    assert isinstance(new_detokenizer(smollm2), ByteLevelDetokenizer)
    assert isinstance(new_detokenizer(trained_sentencepiece), IncrementalDetokenizer)  # Metaspace + ByteFallback
    assert byte_table(smollm2) is byte_table(smollm2)  # built once per tokenizer


class LyingDecoder:
    """A byte-level tokenizer whose decode disagrees with the byte map for one id."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.decoder = inner, inner.decoder

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decode_batch(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        texts = self.inner.decode_batch(batch, skip_special_tokens=skip_special_tokens)
        return [t + "!" if 300 in ids else t for ids, t in zip(batch, texts)]


def test_a_vocabulary_the_table_does_not_reproduce_falls_back(trained_byte_level: Tokenizer) -> None:
    lying = LyingDecoder(trained_byte_level)
    assert byte_table(lying) is None
    assert isinstance(new_detokenizer(lying), IncrementalDetokenizer)


def test_flush_and_push_after_flush(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("end 😀", add_special_tokens=False).ids[:-1]
    detokenizer = new_detokenizer(smollm2)
    text = "".join(detokenizer.push_one(t) for t in ids)
    assert FFFD not in text and text + detokenizer.flush() == smollm2.decode(ids) == detokenizer.text
    assert detokenizer.flush() == ""
    with pytest.raises(RuntimeError):
        detokenizer.push_one(ids[0])
    assert new_detokenizer(smollm2).push_one(10 ** 9) == ""  # an id past the vocabulary decodes to nothing
