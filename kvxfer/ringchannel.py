"""The engine ring: the engine channel with one wake-up per message (#38).

ZMQ over ``ipc://`` costs ~150-250 µs a crossing on this machine (an I/O thread on each
side hands every message to the caller's thread), where an eventfd wake-up between two
processes costs ~6-11 µs. An engine connection may therefore ask its sidecar for a *ring*:
a sealed memfd the sidecar creates, holding two single-producer single-consumer byte rings
(engine -> sidecar and back), and two eventfds, one doorbell per direction. A message is
the same msgspec bytes as on the ZMQ socket, written as one frame; the writer rings the
reader's doorbell after every frame, the reader drains every frame written before the
doorbell it consumed. Nothing blocks a writer: a full ring refuses the frame (the engine's
send fails ``SidecarUnavailable``, as a full ZMQ queue does; the sidecar drops and logs, as
its ROUTER does).

The ring is asked for on ``<engine socket>.ring``, a unix ``SOCK_SEQPACKET`` socket beside
the engine socket (same private directory, 0600): ``RingOpen(capacity)`` is answered
``RingGranted`` with the memfd and both eventfds (``SCM_RIGHTS``), or ``RingRefused``. The
connection stays open for the ring's life: when it closes, either end knows the other is
gone (the sidecar drops the ring; the engine falls back to ZMQ). Who sent a ring's
messages is that connection's process as the kernel reports it (``SO_PEERCRED``), as for
the ZMQ socket.

Layout: page 0 holds a magic word and each ring's ``tail`` (written by its producer only)
and ``head`` (written by its consumer only), each on its own cache line, as u64 byte
counters that only grow, in the machine's byte order (both ends share the machine); each
ring's data follows (``capacity`` bytes, a multiple of 8). A frame is a u64 length and the
payload, padded to 8 bytes; a frame that does not fit before the end of the data is
preceded by a ``WRAP`` word and written at its start.
The reader copies each payload out before decoding it and checks every length and counter
against the capacity: an engine that scribbles over its ring breaks its own ring only
(``RingCorrupt``; the sidecar then drops it). Ordering relies on x86-64's store order (the
payload is stored before the tail that publishes it) and on the eventfd system calls
between a doorbell and the drain it causes.

The counters are read and written whole, through a ``memoryview`` cast to ``Q``: one
aligned 8-byte load or store each, which x86-64 (and ARM64) never tear. ``struct.pack_into``
is not that: it zeroes the field and then stores it a byte at a time, so the other end could
read a tail of 0 or a part of one. It did, once in a few thousand bursts under load: the
sidecar took the ring for corrupt and dropped it with the messages in it (found by CI's
``kvxfer bench --quick`` and soak smoke, requests that never got an answer).

This module is what both ends need (messages, layout, the ring itself); it keeps no
sockets and imports neither end.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from typing import Annotated

import msgspec
from msgspec import Meta

MAGIC = int.from_bytes(b"KVXRING1", "little")  # (a mapping of something else is refused)
HEADER = 4096
WRAP = (1 << 64) - 1
DEFAULT_CAPACITY = 4 << 20  # per direction: ~400 Recvs of 1,000 blocks in flight
MIN_CAPACITY, MAX_CAPACITY = 64 << 10, 64 << 20
_Q = struct.Struct("<Q")
# (tail, head) offsets of each direction's counters: engine -> sidecar, sidecar -> engine
_TO_SIDECAR, _TO_ENGINE = (64, 128), (192, 256)


class RingCorrupt(Exception):
    """A counter or a frame length that cannot be right: the ring is unusable."""


class _RingMsg(msgspec.Struct, tag_field="t", forbid_unknown_fields=False, array_like=True):
    pass


class RingOpen(_RingMsg, tag="open"):
    capacity: Annotated[int, Meta(ge=MIN_CAPACITY, le=MAX_CAPACITY, multiple_of=8)] = DEFAULT_CAPACITY


class RingGranted(_RingMsg, tag="granted"):
    """With three fds, in order: the memfd, the sidecar's doorbell, the engine's doorbell."""

    ident: str
    capacity: int


class RingRefused(_RingMsg, tag="refused"):
    code: str
    message: str


ring_request_decoder = msgspec.msgpack.Decoder(RingOpen)
ring_reply_decoder = msgspec.msgpack.Decoder(RingGranted | RingRefused)
ring_encoder = msgspec.msgpack.Encoder()


def ring_socket_path(engine_socket: str) -> str:
    """Where the sidecar behind ``engine_socket`` (an ``ipc://`` endpoint) grants rings."""
    if not engine_socket.startswith("ipc://"):
        raise ValueError(f"an engine ring needs an ipc:// engine socket, not {engine_socket!r}")
    return engine_socket[len("ipc://"):] + ".ring"


def ring_bytes(capacity: int) -> int:
    return HEADER + 2 * capacity


def init_ring(mm: mmap.mmap) -> None:
    _Q.pack_into(mm, 0, MAGIC)


def _pad(n: int) -> int:
    return (n + 7) & ~7


class Ring:
    """One direction of a ring over ``mm``: its producer calls ``write``, its consumer
    ``read_all`` (each end holds one ``Ring`` per direction, built by ``pair``)."""

    def __init__(self, mm: mmap.mmap, counters: tuple[int, int], data: int, capacity: int) -> None:
        if _Q.unpack_from(mm, 0)[0] != MAGIC:
            raise RingCorrupt("not a ring (bad magic)")
        self.mm = mm
        self._words = memoryview(mm)[:HEADER].cast("Q")  # (the counters: whole 8-byte loads and stores)
        self.tail_at, self.head_at = counters
        self._tail_i, self._head_i = self.tail_at // 8, self.head_at // 8
        self.data = data
        self.capacity = capacity
        self.max_frame = capacity // 2 - 8  # larger messages go another way (the ZMQ socket)
        self._tail = self._words[self._tail_i]  # (the producer's own copy)
        self._head = self._words[self._head_i]  # (the consumer's own copy)

    @classmethod
    def pair(cls, mm: mmap.mmap, capacity: int, engine: bool) -> tuple[Ring, Ring]:
        """(the ring this end writes, the ring it reads)."""
        to_sidecar = cls(mm, _TO_SIDECAR, HEADER, capacity)
        to_engine = cls(mm, _TO_ENGINE, HEADER + capacity, capacity)
        return (to_sidecar, to_engine) if engine else (to_engine, to_sidecar)

    # ------------------------------------------------------------------ the producer

    def write(self, payload: bytes) -> bool:
        """Append one frame; False when it does not fit now (nothing written)."""
        n = len(payload)
        if n > self.max_frame:
            return False
        need = 8 + _pad(n)
        tail, cap = self._tail, self.capacity
        head = self._words[self._head_i]
        if not 0 <= tail - head <= cap:
            raise RingCorrupt(f"head {head} and tail {tail} are {tail - head} bytes apart (capacity {cap})")
        pos = tail % cap
        skip = cap - pos if cap - pos < need else 0  # (a frame never straddles the end)
        if tail + skip + need - head > cap:
            return False
        if skip:
            _Q.pack_into(self.mm, self.data + pos, WRAP)
            pos = 0
        at = self.data + pos
        _Q.pack_into(self.mm, at, n)
        self.mm[at + 8:at + 8 + n] = payload
        self._tail = tail + skip + need
        self._words[self._tail_i] = self._tail  # (publishes the frame: stored after it)
        return True

    # ------------------------------------------------------------------ the consumer

    def pending(self) -> bool:
        """Whether a frame is waiting (no system call)."""
        return self._words[self._tail_i] != self._head

    def read_all(self) -> list[bytes]:
        """Every frame published so far, copied out; RingCorrupt if the ring cannot be right."""
        tail, head, cap = self._words[self._tail_i], self._head, self.capacity
        if not 0 <= tail - head <= cap:
            raise RingCorrupt(f"tail {tail} is {tail - head} bytes past head {head} (capacity {cap})")
        out = []
        while head < tail:
            pos = head % cap
            n = _Q.unpack_from(self.mm, self.data + pos)[0]
            if n == WRAP:
                head += cap - pos
                continue
            need = 8 + _pad(n)
            if n > self.max_frame or pos + need > cap or head + need > tail:
                raise RingCorrupt(f"a frame of {n} bytes at {pos} does not fit the ring")
            at = self.data + pos + 8
            out.append(self.mm[at:at + n])
            head += need
        self._head = head
        self._words[self._head_i] = head
        return out

    def release(self) -> None:
        """Let go of the view of the counters (the mapping can then be closed)."""
        self._words.release()


def ring_doorbell(fd: int) -> None:
    """Wake the reader behind ``fd`` (an eventfd; never blocks short of 2^64 - 2 rings)."""
    os.eventfd_write(fd, 1)


def clear_doorbell(fd: int) -> None:
    """Consume the wake-ups of ``fd`` (a non-blocking eventfd) before draining."""
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(fd)
