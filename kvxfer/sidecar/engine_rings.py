"""Engine rings, the sidecar end (#38; the ring itself: ``kvxfer.ringchannel``).

Listens on ``<engine socket>.ring`` (unix ``SOCK_SEQPACKET``, 0600, in the engine socket's
private directory, owned under its lock), grants each connection that asks a ring (a memfd
and two eventfds, passed with ``SCM_RIGHTS``), and then, on the loop, drains the ring at
every ring of its doorbell and hands each message to ``EngineServer.deliver`` with the
connection's process as its sender: the same checks, handlers and replies as a message from
the ZMQ socket. Replies to the ring's identity go back through the ring
(``EngineServer.rings``). When the connection closes (the engine exited), or the ring turns
out corrupt (the engine scribbled on it), the ring is dropped and its memory freed.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import itertools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

import msgspec

from kvxfer.memchannel import map_fd, memfd
from kvxfer.observe import Observer
from kvxfer.ringchannel import (
    Ring,
    RingCorrupt,
    RingGranted,
    RingRefused,
    clear_doorbell,
    init_ring,
    ring_bytes,
    ring_doorbell,
    ring_encoder,
    ring_request_decoder,
    ring_socket_path,
)
from kvxfer.sidecar.engine_server import EngineServer, ipc_path
from kvxfer.sidecar.ownership import Creds
from kvxfer.sidecar.pool_server import listen_private, unlink_if_same
from kvxfer.sidecar.procfs import creds_of

log = logging.getLogger("kvxfer.sidecar")
RING_TURN_S = 0.02  # one ring's messages handled in one callback at most this long (others then run)
MAX_RINGS = 256  # rings open at once (one per engine rank connection); past it, refused
OPEN_TIMEOUT_S = 5.0


class TakingTurns:
    """A ring's messages handled one per loop turn while another ring has messages too, then
    the other rings' (and everything else's) turn; all at once while it is the only one. The
    TP ranks of an engine each post their Recv of a request on their own ring, and a request
    is acted on (a staged read's one StageRequest for all ranks) once every rank's is in:
    reading one ring whole before the next made every request wait for every ring (a 1 -> 8
    round waited ~40 ms; staged TP cells 5-15 % faster since, direct ones unchanged). A ring
    alone keeps being read whole: one message per turn there only paid a loop turn each (a
    prefill's burst of 1,200 Holds, on a loaded machine, fell behind the decodes' claims
    until 139 failed `expired`), and a time budget per turn lost most of the gain (a budget of
    ``RING_TURN_S`` bounds it now: one engine's backlog of millions of messages, in one callback,
    held every other engine and peer 23 s; found by a review). What was
    read waits here, in order; the ring is read again only once it is empty, so a flooding
    engine meets its full ring, as before."""

    def __init__(self, loop: asyncio.AbstractEventLoop, into: Ring, wake: int,
                 deliver: Callable[[bytes, int], None], corrupt: Callable[[RingCorrupt], None],
                 family: list[TakingTurns]) -> None:
        self._loop = loop
        self._into = into
        self._wake = wake
        self._deliver = deliver
        self._corrupt = corrupt
        self._family = family  # every open ring's (this sidecar's): who else has messages
        self._backlog: collections.deque[tuple[bytes, int]] = collections.deque()  # (body, read at ns)
        self._turning = False  # a turn is scheduled
        self._shut = False  # (a turn scheduled before the ring closed finds it released)
        family.append(self)

    def rang(self) -> None:
        """The doorbell rang."""
        clear_doorbell(self._wake)
        if not self._turning:
            self._turn()

    def close(self) -> None:
        """What the engine wrote before it let go is handled now, read or not, as when a ring
        was read whole at each doorbell (a ring waiting its turn with a backlog was not read
        again: what the engine wrote after that, a Release or a Cancel before it exited, was
        lost with the ring; found by a review)."""
        self._shut = True
        self._family.remove(self)
        with contextlib.suppress(RingCorrupt):  # (a scribbled ring: what was read still goes)
            self._read()
        while self._backlog:
            self._deliver(*self._backlog.popleft())

    def _read(self) -> None:
        """What the ring holds, into the backlog (RingCorrupt: a scribbled ring)."""
        frames = self._into.read_all()
        now = time.monotonic_ns()
        self._backlog.extend((body, now) for body in frames)

    def _waiting(self) -> bool:
        """Messages read and not handled yet, or written and not read (no system call)."""
        return bool(self._backlog) or self._into.pending()

    def _turn(self) -> None:
        self._turning = False
        if self._shut:
            return
        if not self._backlog:
            try:
                self._read()
            except RingCorrupt as e:
                self._corrupt(e)
                return
            if not self._backlog:
                return
        self._turning = True
        self._loop.call_soon(self._turn)  # (the next messages, or a look for new ones)
        self._deliver(*self._backlog.popleft())
        end = time.monotonic() + RING_TURN_S
        while (self._backlog and not any(t is not self and t._waiting() for t in self._family)
               and time.monotonic() < end):
            self._deliver(*self._backlog.popleft())


def ring_or_drop(doorbell: int, corrupt: Callable[[RingCorrupt], None]) -> None:
    """Ring the engine's doorbell; one that cannot be rung (the engine set the counter it shares
    to the top) drops its ring (the error escaped, killed the lease expiry task whose release
    was being sent, and so stopped the sidecar: found by a review)."""
    try:
        ring_doorbell(doorbell)
    except OSError as e:
        corrupt(RingCorrupt(f"its doorbell cannot be rung: {e}"))


def oversize(ident: bytes, size: int, max_frame: int) -> None:
    log.warning("engine ring %s: a %d-byte event is over its largest frame (%d); dropped", ident.decode(),
                size, max_frame)


class EngineRings:
    def __init__(self, server: EngineServer, observer: Observer, max_rings: int = MAX_RINGS) -> None:
        self.server = server
        self.observer = observer
        self.max_rings = max_rings
        self.path = ring_socket_path(server.endpoint) if ipc_path(server.endpoint) else ""
        self.sock: socket.socket | None = None
        self._ino = 0  # the socket file this process bound
        self._conns: set[asyncio.Task[None]] = set()
        self._numbers = itertools.count(1)
        self._turns: list[TakingTurns] = []  # every open ring's reader (kvxfer: TakingTurns)

    def waiting(self) -> bool:
        """Whether any engine ring has messages not handled yet (no system call)."""
        return any(t._waiting() for t in self._turns)

    def __len__(self) -> int:
        return len(self._conns)

    def bind(self) -> None:
        """Listen beside the engine socket (its directory was checked private and its lock is
        held by this process: a file left there by a predecessor is ours to replace)."""
        if not self.path:
            return
        self.sock, self._ino = listen_private(self.path)
        self.sock.setblocking(False)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            unlink_if_same(self.path, self._ino)  # (never a socket this process did not bind)

    async def serve(self) -> None:
        """Accept ring connections until cancelled."""
        if self.sock is None:
            await asyncio.Event().wait()  # (no ipc:// engine socket: no rings)
        loop = asyncio.get_running_loop()
        try:
            while True:
                conn, _ = await loop.sock_accept(self.sock)  # type: ignore[arg-type]
                if len(self._conns) >= self.max_rings:
                    self._refuse(conn, "busy", f"{self.max_rings} engine rings are open")
                    self.observer.connection_refused("ring", self.max_rings)
                    continue
                task = asyncio.ensure_future(self._serve_conn(conn))
                self._conns.add(task)
                task.add_done_callback(self._conns.discard)
        finally:
            for task in list(self._conns):
                task.cancel()

    @staticmethod
    def _refuse(conn: socket.socket, code: str, why: str) -> None:
        with contextlib.suppress(OSError):
            conn.send(ring_encoder.encode(RingRefused(code=code, message=why)))
        conn.close()

    async def _serve_conn(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        sender = creds_of(conn)
        if sender.uid not in (os.getuid(), 0):  # (as the memory channel: the file's 0600 says so too)
            self._refuse(conn, "unauthorized", "engine rings are for the sidecar's own uid")
            return
        try:
            data = await asyncio.wait_for(loop.sock_recv(conn, 4096), OPEN_TIMEOUT_S)
            req = ring_request_decoder.decode(data)
        except (TimeoutError, OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            self._refuse(conn, "malformed", f"expected a RingOpen: {e}")
            return
        size = ring_bytes(req.capacity)
        fd = memfd(size, "kvxfer-ring")
        try:
            mm = map_fd(fd, size, populate=False)  # (pages as the ring uses them)
        except BaseException:
            os.close(fd)
            raise
        init_ring(mm)
        wake, doorbell = (os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(2))
        ident = f"ring-{sender.pid}-{next(self._numbers)}-{secrets.token_hex(8)}".encode()  # (unguessable)
        try:
            conn.sendmsg([ring_encoder.encode(RingGranted(ident=ident.decode(), capacity=req.capacity))],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd, wake, doorbell]))])
        except OSError as e:
            log.warning("engine ring for pid %d not granted: %s", sender.pid, e)
            for f in (wake, doorbell):
                os.close(f)
            mm.close()
            conn.close()
            return
        finally:
            os.close(fd)  # (the mapping keeps the memory; the engine has its own fd)
        await self._run_ring(conn, ident, mm, req.capacity, wake, doorbell, sender)

    async def _run_ring(self, conn: socket.socket, ident: bytes, mm: object, capacity: int, wake: int,
                        doorbell: int, sender: Creds) -> None:
        loop = asyncio.get_running_loop()
        out, into = Ring.pair(mm, capacity, engine=False)  # type: ignore[arg-type]
        broken = loop.create_future()

        def corrupt(e: RingCorrupt) -> None:  # (either way: the ring is dropped)
            if not broken.done():
                broken.set_result(str(e))

        def write(body: bytes) -> bool | None:
            if len(body) > out.max_frame:  # (never fits: dropped, or it would hold up all after it)
                return oversize(ident, len(body), out.max_frame)
            try:
                if not out.write(body):
                    return False
            except RingCorrupt as e:  # (the engine scribbled on its head)
                corrupt(e)
                return False
            ring_or_drop(doorbell, corrupt)
            return True

        def deliver(body: bytes, now: int) -> None:
            pending = self.server.deliver(ident, body, sender, now)
            if pending is not None:
                asyncio.ensure_future(pending)

        turns = TakingTurns(loop, into, wake, deliver, corrupt, self._turns)
        self.server.rings[ident] = write
        self.observer.g_rings.set(len(self.server.rings))
        loop.add_reader(wake, turns.rang)
        log.info("engine ring %s open (pid %d, %d KiB each way)", ident.decode(), sender.pid, capacity >> 10)
        try:
            turns.rang()  # (anything written before the reader was added)
            closed = asyncio.ensure_future(self._until_closed(conn))
            done, _ = await asyncio.wait({closed, broken}, return_when=asyncio.FIRST_COMPLETED)
            if broken in done:
                log.warning("engine ring %s dropped: %s", ident.decode(), broken.result())
                self.observer.m_rings_dropped.labels("corrupt").inc()
            elif closed.exception() is not None:
                log.warning("engine ring %s dropped: %r", ident.decode(), closed.exception())
            else:
                log.info("engine ring %s closed: %s", ident.decode(), closed.result())
            closed.cancel()
        finally:
            loop.remove_reader(wake)
            try:
                turns.close()
            except Exception:  # (the ring's memory and fds are let go whatever its last messages did)
                log.exception("%s: its last messages were not all handled", ident.decode())
            self.server.rings.pop(ident, None)
            self.observer.g_rings.set(len(self.server.rings))
            for f in (wake, doorbell):
                os.close(f)
            conn.close()
            out.release()
            into.release()
            with contextlib.suppress(BufferError):
                mm.close()  # type: ignore[attr-defined]

    @staticmethod
    async def _until_closed(conn: socket.socket) -> str:
        loop = asyncio.get_running_loop()
        while True:
            try:
                if not await loop.sock_recv(conn, 64):
                    return "the engine closed it"
            except OSError as e:
                return f"the engine's connection: {e}"
