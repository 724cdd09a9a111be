"""Detokenization for byte-level BPE vocabularies (GPT-2 style: Llama 3, Qwen, SmolLM2) with no
tokenizer call per token.

A byte-level decoder maps every token to a fixed byte string, joins the bytes of a run of ordinary
tokens and decodes them as UTF-8 with replacement; an added token (e.g. `<|im_end|>`, when it is not
skipped) ends the run and contributes its own text. So a sequence's text is a pure function of a
per-id byte table, and Python's incremental UTF-8 decoder streams it exactly: it holds an incomplete
character (at most 3 bytes) until the bytes that complete or break it arrive, and replaces invalid
bytes the way the full decode does (one U+FFFD per maximal ill-formed subpart).

The table is built once per tokenizer and checked against the tokenizer's own decode of every id;
any vocabulary that does not fit (another decoder, a mismatch) uses IncrementalDetokenizer. The
detokenizer that streams a table is ByteLevelDetokenizer, below.
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import decoders


def _byte_of_char() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character map, char -> byte: printable Latin-1 bytes
    stand for themselves, the other 68 bytes take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


@dataclass(slots=True, frozen=True)
class ByteTable:
    token_bytes: tuple[bytes, ...]  # id -> the bytes an ordinary token adds to its run
    added_text: dict[int, str]  # id -> text of an added token (ends the current byte run)
    special_ids: frozenset[int]  # added tokens that skip_special_tokens drops


_CHECK_RUN = 64  # the table is checked on runs of this many ids: joined bytes against the tokenizer's decode
_TABLES: dict[int, tuple[Any, ByteTable | None]] = {}  # id(backend) -> (backend, table): built once


def byte_table(backend: Any) -> ByteTable | None:
    """The backend's byte table, or None when its decode is not a byte-level one we reproduce."""
    cached = _TABLES.get(id(backend))
    if cached is not None and cached[0] is backend:
        return cached[1]
    table = _build(backend) if isinstance(getattr(backend, "decoder", None), decoders.ByteLevel) else None
    if len(_TABLES) > 64:
        _TABLES.clear()
    _TABLES[id(backend)] = (backend, table)
    return table


def _build(backend: Any) -> ByteTable | None:
    byte_of = _byte_of_char()
    added = backend.get_added_tokens_decoder()
    size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
    token_bytes: list[bytes] = []
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        if token is None or token_id in added:
            token_bytes.append(b"")
        elif all(c in byte_of for c in token):
            token_bytes.append(bytes(byte_of[c] for c in token))
        else:  # the decoder passes a token with a character outside the map through as UTF-8
            token_bytes.append(token.encode())
    added_text = {i: backend.decode([i], skip_special_tokens=False) for i in added}
    ordinary = [i for i in range(size) if i not in added]
    runs = [ordinary[k : k + _CHECK_RUN] for k in range(0, len(ordinary), _CHECK_RUN)]
    decoded = backend.decode_batch(runs, skip_special_tokens=False)  # every id, in runs: one call
    if any(b"".join(token_bytes[i] for i in run).decode(errors="replace") != text for run, text in zip(runs, decoded)):
        return None  # not the decoder we model: the general detokenizer handles it
    special = frozenset(i for i, token in added.items() if getattr(token, "special", False))
    return ByteTable(tuple(token_bytes), added_text, special)


class ByteLevelDetokenizer:
    """Same contract as IncrementalDetokenizer: the joined deltas plus flush() equal
    `backend.decode(output_ids, skip_special_tokens=...)` for any chunking of the ids."""

    __slots__ = ("_added_text", "_dropped", "_finished", "_pieces", "_token_bytes", "_utf8")

    def __init__(self, table: Any, skip_special_tokens: bool = True) -> None:
        self._pieces: list[str] = []
        self._finished = False
        self._token_bytes: tuple[bytes, ...] = table.token_bytes
        self._dropped: frozenset[int] = frozenset(table.special_ids) if skip_special_tokens else frozenset()
        self._added_text = {i: t for i, t in table.added_text.items() if i not in self._dropped}
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def text(self) -> str:
        """All text emitted so far (the pieces collapse into one, so repeated reads stay cheap)."""
        joined = "".join(self._pieces)
        self._pieces = [joined]
        return joined

    def push(self, token_ids: Sequence[int]) -> str:
        return "".join([self.push_one(int(token_id)) for token_id in token_ids])

    def push_one(self, token_id: int) -> str:
        """One id (the decode step's case): a table lookup and one incremental UTF-8 decode."""
        if self._finished:
            raise RuntimeError("push() after flush(): the sequence has ended")
        if token_id in self._dropped:
            return ""
        added = self._added_text.get(token_id)
        if added is not None:  # an added token ends the byte run: what is held decodes as is
            text = self._utf8.decode(b"", True) + added
            self._utf8.reset()
        else:
            text = self._utf8.decode(self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b"")
        if text:
            self._pieces.append(text)
        return text

    def flush(self) -> str:
        """End of sequence: an incomplete character left over decodes as U+FFFD, as in the full decode."""
        if self._finished:
            return ""
        self._finished = True
        text = self._utf8.decode(b"", True)
        if text:
            self._pieces.append(text)
        return text
