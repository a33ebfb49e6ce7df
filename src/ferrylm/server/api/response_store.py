"""The Responses API's store of earlier responses (``previous_response_id``, ``GET /v1/responses/{id}``): bounded
in entries and bytes, oldest evicted first.

This module must not import torch.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass


@dataclass
class StoredResponse:
    """A finished response: its object (for GET) and the conversation to continue from (template messages: the
    previous turns, this input and this output; without this request's ``instructions``)."""

    response: dict
    conversation: list[dict]


class ResponseStore:
    """Bounded, thread-safe map response id → :class:`StoredResponse`; the oldest entries go first when it holds
    more than ``capacity`` entries or more than ``max_bytes`` of conversation text (an agent's chain of turns
    stores each turn's whole conversation: the byte bound keeps a few huge ones from holding the memory).

    Args:
        capacity: entries kept (0: nothing is stored).
        max_bytes: bound on the summed size of the stored conversations and responses (as JSON, bytes).
    """

    DEFAULT_MAX_BYTES = 256 << 20

    def __init__(self, capacity: int, max_bytes: int = DEFAULT_MAX_BYTES):
        self.capacity = max(0, int(capacity))
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._items: collections.OrderedDict[str, tuple[StoredResponse, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        size = len(json.dumps(entry.conversation, ensure_ascii=False)) + len(json.dumps(entry.response))
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(rid, None)
            if old is not None:
                self.bytes -= old[1]
            self._items[rid] = (entry, size)
            self.bytes += size
            while len(self._items) > self.capacity or self.bytes > self.max_bytes:
                _, (_, n) = self._items.popitem(last=False)
                self.bytes -= n

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(rid)
            return None if item is None else item[0]

    def __len__(self) -> int:
        return len(self._items)
