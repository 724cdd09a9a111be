"""Incremental detokenization whose streamed text equals a full decode of the output ids.

Decoding token by token is wrong in two ways: a character's UTF-8 bytes can be split over
several byte-level BPE tokens (each piece alone decodes to U+FFFD), and decoders treat the first
token of a decode call specially (SentencePiece-style decoders strip its leading space). So each
step decodes a short window: a few already-emitted tokens as left context (the "prefix") plus the
new tokens (the "tail"), and emits only the text past the prefix. Text is released only once it
cannot change: a trailing run of U+FFFD may be an incomplete UTF-8 sequence, so it is held until a
later token settles it, or until flush(). Byte-fallback tokens (`<0xNN>`, SentencePiece models)
decode all-or-nothing per run: one invalid byte turns the whole run into U+FFFD, so a run's text is
held until a non-byte token ends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Emitted tokens kept as left context. One suffices for the decoders in use (byte-level,
# Metaspace/Strip, ByteFallback, WordPiece); a few more cost little.
PREFIX_CONTEXT_TOKENS = 4
# A held tail longer than this tries to re-anchor the window at a settled split point, which keeps
# each step's cost bounded even for garbage ids whose decode keeps ending in U+FFFD.
MAX_HELD_TOKENS = 8
# A fully settled window is re-anchored every this many tokens (not every token: that costs a second
# decode call per token); must not exceed MAX_HELD_TOKENS.
ADVANCE_EVERY = 8
REANCHOR_ATTEMPTS = 8
# Characters that must follow a split point before the text left of it is settled: a UTF-8
# sequence is at most 4 bytes, and every decoded character consumes at least one byte.
SETTLED_LOOKAHEAD_CHARS = 4


class TokenDecoder(Protocol):
    """What we need from a tokenizer: `tokenizers.Tokenizer` and HF tokenizers both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


_SPECIALS: dict[int, tuple[Any, frozenset[int]]] = {}  # id(backend) -> (backend, ids): asked once per tokenizer


def _special_token_ids(backend: Any) -> frozenset[int]:
    """Ids that decode(skip_special_tokens=True) drops; empty if the backend cannot say. Listing the
    added tokens costs ~1 ms on a large vocabulary, so it is done once per backend, not per request."""
    cached = _SPECIALS.get(id(backend))
    if cached is not None and cached[0] is backend:
        return cached[1]
    added = getattr(backend, "get_added_tokens_decoder", None)
    ids = frozenset() if added is None else frozenset(
        int(i) for i, token in added().items() if getattr(token, "special", False))
    if len(_SPECIALS) > 64:
        _SPECIALS.clear()
    _SPECIALS[id(backend)] = (backend, ids)
    return ids


def _is_byte_fallback_token(token: str | None) -> bool:
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def _trailing_replacement_chars(text: str) -> int:
    return len(text) - len(text.rstrip(REPLACEMENT_CHAR))


