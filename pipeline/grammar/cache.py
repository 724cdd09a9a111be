"""Compiled grammars kept for reuse: least recently used out first, bounded by their bytes.

A compiled grammar holds a token mask for each of its states: megabytes for an agent's tool set, more on a large
vocabulary, so a count of entries does not bound memory. Each entry is charged xgrammar's `memory_size_bytes` plus
its spec's source (the key). Grammars in use by running requests are referenced by their matchers and live on after
eviction; the bound is on what the cache alone keeps alive.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pipeline.grammar.spec import GrammarSpec


@dataclass(slots=True)
class GrammarCache:
    max_bytes: int
    bytes: int = 0
    evictions: int = 0
    _entries: OrderedDict[GrammarSpec, tuple[Any, int]] = field(default_factory=OrderedDict)

    def get(self, spec: GrammarSpec) -> Any | None:
        entry = self._entries.get(spec)
        if entry is None:
            return None
        self._entries.move_to_end(spec)
        return entry[0]

    def put(self, spec: GrammarSpec, compiled: Any, memory_bytes: int) -> bool:
        """Keep `compiled`, evicting the least recently used entries to stay within max_bytes. False when it is
        larger than the whole cache (then it is not kept, and nothing is evicted for it)."""
        size = memory_bytes + len(spec.source)
        old = self._entries.pop(spec, None)
        if old is not None:
            self.bytes -= old[1]
        if size > self.max_bytes:
            return False
        while self._entries and self.bytes + size > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted
            self.evictions += 1
        self._entries[spec] = (compiled, size)
        self.bytes += size
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, spec: GrammarSpec) -> bool:
        return spec in self._entries
