"""Leases on held prefill blocks: pure bookkeeping, no I/O, no clock of its own.

A lease is released exactly once, for exactly one reason: the expected number of read
notices arrived ("read"), a reader gave up ("aborted"), the engine dropped the request
("aborted"), or time ran out ("expired"). Callers pass ``now`` so tests need no sleeps.

Leases are keyed by (engine, request id): the DP ranks of one deployment share a sidecar
and may see the same request id; each holds its own blocks.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field

from kvxfer.errors import ErrorCode, RequestError

LeaseKey = tuple[str, str]  # (engine, request id)
ENDED_MAX = 65536  # ended leases remembered (to tell "gone" from "not held yet")
READERS_MAX = 4096  # ranks one reader agent may name per lease (tp x pp of one decode engine)


@dataclass
class Lease:
    req_id: str
    owner: bytes  # ZMQ identity of the engine connection that asked for the hold
    block_ids: list[int]
    expires: float
    reads_expected: int = 1
    reads_seen: int = 0
    created: float = 0.0
    # the (pp, tp) ranks that finished reading, and those that started and did not yet, by
    # reader agent (its sidecar): two decode engines may read one request (a router retry)
    readers: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    reading: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    notify_ranks: bool = False  # release goes to every registered worker of the engine
    engine: str = ""
    duration: float = 0.0  # the lease's length: a keep-alive renews it by this much
    token: str = ""  # the request's capability: peers must present it ("": none was given)
    # push mode, several KV cache groups: the engine's lists per group and the prompt tokens it
    # computes (Hold.groups / num_tokens), for a decode to pair its own lists with
    groups: list[list[int]] | None = None
    num_tokens: int = 0
    queued: float = 0.0  # the time of its one entry in the expiry heap (at most ``expires``)
    expected_by: dict[str, int] = field(default_factory=dict)  # ranks each reader agent said it has
    # A push hold's read capability (``LayersAt.token``): a fresh one per Hold, so that a hold
    # again under the same transfer id (a router's retry: ``token`` is the id) is another
    # lease to a read's proof (its lease word, its claim, its notices). "": none (pull: its
    # ``token`` is fresh per hold already)
    read_token: str = ""

    def proof_token(self) -> str:
        """The capability a read of this lease proves it with (its lease word's key)."""
        return self.read_token or self.token

    @property
    def key(self) -> LeaseKey:
        return (self.engine, self.req_id)


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[LeaseKey, Lease] = {}
        self._heap: list[tuple[float, LeaseKey]] = []
        # Leases that ended (read, aborted, expired), newest last: a peer asking for one of
        # these learns it is gone for good, not merely not held yet (a Hold still in transit).
        self._ended: collections.OrderedDict[LeaseKey, None] = collections.OrderedDict()
        self.expired_total = 0
        self.released_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, key: LeaseKey) -> bool:
        return key in self._leases

    def get(self, key: LeaseKey) -> Lease | None:
        return self._leases.get(key)

    def resolve(self, engine: str, req_id: str) -> LeaseKey | None:
        """The key a peer's message means: (engine, req_id), or with no engine named (an
        older peer) the one lease of that request id, if exactly one."""
        if engine:
            return (engine, req_id) if (engine, req_id) in self._leases else None
        found = [k for k in self._leases if k[1] == req_id]
        return found[0] if len(found) == 1 else None

    def ended(self, engine: str, req_id: str) -> bool:
        """A lease of this request ended here recently (with no engine named: any engine's)."""
        if engine:
            return (engine, req_id) in self._ended
        return any(k[1] == req_id for k in reversed(self._ended))

    def add(self, lease: Lease) -> None:
        if lease.key in self._leases:
            raise RequestError(ErrorCode.DUPLICATE_REQUEST, "request already held", lease.req_id)
        self._leases[lease.key] = lease
        lease.queued = lease.expires
        heapq.heappush(self._heap, (lease.expires, lease.key))

    def note_started(self, key: LeaseKey, reader: tuple[str, int, int]) -> None:
        """A reader (agent, pp, tp) started: no other agent's notices release the lease under it."""
        lease = self._leases.get(key)
        agent, pp, tp = reader
        if lease is not None and (pp, tp) not in lease.readers.get(agent, set()):
            reading = lease.reading.setdefault(agent, set())
            if len(reading) < READERS_MAX:  # (a peer naming made-up ranks grows nothing: a review)
                reading.add((pp, tp))

    def note_read(self, key: LeaseKey, reader: tuple[str, int, int], expected: int = 0) -> Lease | None:
        """Count one reader's notice; return the lease once it may be released.

        A reader (its agent, pp and tp rank) is counted once, so a duplicated notice cannot
        release blocks another rank is still reading. The lease ends once every expected rank
        *of one agent* read (ranks of two decode engines never add up), and no other agent
        has a read in progress. ``expected`` (the decode side's rank count, sent with each
        notice) overrides the count the hold guessed, for that agent only (one agent's count
        once ended a lease that neither had finished: found by a review).
        """
        lease = self._leases.get(key)
        agent, pp, tp = reader
        done = lease.readers.setdefault(agent, set()) if lease is not None else set()
        if lease is None or (pp, tp) in done or len(done) >= READERS_MAX:
            return None
        if expected > 0:  # (its own: decodes of two TP sizes reading one request never mix counts)
            lease.expected_by[agent] = min(expected, READERS_MAX)
        done.add((pp, tp))
        lease.reading.get(agent, set()).discard((pp, tp))
        lease.reads_seen += 1
        finished = any(len(ranks) >= lease.expected_by.get(a, lease.reads_expected)
                       for a, ranks in lease.readers.items())
        if finished and not any(lease.reading.values()):
            return self.pop(key)
        return None

    def extend(self, key: LeaseKey, until: float) -> bool:
        """Keep a lease at least until ``until`` (a reader started and has this deadline)."""
        lease = self._leases.get(key)
        if lease is None or until <= lease.expires:
            return lease is not None
        lease.expires = until  # (its heap entry stays: ``expire`` queues it again when it comes up,
        # so a peer renewing a lease over and over does not grow the heap: found by a review)
        return True

    def pop(self, key: LeaseKey) -> Lease | None:
        lease = self._leases.pop(key, None)
        if lease is not None:
            self.released_total += 1
            self._ended[key] = None
            if len(self._ended) > ENDED_MAX:
                self._ended.popitem(last=False)
        return lease

    def expire(self, now: float) -> list[Lease]:
        """Remove and return every lease whose time ran out."""
        out: list[Lease] = []
        while self._heap and self._heap[0][0] <= now:
            queued, key = heapq.heappop(self._heap)
            lease = self._leases.get(key)
            if lease is None or lease.queued != queued:
                continue  # (an ended lease's, or an older lease's of the same key)
            if lease.expires <= now:
                out.append(lease)
                self.pop(key)
                self.expired_total += 1
            else:  # extended since it was queued: queued again, for when it now ends
                lease.queued = lease.expires
                heapq.heappush(self._heap, (lease.expires, key))
        return out

    def next_expiry(self) -> float | None:
        while self._heap and (
            self._heap[0][1] not in self._leases
            or self._leases[self._heap[0][1]].queued != self._heap[0][0]
        ):
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None  # (extended since: ``expire`` queues it again)

    def drain_all(self) -> list[Lease]:
        """Remove and return every lease (shutdown)."""
        out = list(self._leases.values())
        for lease in out:
            self.pop(lease.key)
        return out

    def items(self) -> list[Lease]:
        return list(self._leases.values())

    def drop(self, owner: bytes | None = None, engine: str | None = None) -> list[Lease]:
        """Remove and return the leases of one connection, or of one engine."""
        gone = [lease for lease in self._leases.values()
                if (owner is not None and lease.owner == owner)
                or (engine is not None and lease.engine == engine)]
        for lease in gone:
            self.pop(lease.key)
        return gone