class StreamingDetokenizer(Protocol):
    """What the detokenize stage uses: IncrementalDetokenizer, or ByteLevelDetokenizer
    (pipeline/detokenizer_bytes.py) for byte-level vocabularies."""

    @property
    def text(self) -> str: ...

    def push(self, token_ids: Sequence[int]) -> str: ...

    def push_one(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class EmittedText:
    """What every detokenizer keeps of its output: the emitted deltas (joined on demand) and whether
    flush() ended the sequence."""

    __slots__ = ("_pieces", "_finished")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        joined = "".join(self._pieces)
        self._pieces = [joined]
        return joined

    def push_one(self, token_id: int) -> str:
        """Add one generated id; return the newly settled text."""
        raise NotImplementedError

    def flush(self) -> str:
        """End of sequence: return what was held back."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("push() after flush(): the sequence has ended")

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta


@dataclass(slots=True, init=False, repr=False, eq=False)  # the backend's repr is the whole vocab
class IncrementalDetokenizer(EmittedText):
    """Streams text for generated ids; the joined deltas plus flush() equal
    `backend.decode(output_ids, skip_special_tokens=...)` for any chunking of the ids.

    `prompt_token_ids` is accepted so callers can pass what they have, but it is deliberately not
    used as decode context: the reference is the decode of the output ids alone, and left context
    would change the first token's text (e.g. a Metaspace decoder strips the leading space only of
    the first token of a decode call). A window that starts at the first output token reproduces
    the full decode's treatment of that token exactly.
    """

    backend: TokenDecoder
    skip_special_tokens: bool
    _dropped_ids: frozenset[int]  # special ids, removed up front when skipping them
    _window: list[int]  # prefix (already emitted) + tail (not yet settled)
    _read: int  # window[:_read] is the prefix
    _prefix_chars: int  # len(decode(window[:_read]))
    _tail_emitted: int  # characters of the tail's text already emitted
    _byte_run_start: int | None  # window index where a trailing run of byte-fallback tokens starts

    def __init__(
        self,
        backend: TokenDecoder,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        # Skipped specials must not sit at the window's start: the decoder would then treat the
        # next real token as "first" (and e.g. strip its space) where the full decode does not.
        self._dropped_ids = _special_token_ids(backend) if skip_special_tokens else frozenset()
        self._window, self._read, self._prefix_chars, self._tail_emitted = [], 0, 0, 0
        self._byte_run_start = None
        EmittedText.__init__(self)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the newly settled text ('' while a character is incomplete)."""
        self._check_open()
        ids = [int(i) for i in token_ids]
        if self._dropped_ids:
            ids = [i for i in ids if i not in self._dropped_ids]
        if not ids:
            return ""
        self._track_byte_run(ids)
        self._window.extend(ids)
        text = self._decode(self._window)
        tail = text[self._prefix_chars :]
        settled = len(tail) - _trailing_replacement_chars(tail)
        if self._byte_run_start is not None:
            before_run = self._decode(self._window[: self._byte_run_start])
            settled = min(settled, len(before_run) - self._prefix_chars)
        delta = tail[self._tail_emitted : settled]
        if settled == len(tail) and self._byte_run_start is None and len(self._window) - self._read >= ADVANCE_EVERY:
            self._advance()  # every few tokens, not every token: one decode call per push instead of two
        else:
            self._tail_emitted = max(self._tail_emitted, settled)
            if len(self._window) - self._read > MAX_HELD_TOKENS:
                delta += self._reanchor(text)
        return self._emit(delta)

    def push_one(self, token_id: int) -> str:
        return self.push([token_id])

    def flush(self) -> str:
        """End of sequence: release held text exactly as the full decode renders it."""
        if self._finished:
            return ""
        self._finished = True
        if self._read == len(self._window):
            return ""
        text = self._decode(self._window)
        return self._emit(text[self._prefix_chars + self._tail_emitted :])

    def _decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _track_byte_run(self, ids: list[int]) -> None:
        id_to_token = getattr(self.backend, "id_to_token", None)
        if id_to_token is None:
            return
        for offset, token_id in enumerate(ids):
            if not _is_byte_fallback_token(id_to_token(token_id)):
                self._byte_run_start = None
            elif self._byte_run_start is None:
                self._byte_run_start = len(self._window) + offset

    def _advance(self) -> None:
        """The whole window is settled: its last tokens become the next step's left context."""
        self._window = self._window[-PREFIX_CONTEXT_TOKENS:]
        self._read = len(self._window)
        self._prefix_chars = len(self._decode(self._window))
        self._tail_emitted = 0

    def _reanchor(self, text: str) -> str:
        """Move the window start into a long held tail, at a split point whose left side is settled
        and decodes independently of the right side; return left-side text not yet emitted."""
        window = self._window
        highest = len(window) - 1 if self._byte_run_start is None else self._byte_run_start
        lowest = max(self._read, highest - REANCHOR_ATTEMPTS)
        for split in range(highest, lowest, -1):  # never inside a byte-fallback run
            context = self._decode(window[split - 1 : split])
            anchored = self._decode(window[split - 1 :])
            right = anchored[len(context) :]
            if not anchored.startswith(context) or len(right) < SETTLED_LOOKAHEAD_CHARS:
                continue
            if self._decode(window[:split]) + right != text:
                continue  # the split cuts through a character
            left_chars = len(text) - len(right)
            emitted_chars = self._prefix_chars + self._tail_emitted
            self._window, self._read, self._prefix_chars = window[split - 1 :], 1, len(context)
            self._tail_emitted = max(0, emitted_chars - left_chars)
            if self._byte_run_start is not None:
                self._byte_run_start -= split - 1
            return text[emitted_chars:left_chars]
        return ""


def new_detokenizer(backend: TokenDecoder, skip_special_tokens: bool = True) -> StreamingDetokenizer:
    """The fastest exact detokenizer for this tokenizer: a byte table for byte-level BPE
    vocabularies, else the windowed decode above (both stream exactly the full decode)."""
    from pipeline.detokenizer_bytes import ByteLevelDetokenizer, byte_table  # (its table check decodes with tokenizers)

    table = byte_table(backend)
    if table is not None:
        return ByteLevelDetokenizer(table, skip_special_tokens)
    return IncrementalDetokenizer(backend, skip_special_tokens=skip_special_tokens)
