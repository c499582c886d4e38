"""The peer client against a real ZMQ listener (no NIXL): one kept-open link per endpoint,
however many claims ask at once, and nothing left open at close (a ZMQ context does not
terminate while one of its sockets is open: a sidecar stopped by SIGINT hung there until
killed, 10 s in every test that stopped one)."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from kvxfer.config import Config
from kvxfer.observe import Observer
from kvxfer.protocol import DigestRequest, LeaseRenew, LeaseState, encode, handshake_request_decoder
from kvxfer.sidecar.peer_book import PeerBook
from kvxfer.sidecar.peer_client import PeerChannel, PeerClient


async def _listener(sock: zmq.asyncio.Socket, slow_s: float) -> None:
    """Answer every LeaseRenew with "held", after ``slow_s``; nothing else, ever."""
    while True:
        ident, body = await sock.recv_multipart()
        req = handshake_request_decoder.decode(body)
        if not isinstance(req, LeaseRenew):
            continue
        await asyncio.sleep(slow_s)
        await sock.send_multipart([ident, encode(LeaseState(seq=req.seq, held=["held"] * len(req.req_ids)))])


def test_concurrent_claims_share_one_link_and_close_leaves_nothing_open() -> None:
    async def run() -> tuple[int, int]:
        ctx, dial_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        serving = asyncio.ensure_future(_listener(server, 0.05))
        client = PeerClient(config=Config(), channel=PeerChannel("d", "agent-d"), dial_ctx=dial_ctx,
                            book=PeerBook(), registry=None, nixl=None, observer=Observer())  # type: ignore[arg-type]
        renew = LeaseRenew(seq=0, engine_id="p", req_ids=["r"], agent_name="agent-d")
        answers = await asyncio.gather(*(client.call_peer("127.0.0.1", port, renew, 5.0) for _ in range(4)))
        assert all(a.held == ["held"] for a in answers)
        dialed = len(client._socks)
        # a digest request (its own socket) still waiting for its answer when the client closes
        pending = asyncio.ensure_future(client.request_digest("127.0.0.1", port,
                                                              DigestRequest(req_id="r", ranks=[]), 5.0))
        await asyncio.sleep(0.01)
        client.close()
        open_after = sum(not s.closed for s in client._socks)
        serving.cancel()
        pending.cancel()
        await asyncio.gather(serving, pending, return_exceptions=True)
        server.close(0)
        await asyncio.wait_for(asyncio.to_thread(dial_ctx.term), 5.0)  # (hangs with a socket open)
        ctx.term()
        return dialed, open_after

    dialed, open_after = asyncio.run(run())
    assert dialed == 1  # four claims at once, one link
    assert open_after == 0


def test_a_send_with_no_connection_to_queue_on_ends_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dialed socket that cannot queue a message (here: ZMQ_IMMEDIATE toward a port nobody
    listens on; a test's plain DEALER to a CURVE listener hung so twice under load) fails the
    digest request at its deadline, ``handshake_failed``, instead of waiting for ever: only
    the reply's poll was bounded before."""
    import time

    from kvxfer.errors import ErrorCode, RequestError
    from kvxfer.sidecar import peer_client
    from kvxfer.testing.procs import free_port

    def no_queue(ctx: zmq.asyncio.Context, addr: str, ch: PeerChannel) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # (no pipe until connected: a send waits)
        sock.connect(addr)
        return sock

    monkeypatch.setattr(peer_client, "dial", no_queue)

    async def run() -> tuple[RequestError, float]:
        dial_ctx = zmq.asyncio.Context()
        client = PeerClient(config=Config(), channel=PeerChannel("d", "agent-d"), dial_ctx=dial_ctx,
                            book=PeerBook(), registry=None, nixl=None, observer=Observer())  # type: ignore[arg-type]
        req = DigestRequest(req_id="r", ranks=[], agent_name="agent-d")
        t0 = time.monotonic()
        try:
            with pytest.raises(RequestError) as e:
                await asyncio.wait_for(client.request_digest("127.0.0.1", free_port(), req, 0.3), 5.0)
            return e.value, time.monotonic() - t0
        finally:
            client.close()
            dial_ctx.term()

    err, took = asyncio.run(run())
    assert err.code == ErrorCode.HANDSHAKE_FAILED, err
    assert "not sent" in err.reason, err
    assert took < 2.0, took
