"""Keep-alives: a decode engine's requests still waiting for blocks renew their prefill
leases through this sidecar (``KeepAlive``), handshaking first so that the read that
follows starts warm; the engine is told which leases are gone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import Error, KeepAlive, LeaseRenew
from kvxfer.sidecar.peer_book import PeerBook
from kvxfer.sidecar.peer_client import PeerClient

log = logging.getLogger("kvxfer.receiver")


class LeaseKeeper:
    def __init__(self, config: Config, peers: PeerClient, book: PeerBook, send: Callable[[bytes, Any], None],
                 agent_name: str) -> None:
        self.config = config
        self.peers = peers
        self.book = book
        self._send = send
        self.agent_name = agent_name

    async def keepalive(self, ident: bytes, msg: KeepAlive) -> None:
        if len(msg.req_ids) != len(msg.remote_req_ids) or (
                msg.remote_tokens and len(msg.remote_tokens) != len(msg.req_ids)):
            self._send(ident, Error(code=ErrorCode.MALFORMED, message="keepalive: req_ids, "
                                    "remote_req_ids and remote_tokens differ in length"))
            return
        timeout = self.config.handshake_timeout_s
        try:
            peer = await asyncio.wait_for(self.peers.get_peer(msg.remote_host, msg.remote_port), 2 * timeout)
            engine = peer.resolve_engine(msg.remote_engine_id)
            renew = LeaseRenew(seq=0, engine_id=engine, req_ids=list(msg.remote_req_ids),
                               agent_name=self.agent_name, tokens=list(msg.remote_tokens))
            got = await self.peers.call_peer(msg.remote_host, msg.remote_port, renew, timeout)
        except (RequestError, TimeoutError) as e:
            log.info("keep-alive of %d leases at %s:%d not delivered: %s", len(msg.req_ids), msg.remote_host,
                     msg.remote_port, e)
            return
        if peer.outdated_by(got.generation):
            self.book.mark_stale(peer)  # its registrations changed: the read that follows handshakes first
        for local, held in zip(msg.req_ids, got.held, strict=False):
            if held == "gone":
                self._send(ident, Error(code=ErrorCode.EXPIRED, req_id=local,
                                        message="the prefill's lease on this request's blocks is over"))
