"""Finds stalled peers and drops them (#37; the judgement is ``kvxfer.sidecar.liveness``).

Every tick (a quarter of --peer-stall-s, at most 0.25 s): a peer whose link owes an answer
and has been silent for --peer-stall-s is dropped (``PeerClient.drop_stalled``: its waiting
claims and its reads fail ``peer_stalled``, its reads settle at once, the next request
handshakes it again); a peer that reads run against, owing nothing and silent for a quarter of
that, is probed with a renewal of no lease, and so is one that reads run against with no
link open at all (the probe opens one: a read its lease word proves sends no claim, which
used to open it; found by a review, the decode sidecar exited ``ReadStuck`` under a frozen
prefill); so is any peer after --peer-idle-probe-s with nothing asked of it (one that does
not answer is let go, counted as a disconnection, not a stall: a prefill that was replaced
or scaled away).

Why a stalled peer's reads are safe: a read is delivered only once the prefill sidecar
answered its claim, or once the lease's word, read after the data landed, showed the lease
with the prefill *engine's* own deadline more than 2 s away (``lease_words``: the engine
frees held blocks by itself only past that deadline, frozen sidecar or not). So a peer that
stopped answering has a read delivered only while its engine still keeps the blocks (over
RDMA a frozen process's NIC still serves READs: such bytes are right), and never after. The
engine is told only once the read settled, so nothing lands in blocks it reuses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvxfer.config import Config
from kvxfer.sidecar.peer_book import PeerBook
from kvxfer.sidecar.peer_client import PeerClient


class StallGuard:
    def __init__(self, config: Config, peers: PeerClient, book: PeerBook,
                 reading_from: Callable[[], set[str]]) -> None:
        self.config = config
        self.peers = peers
        self.book = book
        self.reading_from = reading_from  # endpoints that reads in flight run against
        self._probes: dict[str, asyncio.Task[None]] = {}  # by endpoint: one at a time

    @property
    def enabled(self) -> bool:
        return self.config.peer_stall_s > 0

    async def run(self) -> None:
        tick = min(0.25, self.config.peer_stall_s / 4)
        try:
            while True:
                await asyncio.sleep(tick)
                await self.check(time.monotonic())
        finally:
            for task in self._probes.values():
                task.cancel()

    async def check(self, now: float) -> None:
        for key, silent_s in self.peers.stalled_links(now):
            await self.peers.drop_stalled(key, silent_s, idle=key not in self.reading_from())
        reading, idle_s = self.reading_from(), self.config.peer_idle_probe_s
        for key in {*self.peers.link_keys(), *reading}:  # (reading, no link: probed now, opening one)
            after_s = 0.0 if key in reading else idle_s  # (0.0: a quarter of --peer-stall-s)
            if key not in reading and not idle_s:
                continue
            peer = self.book.get(key)
            if peer is not None and key not in self._probes and self.peers.probe_due(key, now, after_s):
                host, _, port = key.rpartition(":")
                task = self._probes[key] = asyncio.ensure_future(self.peers.probe(host, int(port),
                                                                                 peer.engine_id))
                task.add_done_callback(lambda _t, key=key: self._probes.pop(key, None))
