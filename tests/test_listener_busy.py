"""The prefill's handshake listener never stops reading (#37 review): with every slot taken by
requests waiting for its NIXL thread, a lease renewal is still answered at once (else its
readers would judge it stalled), a hello is refused ``busy`` at once and a stage request is
answered ``busy`` (the reader reads directly). In process: a real ZMQ listener, the
listener's own loop, the slow answers stood in for by a sleep."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from kvxfer.errors import ErrorCode
from kvxfer.protocol import (
    PROTOCOL_VERSION,
    Hello,
    LeaseRenew,
    LeaseState,
    Refused,
    Staged,
    StageRequest,
    encode,
    handshake_reply_decoder,
)
from kvxfer.sidecar import peer_server


def test_a_full_listener_still_answers_renewals_and_refuses_the_rest_at_once(monkeypatch: Any) -> None:
    monkeypatch.setattr(peer_server, "LISTENER_CONCURRENCY", 2)

    class Slow(peer_server.PeerServer):
        def __init__(self) -> None:
            self._tasks: set[asyncio.Task[None]] = set()
            self.observer = type("O", (), {"handshake_refused": lambda *a: None})()

        async def _answer(self, request: Any, addr: str = "") -> Any:
            await asyncio.sleep(2.0)  # (a hello waiting for a busy NIXL thread)
            return Refused(version=PROTOCOL_VERSION, code="x", reason="slow"), []

        def _answer_renewal(self, msg: LeaseRenew, frame: Any) -> LeaseState:
            return LeaseState(seq=msg.seq, held=["held"] * len(msg.req_ids))

    async def run() -> dict[str, float]:
        ctx = zmq.asyncio.Context()
        lst, cli = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        port = lst.bind_to_random_port("tcp://127.0.0.1")
        cli.connect(f"tcp://127.0.0.1:{port}")
        server = asyncio.ensure_future(Slow().serve(lst))
        hello = Hello(version=PROTOCOL_VERSION, compat_hash="h", engine_id="e", agent_name="a")
        try:
            for _ in range(2):  # every slot taken
                await cli.send(encode(hello))
            await asyncio.sleep(0.1)
            loop = asyncio.get_running_loop()
            took: dict[str, float] = {}
            for name, msg in (("renewal", LeaseRenew(seq=7, engine_id="e", req_ids=["r"], agent_name="a")),
                              ("hello", hello),
                              ("stage", StageRequest(seq=8, engine_id="e", req_id="r", ranks=[], nbytes=1,
                                                     readers=["0/0"], agent_name="a"))):
                t0 = loop.time()
                await cli.send(encode(msg))
                reply = handshake_reply_decoder.decode(await asyncio.wait_for(cli.recv(), 1.0))
                took[name] = loop.time() - t0
                if name == "renewal":
                    assert isinstance(reply, LeaseState)
                    assert reply.seq == 7
                elif name == "hello":
                    assert isinstance(reply, Refused)
                    assert reply.code == ErrorCode.BUSY
                else:
                    assert isinstance(reply, Staged)
                    assert (reply.seq, reply.held) == (8, "busy")
            return took
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
            lst.close(0)
            cli.close(0)
            ctx.term()

    took = asyncio.run(run())
    assert max(took.values()) < 0.5, took  # (it used to wait 2 s for a slot, the renewal with it)
