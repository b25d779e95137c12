"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: a bounded in-memory LRU,
per server process (replica)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    messages: list[dict[str, Any]]  # the conversation up to and including the response (chat messages)
    response: bytes  # the response object as answered (JSON)


class ResponseStore:
    """Response id -> its StoredResponse; the least recently used goes first when full."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored."""
        with self._lock:
            return self._items.pop(response_id, None) is not None
