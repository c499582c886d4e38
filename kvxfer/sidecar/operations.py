"""What the control plane may do to a sidecar, and the one view it reads.

The gRPC service (``kvxfer.control.service``) holds an ``Operations`` and nothing else of
the daemon: ``snapshot()`` copies each part's state into frozen views (``kvxfer.status``),
the verbs (cancel, connect and disconnect peers, drain, resume) go through the parts'
own doors, and the lifecycle tells it when readiness changes. Everything here runs on the
sidecar's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from dataclasses import dataclass

from kvxfer import __version__
from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Event, Observer
from kvxfer.protocol import PROTOCOL_VERSION
from kvxfer.sidecar.engines import Advertised
from kvxfer.sidecar.holds import Holds
from kvxfer.sidecar.lifecycle import Lifecycle
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.peer_book import Peer, PeerBook
from kvxfer.sidecar.peer_client import PeerChannel, PeerClient
from kvxfer.sidecar.receiver import Receiver
from kvxfer.sidecar.registry import RankRegistry
from kvxfer.status import LeaseView, Snapshot, TransferView, copies


@dataclass
class Parts:
    """The parts an operation reaches (built by the app, in its order)."""

    config: Config
    engine_id: str
    started: float
    advertised: Advertised
    channel: PeerChannel
    insecure: bool
    host_key: bool  # handshakes prove this host's key (no shared secret)
    lifecycle: Lifecycle
    observer: Observer
    registry: RankRegistry
    nixl: NixlPort
    book: PeerBook
    peers: PeerClient
    holds: Holds
    receiver: Receiver
    idle: asyncio.Event  # nothing in flight, nothing held


class Operations:
    def __init__(self, parts: Parts) -> None:
        self._p = parts

    @property
    def config(self) -> Config:
        return self._p.config

    @property
    def lifecycle(self) -> Lifecycle:
        return self._p.lifecycle

    @property
    def observer(self) -> Observer:
        return self._p.observer

    def snapshot(self) -> Snapshot:
        """Everything the control plane shows, copied now."""
        p = self._p
        now = time.monotonic()
        leases = [LeaseView(req_id=x.req_id, engine=x.engine, num_blocks=len(x.block_ids),
                            age_s=now - x.created, expires_in_s=x.expires - now, reads_seen=x.reads_seen,
                            reads_expected=x.reads_expected)
                  for x in p.holds.table.items()]
        transfers = [TransferView(req_id=st.msg.req_id, tp_rank=st.msg.tp_rank, peer=st.peer, state=st.state,
                                  num_blocks=len(st.msg.block_ids), nbytes=st.nbytes, age_s=now - st.started,
                                  deadline_in_s=st.deadline - now)
                     for st in p.receiver.recvs.values()]
        a = p.advertised
        return Snapshot(
            engine_id=p.engine_id, role=p.config.role, version=__version__,
            nixl_backends=list(p.nixl.backends), handshake_endpoint=f"{a.host}:{a.port}",
            agent_name=a.agent_name, protocol_version=PROTOCOL_VERSION,
            ucx_error_mode=p.config.ucx_error_mode, uptime_s=now - p.started, ready=p.lifecycle.ready,
            draining=p.lifecycle.draining, insecure=p.insecure, authenticated=bool(p.channel.secret),
            encrypted=p.channel.curve is not None, host_key=p.host_key, ranks=copies(p.registry.entries()),
            peers=copies(p.book.values()), leases=leases, transfers=transfers,
            totals=copy.copy(p.observer.totals))

    async def cancel(self, req_id: str, code: ErrorCode = ErrorCode.CANCELLED,
                     reason: str = "cancelled by operator") -> int:
        """Fail every rank's receive of a request now (all with no id); returns how many."""
        return await self._p.receiver.cancel(req_id, code, reason)

    async def connect_peer(self, host: str, port: int) -> Peer:
        """Pre-warm: handshake now so the first request does not pay for it."""
        if not self._p.registry:
            raise RequestError(ErrorCode.NOT_REGISTERED,
                               "register the engine's KV cache first: the handshake carries its layout")
        return await self._p.peers.get_peer(host, port)

    async def disconnect_peer(self, which: str) -> bool:
        """Forget a peer by endpoint (host:port) or engine id."""
        agents = {p.agent_name for k, p in self._p.book.items() if which in (k, p.engine_id)}
        dropped = False
        for agent in agents:
            dropped |= await self._p.peers.drop_peer(agent, "disconnected by operator")
        return dropped

    async def drain(self, timeout_s: float) -> tuple[bool, int, int, float]:
        """Refuse new holds/receives; wait for in-flight work; fail/release what is left
        (unless a resume came meanwhile: the work is taken again, and left alone)."""
        p = self._p
        start = time.monotonic()
        if p.lifecycle.drain():
            p.observer.emit(Event("drain_started"))
        resumes = p.lifecycle.resumes
        p.lifecycle.work(bool(p.receiver.recvs) or bool(len(p.holds)))  # (idle from the parts themselves)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(p.idle.wait(), timeout_s)
        if p.lifecycle.resumes != resumes:  # (resumed while it waited: what runs now is not its to end)
            return False, 0, 0, time.monotonic() - start
        failed = len(p.receiver.recvs)
        if failed:
            await p.receiver.cancel("", ErrorCode.DRAINING, "sidecar drained before the transfer finished")
        if p.lifecycle.resumes != resumes:  # (resumed during the cancels: the holds taken since are
            return False, failed, 0, time.monotonic() - start  # new work, not the drain's: a review)
        released = p.holds.release_all()
        took = time.monotonic() - start
        p.observer.emit(Event("drained", seconds=took))
        return failed == 0 and released == 0, failed, released, took

    async def resume(self) -> bool:
        """Undo a drain: new holds and receives are taken again. False: not draining.
        Raises RequestError (DRAINING) when the sidecar is stopping (SIGTERM): it exits once
        its drain ends, so taking work again would only hand it to a process about to go."""
        if self._p.lifecycle.stopping:
            raise RequestError(ErrorCode.DRAINING, "the sidecar is stopping (SIGTERM): it cannot resume")
        if not self._p.lifecycle.resume():
            return False
        self._p.observer.emit(Event("resumed"))
        return True
