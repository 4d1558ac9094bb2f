"""The requests an engine worker is generating, in the order they started.

The worker reads it to answer three questions: which requests to hand over on a
rebalance (the youngest), when every request handed back on a release has replied
(``empty``), and how long a lent engine was busy while it served (``busy_seconds``,
reported to the tag-scheduler with the release).
"""

from __future__ import annotations

import asyncio
import time


class InFlight:
    """The requests this engine is generating: which, whether none, and how long there
    has been at least one since ``reset_busy`` (the yield of a lent engine)."""

    def __init__(self) -> None:
        self.ids: dict[str, None] = {}
        """In the order they started (a dict keeps insertion order)."""
        self.empty = asyncio.Event()
        self.empty.set()
        self._busy_total = 0.0
        self._busy_since: float | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, request_id: str) -> None:
        if not self.ids:
            self._busy_since = time.monotonic()
            self.empty.clear()
        self.ids[request_id] = None

    def youngest(self, count: int) -> list[str]:
        """Up to ``count`` requests, the most recently started first."""
        return list(reversed(self.ids))[: max(count, 0)]

    def discard(self, request_id: str) -> None:
        self.ids.pop(request_id, None)
        if not self.ids:
            if self._busy_since is not None:
                self._busy_total += time.monotonic() - self._busy_since
                self._busy_since = None
            self.empty.set()

    def reset_busy(self) -> None:
        self._busy_total = 0.0
        self._busy_since = time.monotonic() if self.ids else None

    def busy_seconds(self) -> float:
        running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_total + running
