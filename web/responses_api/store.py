"""Stored responses for GET / DELETE /v1/responses/{id} and previous_response_id: in memory, bounded.

Bounded three ways: at most max_count responses, at most max_bytes of them in all, none older than ttl seconds.
The oldest go first (insertion order is age order). Each entry is kept as serialized bytes (the response object,
and the conversation a continuation prepends), so what is counted is what is held. A response bigger than the
whole budget is not kept. With API keys, an entry belongs to the key that made it (its digest): another key
sees no such response.

A response to be stored is shown from its start (as OpenAI shows it): begin() registers it in progress, with a
view of the response as it stands, and end() forgets it once it is stored or its client has left. Those live
entries are bounded by the requests admitted, and hold nothing the request does not hold already.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# The entry's own object, its id string and the map's slot: a fixed cost counted beside the bytes.
ENTRY_OVERHEAD_BYTES = 512


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: bytes | None  # the digest of the API key that made it; None on a server without keys
    body: bytes  # the response object, as GET returns it
    conversation: bytes  # the items a continuation prepends (this response's input and output), as JSON
    stored_at: float
    num_input_items: int = 0  # the conversation's first items: the input (GET .../input_items lists them)

    @property
    def num_bytes(self) -> int:
        return len(self.body) + len(self.conversation) + ENTRY_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class ResponseInProgress:
    owner: bytes | None
    body: Callable[[], bytes]  # the response object as it stands now
    conversation: bytes  # its input items, as JSON (GET .../input_items lists them)


class ResponseStore:
    """Only the event-loop thread uses it (no lock): every method is synchronous and short."""

    def __init__(self, max_count: int, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_count < 0 or max_bytes < 0 or ttl <= 0:
            raise ValueError("the response store needs max_count >= 0, max_bytes >= 0 and ttl > 0")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._in_progress: dict[str, ResponseInProgress] = {}
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, response_id: str, owner: bytes | None, body: bytes, conversation: bytes, num_input_items: int = 0
    ) -> bool:
        """Keep a response (replacing one of the same id). False when it alone exceeds the budget."""
        self._drop(response_id)
        entry = StoredResponse(owner, body, conversation, self._clock(), num_input_items)
        if entry.num_bytes > self.max_bytes or self.max_count == 0:
            return False
        self._entries[response_id] = entry
        self.num_bytes += entry.num_bytes
        self._evict()
        return True

    def get(self, response_id: str, owner: bytes | None) -> StoredResponse | None:
        self._evict()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        return entry

    def delete(self, response_id: str, owner: bytes | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def begin(self, response_id: str, owner: bytes | None, body: Callable[[], bytes], conversation: bytes) -> None:
        """A response being made, to be stored when it finishes: found in progress until end()."""
        self._in_progress[response_id] = ResponseInProgress(owner, body, conversation)

    def end(self, response_id: str) -> None:
        """Idempotent: the response finished (and was stored, or not), or its client left."""
        self._in_progress.pop(response_id, None)

    def in_progress(self, response_id: str, owner: bytes | None) -> ResponseInProgress | None:
        entry = self._in_progress.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    @property
    def num_in_progress(self) -> int:
        return len(self._in_progress)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes

    def _evict(self) -> None:
        expired_before = self._clock() - self.ttl
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if (len(self._entries) <= self.max_count and self.num_bytes <= self.max_bytes
                    and oldest.stored_at > expired_before):  # fmt: skip
                return
            self._drop(oldest_id)
