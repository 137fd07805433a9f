"""The scheduler's waiting queue: requests in scheduling order, with O(log n) push and pop and
O(1) removal of any request.

Aborts land anywhere in the queue (a client leaves while thousands wait), so removal must not scan
it. A heap gives the order; a removed request's heap entry is left in place and skipped when it
surfaces (lazy deletion). Each push gets a fresh ticket, so a request that leaves and comes back
(preempted, held back) is never confused with its own stale entry.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from kvflow.core.request import Request


class WaitingQueue:
    def __init__(self, order: Callable[[Request], tuple]) -> None:
        self._order = order
        self._heap: list[tuple[tuple, int, Request]] = []
        self._tickets: dict[Request, int] = {}  # the live entry of each queued request
        self._next_ticket = itertools.count()

    def push(self, request: Request) -> None:
        ticket = next(self._next_ticket)
        self._tickets[request] = ticket
        heapq.heappush(self._heap, (self._order(request), ticket, request))
        if len(self._heap) > 2 * len(self._tickets) + 64:
            self._compact()  # many removed entries: keep the heap proportional to the queue

    def pop(self) -> Request:
        """The first request in order; IndexError if the queue is empty."""
        self._skip_removed()
        _, _, request = heapq.heappop(self._heap)
        del self._tickets[request]
        return request

    def peek(self) -> Request:
        self._skip_removed()
        return self._heap[0][2]

    def remove(self, request: Request) -> bool:
        """Take `request` out wherever it is; False if it was not queued."""
        return self._tickets.pop(request, None) is not None

    def __contains__(self, request: Request) -> bool:
        return request in self._tickets

    def __len__(self) -> int:
        return len(self._tickets)

    def __bool__(self) -> bool:
        return bool(self._tickets)

    def __iter__(self) -> Iterator[Request]:
        """The queued requests in order (a sorted copy: for inspection, not for the hot path)."""
        return iter(sorted(self._tickets, key=lambda r: (self._order(r), self._tickets[r])))

    def _skip_removed(self) -> None:
        heap = self._heap
        while heap and self._tickets.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        if not heap:
            raise IndexError("pop from an empty waiting queue")

    def _compact(self) -> None:
        self._heap = [entry for entry in self._heap if self._tickets.get(entry[2]) == entry[1]]
        heapq.heapify(self._heap)
