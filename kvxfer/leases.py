"""Leases on held prefill blocks: pure bookkeeping, no I/O, no clock of its own.

A lease is released exactly once, for exactly one reason: the expected number of read
notices arrived ("read"), a reader gave up ("aborted"), the engine dropped the request
("aborted"), or time ran out ("expired"). Callers pass ``now`` so tests need no sleeps.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kvxfer.errors import ErrorCode, RequestError


@dataclass
class Lease:
    req_id: str
    owner: bytes  # ZMQ identity of the engine connection that asked for the hold
    block_ids: list[int]
    expires: float
    reads_expected: int = 1
    reads_seen: int = 0
    created: float = 0.0
    readers: set[int] = field(default_factory=set)
    notify_ranks: bool = False  # release goes to every registered worker of the engine


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._heap: list[tuple[float, str]] = []
        self.expired_total = 0
        self.released_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._leases

    def get(self, req_id: str) -> Lease | None:
        return self._leases.get(req_id)

    def add(self, lease: Lease) -> None:
        if lease.req_id in self._leases:
            raise RequestError(ErrorCode.DUPLICATE_REQUEST, "request already held", lease.req_id)
        self._leases[lease.req_id] = lease
        heapq.heappush(self._heap, (lease.expires, lease.req_id))

    def note_read(self, req_id: str, reader: int, expected: int = 0) -> Lease | None:
        """Count one reader's notice; return the lease once all expected reads arrived.

        A reader (its tp rank) is counted once, so a duplicated notice cannot release
        blocks another rank is still reading. ``expected`` (the decode side's TP size, sent
        with each notice) overrides the count the hold guessed.
        """
        lease = self._leases.get(req_id)
        if lease is None or reader in lease.readers:
            return None
        if expected > 0:
            lease.reads_expected = expected
        lease.readers.add(reader)
        lease.reads_seen += 1
        if lease.reads_seen >= lease.reads_expected:
            return self.pop(req_id)
        return None

    def extend(self, req_id: str, until: float) -> bool:
        """Keep a lease at least until ``until`` (a reader started and has this deadline)."""
        lease = self._leases.get(req_id)
        if lease is None or until <= lease.expires:
            return lease is not None
        lease.expires = until
        heapq.heappush(self._heap, (until, req_id))
        return True

    def pop(self, req_id: str) -> Lease | None:
        lease = self._leases.pop(req_id, None)
        if lease is not None:
            self.released_total += 1
        return lease

    def expire(self, now: float) -> list[Lease]:
        """Remove and return every lease whose time ran out."""
        out: list[Lease] = []
        while self._heap and self._heap[0][0] <= now:
            expires, req_id = heapq.heappop(self._heap)
            lease = self._leases.get(req_id)
            if lease is not None and lease.expires == expires:
                out.append(lease)
                self.pop(req_id)
                self.expired_total += 1
        return out

    def next_expiry(self) -> float | None:
        while self._heap and (
            self._heap[0][1] not in self._leases
            or self._leases[self._heap[0][1]].expires != self._heap[0][0]
        ):
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def drain_all(self) -> list[Lease]:
        """Remove and return every lease (shutdown)."""
        out = list(self._leases.values())
        for lease in out:
            self.pop(lease.req_id)
        return out

    def items(self) -> list[Lease]:
        return list(self._leases.values())

    def drop_owner(self, owner: bytes) -> list[Lease]:
        gone = [lease for lease in self._leases.values() if lease.owner == owner]
        for lease in gone:
            self.pop(lease.req_id)
        return gone
