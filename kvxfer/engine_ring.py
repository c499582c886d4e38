"""Engine rings, the engine end (#38; the ring itself: ``kvxfer.ringchannel``).

``EngineRing.open`` asks the sidecar behind an ``ipc://`` engine socket for a ring and maps
it. Sending is a copy into shared memory and one eventfd write; taking what arrived costs
no system call at all when nothing did (the counters are read from the mapping), so the
connector's per-step poll stays as cheap as a ZMQ ``recv(NOBLOCK)``. ``alive`` tells whether
the sidecar still holds the ring's connection (one ``poll`` system call: heartbeats only).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket

from kvxfer.memchannel import map_fd
from kvxfer.ringchannel import (
    DEFAULT_CAPACITY,
    Ring,
    RingCorrupt,
    RingGranted,
    RingOpen,
    RingRefused,
    clear_doorbell,
    ring_bytes,
    ring_doorbell,
    ring_encoder,
    ring_reply_decoder,
    ring_socket_path,
)


class RingUnavailable(Exception):
    """No ring from this sidecar (an older one, a tcp:// engine socket, refused, no answer)."""


class EngineRing:
    def __init__(self, conn: socket.socket, mm: mmap.mmap, capacity: int, ident: str,
                 to_sidecar: int, wake: int) -> None:
        self.conn = conn
        self.mm = mm
        self.ident = ident
        self._doorbell = to_sidecar  # rung after every frame we write
        self.wake = wake  # rung by the sidecar: what pollers wait on
        self._out, self._in = Ring.pair(mm, capacity, engine=True)
        self.max_frame = self._out.max_frame
        self.closed = False
        self._hup = select.poll()  # (the connection: it hangs up when the sidecar lets go)
        self._hup.register(conn, select.POLLIN | select.POLLHUP)

    @classmethod
    def open(cls, endpoint: str, capacity: int = DEFAULT_CAPACITY, timeout_s: float = 2.0) -> EngineRing:
        """Ask for a ring and wait for it; RingUnavailable says why not."""
        asking = Asking(endpoint, capacity)
        ring = asking.answer(timeout_s)
        if ring is None:
            asking.close()
            raise RingUnavailable(f"no ring from {asking.path} within {timeout_s}s")
        return ring

    # ------------------------------------------------------------------ messages

    def write(self, body: bytes) -> bool:
        """Queue one message for the sidecar and wake it; False: the ring is full."""
        if not self._out.write(body):
            return False
        ring_doorbell(self._doorbell)
        return True

    def pending(self) -> bool:
        return self._in.pending()

    def read(self) -> list[bytes]:
        """Every message the sidecar wrote so far (no system call when there is none)."""
        return self._in.read_all() if self._in.pending() else []

    def arm(self) -> bool:
        """Before blocking on ``wake``: consume its old wake-ups; True if a message is
        already waiting (then do not block)."""
        clear_doorbell(self.wake)
        return self._in.pending()

    def alive(self) -> bool:
        """Whether the sidecar still holds the ring (its end of the connection is open)."""
        if self.closed:
            return False
        for _, ev in self._hup.poll(0):
            if ev & (select.POLLHUP | select.POLLERR):
                return False
            if ev & select.POLLIN:
                try:
                    if not self.conn.recv(64):
                        return False
                except BlockingIOError:
                    pass
                except OSError:
                    return False
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in (self._doorbell, self.wake):
            os.close(fd)
        self.conn.close()
        self._out.release()
        self._in.release()
        with contextlib.suppress(BufferError):  # (a view of it is alive: freed with the last one)
            self.mm.close()


class Asking:
    """A ring asked for and not granted yet: ``answer(0)`` never blocks (a heartbeat may ask
    again without ever stalling an engine step on a sidecar that accepts and says nothing)."""

    def __init__(self, endpoint: str, capacity: int = DEFAULT_CAPACITY) -> None:
        try:
            self.path = ring_socket_path(endpoint)
        except ValueError as e:
            raise RingUnavailable(str(e)) from None
        self.capacity = capacity
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.conn.setblocking(False)
            self.conn.connect(self.path)  # (a unix socket connects at once, or fails)
            self.conn.send(ring_encoder.encode(RingOpen(capacity=capacity)))
        except OSError as e:
            self.conn.close()
            raise RingUnavailable(f"{self.path}: {e}") from None

    def answer(self, timeout_s: float = 0.0) -> EngineRing | None:
        """The ring once granted (None: no answer yet); RingUnavailable if refused or broken."""
        waiting = select.poll()  # (not select.select: it fails on fds numbered 1024 and up, which a
        waiting.register(self.conn, select.POLLIN)  # vLLM worker may have; found by a review)
        if not waiting.poll(int(timeout_s * 1000 + 0.999)):  # (ms, rounded up)
            return None
        fds: list[int] = []
        try:
            data, fds = _recv_fds(self.conn, 3)
            reply = ring_reply_decoder.decode(data)
            if isinstance(reply, RingRefused):
                raise RingUnavailable(f"{reply.code}: {reply.message}")
            assert isinstance(reply, RingGranted)
            if len(fds) != 3 or reply.capacity != self.capacity:
                raise RingUnavailable(f"a ring of {reply.capacity} bytes with {len(fds)} fds, not "
                                      f"{self.capacity}")
            mm = map_fd(fds[0], ring_bytes(self.capacity), populate=False)  # (pages as the ring uses them)
            os.close(fds.pop(0))
            return EngineRing(self.conn, mm, self.capacity, reply.ident, fds[0], fds[1])
        except (OSError, ValueError, RingCorrupt, RingUnavailable) as e:
            for fd in fds:
                os.close(fd)
            self.conn.close()
            raise e if isinstance(e, RingUnavailable) else RingUnavailable(f"{self.path}: {e}") from None

    def close(self) -> None:
        self.conn.close()


def _recv_fds(conn: socket.socket, most: int) -> tuple[bytes, list[int]]:
    data, ancdata, _flags, _addr = conn.recvmsg(4096, socket.CMSG_SPACE(most * 4))
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % 4
            fds.extend(int.from_bytes(payload[i:i + 4], "little", signed=True) for i in range(0, whole, 4))
    if not data:
        for fd in fds:
            os.close(fd)
        raise RingUnavailable("the sidecar closed the ring connection")
    return data, fds


__all__ = ["EngineRing", "RingUnavailable"]
