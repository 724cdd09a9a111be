"""The stored responses behind `previous_response_id`, GET and DELETE /v1/responses/{id}: in memory, bounded, LRU.

A stored response keeps its final body and the conversation it ends (its input items, then its output items), so
a follow-up that names it continues exactly that conversation. Past `capacity` the least recently used one is
dropped; a follow-up naming a dropped or unknown id gets a 404 (the client then sends the whole history).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_CAPACITY = 256


@dataclass(slots=True)
class StoredResponse:
    body: dict
    items: list[dict]  # the conversation: input items, then the response's output items


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, body: dict, items: list[dict]) -> None:
        if self.capacity <= 0:
            return
        self._entries[response_id] = StoredResponse(body, items)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
