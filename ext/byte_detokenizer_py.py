"""The byte-table detokenizer (see pipeline/detokenizer_bytes.py), pure Python. Twin of
ext/byte_detokenizer.pyx: same results for every call (tests/ext/test_byte_detokenizer.py proves it).

`table` is any object with the three ByteTable attributes (token_bytes, added_text, special_ids):
ext does not import pipeline.
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any


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
