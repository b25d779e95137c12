"""The responses kept for `previous_response_id`: a bounded in-memory LRU, per server process (replica)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

MAX_STORED_RESPONSES = 1024


class ResponseStore:
    """Response id -> the conversation up to and including that response (chat messages as dicts)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response_id] = messages
            self._items.move_to_end(response_id)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            messages = self._items.get(response_id)
            if messages is not None:
                self._items.move_to_end(response_id)
            return None if messages is None else list(messages)
