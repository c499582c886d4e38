"""One kept-open link to a peer sidecar's handshake listener, and resolving its address.

``PeerLink`` carries small request/reply calls (lease renewals, stage requests) matched by
``seq`` and feeds the link's ``Liveness`` (``kvxfer.sidecar.liveness``); ``PeerClient``
owns the links, one per endpoint.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvxfer.auth import sign_request
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import (
    DECODE_ERRORS,
    LayersAt,
    LayerWatch,
    LeaseRenew,
    LeaseState,
    Refused,
    Staged,
    StageRequest,
    encode,
    handshake_reply_decoder,
)
from kvxfer.sidecar.liveness import Liveness

# what a PeerLink carries (answered LeaseState / Staged / LayersAt)
LinkRequest = LeaseRenew | StageRequest | LayerWatch


class PeerLink:
    """One DEALER connection to a peer's handshake listener for small request/reply calls
    (lease renewals: one per read, so no connect per call). Replies are matched by ``seq``."""

    def __init__(self, sock: zmq.asyncio.Socket, secret: bytes = b"", stall_s: float = 0.0) -> None:
        self.sock = sock
        self.secret = secret  # what every request on this link is signed with (b"": nothing)
        self._seq = 0
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self.closed = False
        self.liveness = Liveness(stall_s, time.monotonic())  # what the peer owes, when it last spoke

    async def call(self, req: LinkRequest, timeout_s: float) -> Any:
        return await self.answer(self.send(req), timeout_s)

    def send(self, req: LinkRequest) -> tuple[int, asyncio.Future[Any]]:
        """Send now (not at the caller's next await); ``answer`` waits for the reply."""
        self._seq += 1
        seq = self._seq
        req = msgspec.structs.replace(req, seq=seq)
        if self.secret:  # signed after the seq is set: the signature covers every field
            req = sign_request(self.secret, req)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = fut
        if isinstance(req, LeaseRenew):  # (answered in the listener's loop at once; a StageRequest
            self.liveness.asked(seq, time.monotonic())  # waits for the prefill's NIXL thread)

        def sent(f: asyncio.Future[Any]) -> None:  # (pyzmq sends at once and reports in a future)
            e = None if f.cancelled() else f.exception()
            if e is not None and not fut.done():
                why = "peer listener not taking messages" if isinstance(e, zmq.Again) else f"peer link: {e}"
                fut.set_exception(RequestError(ErrorCode.HANDSHAKE_FAILED, why))

        self.sock.send(encode(req), flags=zmq.NOBLOCK).add_done_callback(sent)
        return seq, fut

    async def answer(self, sent: tuple[int, asyncio.Future[Any]], timeout_s: float) -> Any:
        seq, fut = sent
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise RequestError(ErrorCode.HANDSHAKE_FAILED,
                               f"no answer from the peer in {timeout_s}s") from None
        finally:
            self._waiting.pop(seq, None)
            self.liveness.dropped(seq)  # (answered: gone already; else nobody waits for it now)

    async def run(self) -> None:
        """Hand each reply to its caller until closed."""
        try:
            while not self.closed:
                frames = await self.sock.recv_multipart()
                self.liveness.heard(time.monotonic())
                try:
                    reply = handshake_reply_decoder.decode(frames[0])
                except DECODE_ERRORS:
                    continue
                if isinstance(reply, LeaseState | Staged | LayersAt):
                    self.liveness.answered(reply.seq, time.monotonic())
                    fut = self._waiting.get(reply.seq)
                    if fut is not None and not fut.done():
                        fut.set_result(reply)
                elif isinstance(reply, Refused):  # unsigned/refused: fail every waiting call
                    for fut in self._waiting.values():
                        if not fut.done():
                            fut.set_exception(RequestError(reply.code, reply.reason))
        except (zmq.ZMQError, asyncio.CancelledError):
            pass
        finally:
            self.close()

    def close(self, why: RequestError | None = None) -> None:
        """Close the socket; with ``why``, every call still waiting fails with it at once."""
        if not self.closed:
            self.closed = True
            self.sock.close(0)
        if why is not None:
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(RequestError(why.code, why.reason))


RenewalSent = tuple[PeerLink, tuple[int, "asyncio.Future[Any]"]]  # PeerClient.send_renewal


async def resolve(host: str, port: int, timeout_s: float) -> str:
    """host -> a tcp:// address with an IP literal, resolved off the ZMQ I/O thread.

    ZMQ resolves names inside its I/O thread, so one unresolvable host would stall
    every socket of the context for the resolver's timeout.
    """
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM),
            timeout_s)
    except (OSError, UnicodeError, ValueError, TimeoutError) as e:
        raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"cannot resolve {host!r}: {e}") from None
    if not infos:
        raise RequestError(ErrorCode.HANDSHAKE_FAILED, f"cannot resolve {host!r}")
    family, _, _, _, sockaddr = infos[0]
    ip = sockaddr[0]
    return f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}"
