"""``--verify-sample``: digest a received read here and the same bytes at the prefill,
which still holds them (its lease runs until our read notice); a mismatch fails the load.

Which reads are checked: the first from each peer (a wrong layout shows at once), then one
in ``verify_sample``. A digest that cannot be taken is not a verdict on the bytes: the read
stands (counted ``unverified``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.integrity import digest_items
from kvxfer.observe import Observer
from kvxfer.protocol import DigestRank, DigestRequest, Recv
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.peer_book import Peer, PeerBook
from kvxfer.sidecar.peer_client import PeerClient
from kvxfer.sidecar.registry import RankKey, RankRegistry
from kvxfer.topology import BlockPairing, RankPlan

log = logging.getLogger("kvxfer.receiver")

Plan = Callable[[], tuple[list[RankPlan], BlockPairing]]


class Verifier:
    def __init__(self, config: Config, registry: RankRegistry, peers: PeerClient, book: PeerBook,
                 nixl: NixlPort, observer: Observer) -> None:
        self.config = config
        self.registry = registry
        self.peers = peers
        self.book = book
        self.nixl = nixl
        self.observer = observer
        self._receives_done = 0  # successful reads so far (1 in verify_sample is checked)

    def sample(self, peer: Peer) -> bool:
        """Verify this read?"""
        n = self.config.verify_sample
        if n <= 0:
            return False
        self._receives_done += 1
        return self.book.first_check(peer) or self._receives_done % n == 0

    async def verify(self, msg: Recv, local: RankKey, remote_engine: str, plan: Plan,
                     peer: Peer) -> RequestError | None:
        """None when the digests match or could not be taken; else the integrity failure."""
        t0 = time.monotonic()
        where = f"{msg.remote_host}:{msg.remote_port}"
        try:
            plans, pairing = plan()
            items = digest_items(plans, pairing, list(msg.block_ids), list(msg.remote_block_ids),
                                 msg.state_pairs)
            ranks = sorted(items)
            req = DigestRequest(
                req_id=msg.remote_req_id or msg.req_id, agent_name=self.nixl.agent_name,
                engine_id=remote_engine, token=msg.remote_token,
                ranks=[DigestRank(rank=key[1], items=items[key][1], pp_rank=key[0],
                                  region0=items[key][2].remote_region0, num_regions=items[key][2].num_regions)
                       for key in ranks])
            timeout = self.config.handshake_timeout_s
            remote, here = await asyncio.gather(
                self.peers.request_digest(msg.remote_host, msg.remote_port, req, timeout),
                asyncio.gather(*(self.nixl.digest(local, items[r][0], items[r][2].local_region0,
                                                  items[r][2].num_regions) for r in ranks)),
            )
        except Exception as e:
            log.warning("receive %s from %s not verified: %s", msg.req_id, where, e)
            self.observer.integrity_checked("unverified", time.monotonic() - t0)
            return None
        took = time.monotonic() - t0
        if list(here) == list(remote):
            self.observer.integrity_checked("ok", took)
            return None
        entry = self.registry.get(local)
        remote_layout = next((r.layout for r in peer.engine_ranks(remote_engine).values()), None)
        log.error("integrity: receive %s (rank %d) from %s: decode digests %s != prefill digests %s; "
                  "decode layout %s; prefill layout %s; the load fails and is recomputed", msg.req_id,
                  msg.tp_rank, where, list(here), list(remote), entry.layout if entry else None,
                  remote_layout)
        self.observer.integrity_failure(msg.req_id, where, msg.tp_rank, list(here), list(remote), took)
        return RequestError(ErrorCode.INTEGRITY, f"received bytes differ from the prefill's (digests "
                            f"{list(here)} vs {list(remote)})", msg.req_id)
