"""The handshake listener lets the event loop turn while a peer floods it.

A message already queued on a ZMQ socket is taken without a turn of the loop, and a lease
renewal is answered inline; a peer sending renewals faster than they are answered held the
loop (every engine message, expiry and other peer) for as long as it kept on (found by a
review: 20,000 queued messages, a concurrent task ran 0 times). The listener alone, its
socket and renewal answer stood in for."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from unittest import mock

from kvxfer.protocol import LeaseRenew, LeaseState, encode
from kvxfer.sidecar.peer_server import PeerServer


class FloodedSocket:
    """Always has a renewal queued; counts the messages taken."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self.frame = mock.Mock()
        renew = LeaseRenew(seq=1, engine_id="p", req_ids=["r"], extend_s=1.0, agent_name="d")
        self.frame.bytes = encode(renew)

    async def recv_multipart(self, copy: bool = True) -> list[Any]:
        self.taken += 1
        if self.taken > self.limit:
            raise asyncio.CancelledError
        ident = mock.Mock()
        ident.bytes = b"peer"
        return [ident, self.frame]

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        pass


def test_a_flood_of_renewals_leaves_the_loop_its_turns() -> None:
    server = PeerServer.__new__(PeerServer)
    server._tasks = set()
    server._answer_renewal = lambda msg, frame: LeaseState(seq=msg.seq, held=["held"], published=[False])

    async def run() -> tuple[int, int]:
        sock = FloodedSocket(limit=30_000)
        ticks = 0

        async def other_work() -> None:  # (an engine message, an expiry, another peer)
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        other = asyncio.ensure_future(other_work())
        with contextlib.suppress(asyncio.CancelledError):
            await server.serve(sock)  # type: ignore[arg-type]
        other.cancel()
        return sock.taken, ticks

    taken, ticks = asyncio.run(run())
    assert taken > 30_000
    assert ticks >= 5, f"the loop turned {ticks} times while the listener took {taken} renewals"
