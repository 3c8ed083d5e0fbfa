"""The waiting requests: grouped by shape, ordered by priority then age, with deadlines.

Not thread-safe by itself: the Batcher holds its lock around every call.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator

from enginekit.batcher.request import DEAD, QUEUED, TAKEN, Key, Request


class Group:
    """Requests whose non-batch dims agree, so they can share a batch; one FIFO per priority."""

    __slots__ = ("key", "levels", "rows")

    def __init__(self, key: Key) -> None:
        self.key = key
        self.levels: dict[int, deque[Request]] = {}
        self.rows = 0

    def add(self, request: Request) -> None:
        level = self.levels.get(request.priority)
        if level is None:
            level = self.levels[request.priority] = deque()
        level.append(request)
        self.rows += request.rows

    def heads(self) -> Iterator[Request]:
        """The oldest live request of each priority level (dropping dead ones on the way)."""
        for prio in list(self.levels):
            level = self.levels[prio]
            while level and level[0].state != QUEUED:
                level.popleft()
            if level:
                yield level[0]
            else:
                del self.levels[prio]

    def oldest(self) -> Request | None:
        if len(self.levels) == 1:  # one priority level, the common case: its head
            return next(self.heads(), None)
        return min(self.heads(), key=lambda r: r.seq, default=None)

    def rank(self, now: float, starve: float) -> tuple[bool, int, int]:
        """Sort key of the group's most urgent request: starved first, then priority, then age."""
        best = (False, -(2**62), 0)
        for r in self.heads():
            cand = (r.arrival <= now - starve, r.priority, -r.seq)
            best = max(best, cand)
        return best

    def order(self, now: float, starve: float) -> list[deque[Request]]:
        """Priority levels in serving order: a level whose oldest request has waited past the
        starvation bound goes first (oldest first), then the rest by priority, highest first."""
        if len(self.levels) == 1:
            return list(self.levels.values())
        heads = {r.priority: r for r in self.heads()}
        starved = sorted((r.seq, p) for p, r in heads.items() if r.arrival <= now - starve)
        rest = sorted((p for p in heads if heads[p].arrival > now - starve), reverse=True)
        return [self.levels[p] for _, p in starved] + [self.levels[p] for p in rest]


class WaitQueue:
    """All waiting requests, by group, plus a heap of their deadlines."""

    def __init__(self) -> None:
        self.groups: dict[Key, Group] = {}
        self.count = 0  # live queued requests
        self.rows = 0
        self._seq = 0
        self._deadlines: list[tuple[float, int, Request]] = []

    @property
    def has_deadlines(self) -> bool:
        return bool(self._deadlines)

    def add(self, request: Request) -> int:
        """Queue ``request``; returns the rows now waiting in its group."""
        self._seq += 1
        request.seq = self._seq
        group = self.groups.get(request.key)
        if group is None:
            group = self.groups[request.key] = Group(request.key)
        group.add(request)
        self.count += 1
        self.rows += request.rows
        if request.deadline != math.inf:
            heapq.heappush(self._deadlines, (request.deadline, request.seq, request))
        return group.rows

    def _remove(self, request: Request) -> None:
        request.state = DEAD
        self.count -= 1
        self.rows -= request.rows
        group = self.groups[request.key]
        group.rows -= request.rows
        if group.rows == 0:
            del self.groups[request.key]

    def expire(self, now: float) -> list[Request]:
        """Remove and return the queued requests whose deadline has passed."""
        expired = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, request = heapq.heappop(heap)
            if request.state == QUEUED:
                self._remove(request)
                expired.append(request)
        return expired

    def next_deadline(self) -> float:
        heap = self._deadlines
        while heap and heap[0][2].state != QUEUED:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def purge_cancelled(self) -> int:
        """Drop requests whose Future was cancelled; returns how many."""
        dropped = 0
        for group in list(self.groups.values()):
            for level in group.levels.values():
                for r in level:
                    if r.state == QUEUED and r.future.cancelled():
                        self._remove(r)
                        dropped += 1
        return dropped

    def take(self, group: Group, rows: int, now: float, starve: float) -> list[Request]:
        """Up to ``rows`` rows of ``group`` in serving order (at least one request)."""
        taken: list[Request] = []
        total = 0
        for level in group.order(now, starve):
            while level:
                r = level[0]
                if r.state != QUEUED:
                    level.popleft()
                    continue
                if taken and total + r.rows > rows:
                    break
                level.popleft()
                r.state = TAKEN
                self.count -= 1
                self.rows -= r.rows
                group.rows -= r.rows
                taken.append(r)
                total += r.rows
                if total >= rows:
                    break
            if total >= rows:
                break
        if group.rows == 0:
            self.groups.pop(group.key, None)
        return taken

    def take_all(self) -> list[Request]:
        """Remove and return every queued request (for close without draining)."""
        out = []
        for group in self.groups.values():
            for level in group.levels.values():
                for r in level:
                    if r.state == QUEUED:
                        r.state = DEAD
                        out.append(r)
        self.groups.clear()
        self.count = self.rows = 0
        self._deadlines.clear()
        return out
