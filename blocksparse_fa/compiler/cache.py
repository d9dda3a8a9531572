"""A small least-recently-used cache that is safe under threads without a lock.

Every operation is a single dict operation (atomic under the GIL) or tolerates another thread having
changed the dict in between: two threads that miss at once both compute the value and one of them
wins, which costs time, never correctness. No lock means nothing that a tracer or a signal handler
can deadlock on.
"""

from __future__ import annotations

__all__ = ["LRUCache"]


class LRUCache:
    """``get``/``put`` with least-recently-used eviction beyond ``capacity`` entries."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._d: dict = {}
        self._hits = 0
        self._misses = 0

    def get(self, key, default=None):
        try:
            value = self._d.pop(key)
        except KeyError:
            self._misses += 1
            return default
        self._d[key] = value  # re-insert: most recently used last
        self._hits += 1
        return value

    def put(self, key, value) -> None:
        self._d[key] = value
        while len(self._d) > self.capacity:
            try:
                del self._d[next(iter(self._d))]
            except (KeyError, StopIteration, RuntimeError):  # another thread changed it meanwhile
                break

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)

    def info(self) -> dict:
        return {"hits": self._hits, "misses": self._misses, "size": len(self._d)}
