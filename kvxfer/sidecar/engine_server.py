"""The engine socket: a ZMQ ROUTER on ``ipc://`` (file mode 0600, directory 0700) that the
connectors of this sidecar's engines talk to.

Framing, limits, decoding and dispatch, nothing else: one frame per message, at most
``MAX_MESSAGE`` bytes (larger ones get a typed error; ZMQ drops a connection past
``HARD_MAX_MESSAGE``), one typed decoder, and each decoded message handed to the handler
the app registered for its type. No handler may raise out of the loop: malformed input
gets an ``Error`` reply, a handler's ``RequestError`` its code, anything else ``internal``,
and the sidecar keeps serving.

It also owns the socket file, in a private directory (``sockdir``): ``<socket>.lock`` is
flocked for the life of the process (a second sidecar on the same socket is refused, never
silently takes it over), the file is unlinked at close only if it is still the one this
process bound, and ``intact`` tells whether it still is.

And it says who sent each message: ``sender`` is the connection's process as the kernel
reports it (``SO_PEERCRED`` of the fd libzmq received it on), read once per connection and
kept by routing identity while that identity arrives on the same fd (a socket monitor drops
what it knows of a connection that closed, so a new connection on a reused fd number is read
afresh). Identities are the client's choice and ``ROUTER_HANDOVER`` gives one to whoever
connects with it last: what a connection may do is decided on ``sender``, never on its
identity (``kvxfer.sidecar.ownership``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, get_args

import zmq
import zmq.asyncio
from prometheus_client import Counter, Gauge

from kvxfer.errors import ErrorCode, ListenError, RequestError
from kvxfer.observe import Observer, due
from kvxfer.protocol import DECODE_ERRORS, EngineRequest, Error, encode, engine_request_decoder
from kvxfer.sidecar.outbox import Outbox
from kvxfer.sidecar.ownership import UNKNOWN, Creds
from kvxfer.sidecar.pool_server import unlink_if_same
from kvxfer.sidecar.procfs import creds_of_fd, stopped
from kvxfer.sidecar.sockdir import check_private, open_lock

log = logging.getLogger("kvxfer.sidecar")

_ENGINE_TAGS = {t.__struct_config__.tag for t in get_args(EngineRequest)}  # (every kind the union has)
MAX_MESSAGE = 16 << 20  # larger engine messages get a typed error (a million block ids is ~5 MiB)
HARD_MAX_MESSAGE = 64 << 20  # ZMQ drops the connection of a peer that sends more
MAX_SENDERS = 1 << 16  # routing identities whose credentials are kept (forgotten all at once past it)
# Events a connection could not take are tried again after FLUSH_FIRST_S, then ever less often
# while it still takes nothing (up to FLUSH_MAX_S), and at once when its engine sends something.
FLUSH_FIRST_S, FLUSH_MAX_S = 0.001, 0.05
# Events for a connection that is not there while its process is stopped (ZMQ closes one whose
# engine missed heartbeats for 30 s) wait this long for it to come back, then go (counted).
GONE_AFTER_S = 300.0
RESUME_GRACE_S = 5.0  # (after it was last seen stopped: its reconnection)
RING_PREFIX = b"ring-"  # (engine_rings names its connections so; a closed one never comes back)

Handler = Callable[[bytes, Any], Awaitable[None] | None]


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def storm_proof(sock: zmq.Socket[Any]) -> None:
    """Listener options that keep a connection storm from costing memory, descriptors or
    service (#40). libzmq has no cap on a listener's connections and no way to close one
    accepted peer, so each connection's life is bounded instead: one that has not completed
    the ZMTP handshake within 5 s is closed (raw connections that never speak), one whose peer
    stops answering heartbeats within 30 s too (a vanished host); a deep backlog lets engines
    and peers connect at once during a storm (the default of 100 made the kernel drop their
    SYNs: 1-3 s retransmits)."""
    sock.setsockopt(zmq.BACKLOG, 1024)
    sock.setsockopt(zmq.HANDSHAKE_IVL, 5_000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 10_000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)


def classify_bad_message(body: bytes | memoryview) -> ErrorCode:
    """UNKNOWN_MESSAGE for a message whose kind is unknown, else MALFORMED."""
    tag = leading_tag(body)
    return ErrorCode.UNKNOWN_MESSAGE if tag is not None and tag not in _ENGINE_TAGS else ErrorCode.MALFORMED


def leading_tag(body: bytes | memoryview) -> str | None:
    """The first element of a msgpack array, when it is a string (a message's kind), read from
    the header alone: decoding a refused message whole to name its kind cost 1.1 GiB and 3.6 s
    of the loop for 16 MiB of empty arrays (#40)."""
    def length(at: int, small: int, mask: int, wide: dict[int, int]) -> tuple[int, int] | None:
        if at >= len(body):
            return None
        b = body[at]
        if small <= b <= small + mask:
            return b & mask, at + 1
        size = wide.get(b)
        if size is None or at + 1 + size > len(body):
            return None
        return int.from_bytes(body[at + 1:at + 1 + size], "big"), at + 1 + size

    array = length(0, 0x90, 0x0F, {0xDC: 2, 0xDD: 4})
    if array is None or array[0] == 0:
        return None
    string = length(array[1], 0xA0, 0x1F, {0xD9: 1, 0xDA: 2, 0xDB: 4})
    if string is None:
        return None
    n, at = string
    raw = bytes(body[at:at + n])
    try:
        return raw.decode() if len(raw) == n else None
    except UnicodeDecodeError:
        return None


class Kept:
    """The engine socket's outbox on the loop: what waits for which connection (``Outbox``),
    when it is tried again, and what is counted and said about it."""

    def __init__(self, put: Callable[[bytes, bytes], bool | None], observer: Observer) -> None:
        self.box = Outbox()
        self._put = put
        self._behind: dict[bytes, float] = {}  # connection -> since when events wait for it
        self._stopped_seen: dict[bytes, float] = {}  # connection -> when its process was last seen stopped
        self._flush_at: asyncio.TimerHandle | None = None
        self._pause = FLUSH_FIRST_S
        self._warned: dict[str, float] = {}
        self._seen = {"cap": 0, "gone": 0}  # (the outbox's counts the counter has taken)
        r = observer.registry
        self._g_waiting = Gauge("kvxfer_engine_events_waiting", "Events for engine connections that "
                                "were not reading (their queue or ring full), kept to be sent in order "
                                "as soon as they read again.", registry=r)
        self._m_dropped = Counter("kvxfer_engine_events_dropped", "Events for engine connections that "
                                  "were never sent, by why: cap (16 MiB waited for that connection "
                                  "already), gone (its connection went and did not come back).",
                                  ["why"], registry=r)

    def behind(self, ident: bytes) -> bool:
        return ident in self._behind

    def send(self, ident: bytes, frame: bytes, kind: str) -> None:
        if not self.box.send(ident, frame, partial(self._put, ident)):
            return
        if ident not in self._behind:
            self._behind[ident] = time.monotonic()
            self._warn("behind", "engine connection %r is not reading: its events wait for it (%s "
                       "first)", ident, kind)
            self._pause = FLUSH_FIRST_S  # (a connection newly behind is tried again soon)
            self.close()
        self._arm()

    def unreachable(self, ident: bytes, stopped: bool) -> bool | None:
        """For a connection ZMQ does not know now: its events are kept (False) for GONE_AFTER_S
        while its process is stopped, and RESUME_GRACE_S after it was last seen stopped (it
        reconnects with the same identity once it runs again: ~0.1-0.2 s); else they go with
        it (None)."""
        now = time.monotonic()
        if stopped:
            self._stopped_seen[ident] = now
        elif now - self._stopped_seen.get(ident, -RESUME_GRACE_S) >= RESUME_GRACE_S:
            return None
        since = self._behind.get(ident)
        return False if since is None or now - since < GONE_AFTER_S else None

    def flush(self, ident: bytes | None = None) -> None:
        """Send what waits (for ``ident``, or for every connection), and try again later while
        something still cannot go."""
        if ident is None:
            self._flush_at = None
        went = self.box.delivered_late
        for i in [ident] if ident is not None else self.box.idents():
            if self.box.flush(i, partial(self._put, i)) and (since := self._behind.pop(i, None)):
                self._stopped_seen.pop(i, None)
                log.info("engine connection %r caught up: its events waited %.3f s", i,
                         time.monotonic() - since)
        if not self._behind or self.box.delivered_late > went:  # (it reads: keep up with it)
            self._pause = FLUSH_FIRST_S
        elif ident is None:
            self._pause = min(2 * self._pause, FLUSH_MAX_S)
        self._arm()

    def close(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None

    def _arm(self) -> None:
        if self._behind and self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(self._pause, self.flush)
        self._g_waiting.set(self.box.waiting)
        for why, now in (("cap", self.box.dropped), ("gone", self.box.lost)):
            if now > self._seen[why]:
                self._m_dropped.labels(why).inc(now - self._seen[why])
                self._seen[why] = now
                self._warn(why, "events for engines never sent (%s): %d ever", why, now)

    def _warn(self, key: str, fmt: str, *args: object) -> None:
        if due(self._warned, key):  # (at most every WARN_EVERY_S)
            log.warning(fmt, *args)


class EngineServer:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, observer: Observer) -> None:
        self.endpoint = endpoint
        self.path = ipc_path(endpoint)
        self.observer = observer
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker reclaims its id
        # a full queue says so (EAGAIN) and an unknown identity too (EHOSTUNREACH), rather than
        # ZMQ dropping the message unseen: what cannot go yet is kept (``send``)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE)
        storm_proof(self.sock)
        self._handlers: dict[type, Handler] = {}
        self._lock_fd = -1  # <engine socket>.lock, flocked while this process owns the socket
        self._ino = 0  # the inode of the socket file this process bound (0: none)
        self.received_ns = 0  # when the message being handled arrived (a trace's "sidecar" hop)
        self.sender: Creds = UNKNOWN  # who sent the message being handled (the kernel's word)
        self._senders: dict[bytes, tuple[int, Creds]] = {}  # identity -> (its connection's fd, process)
        self._who: dict[bytes, Creds] = {}  # identity -> its last process (kept after a disconnect)
        self._monitor: zmq.asyncio.Socket | None = None
        self.rings: dict[bytes, Callable[[bytes], bool | None]] = {}  # ring identity -> its writer
        self.kept = Kept(self._put, observer)  # events connections could not take yet
        self._closed = False

    def on(self, kind: type, handler: Handler) -> None:
        """Hand every message of this type to ``handler(ident, msg)`` (sync, or awaited)."""
        self._handlers[kind] = handler

    # ---------------------------------------------------------------- the socket file

    def bind(self) -> None:
        """Own the socket file and listen; ListenError says where and why not."""
        if self.path:
            directory = os.path.dirname(self.path) or "."
            if not os.path.isdir(directory):
                os.makedirs(directory, mode=0o700)
            check_private(directory, f"engine socket {self.endpoint}")
            self._own(self.path)
            old = os.umask(0o177)
            try:
                self.sock.bind(self.endpoint)
            except zmq.ZMQError as e:
                raise ListenError(f"engine socket {self.endpoint}: {e}") from None
            finally:
                os.umask(old)
            os.chmod(self.path, 0o600)
            self._ino = os.stat(self.path).st_ino
        else:
            try:
                self.sock.bind(self.endpoint)
            except zmq.ZMQError as e:
                raise ListenError(f"engine socket {self.endpoint}: {e}") from None

    def _own(self, path: str) -> None:
        """Take ``<path>.lock`` (flock, held for the life of the process) or refuse: a second
        sidecar on the same engine socket would take it over silently and delete it when it
        exits, leaving the first one unreachable but still reporting ready."""
        lock = path + ".lock"
        fd = open_lock(lock)  # (no link, a file of ours: never truncates someone else's)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ListenError(f"engine socket {path} belongs to a running sidecar (pid {holder}, "
                              f"holding {lock}): stop it first, or give this one another "
                              "--engine-socket") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def intact(self) -> tuple[bool, str]:
        """Whether the socket file is still the one this process bound (else: "removed" or
        "replaced"); a sidecar that listens on no file is always intact."""
        if not self.path or not self._ino:
            return True, ""
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            return False, "removed"
        return (True, "") if ino == self._ino else (False, "replaced")

    def close(self) -> None:
        self._closed = True
        self.kept.close()
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
        self.sock.close(0)
        if self.path:
            unlink_if_same(self.path, self._ino)  # never a socket this process did not bind
            self._ino = 0
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # (the lock file stays: unlinking it would race a successor)
            self._lock_fd = -1

    # ---------------------------------------------------------------- messages

    def send(self, ident: bytes, msg: Any) -> None:
        """Send an event to an engine connection (its ring, else the ZMQ socket); one it cannot
        take now is kept, in order, and sent as soon as it can (``Kept``)."""
        self.kept.send(ident, encode(msg), type(msg).__name__)

    def _put(self, ident: bytes, frame: bytes) -> bool | None:
        """One frame to one connection: taken (True), no room now (False), gone (None)."""
        ring = self.rings.get(ident)
        if ring is not None:  # (an engine ring: kvxfer.sidecar.engine_rings)
            return ring(frame)
        if self._closed or ident.startswith(RING_PREFIX):  # (a ring that closed: nothing reaches it)
            return None
        # (the asyncio socket's send, whose future is settled at once with NOBLOCK: it checks
        # for messages that came in meanwhile, which a plain send on the socket would leave
        # unnoticed until the next one, see libzmq's ZMQ_FD)
        sent = self.sock.send_multipart([ident, frame], flags=zmq.NOBLOCK)
        err = sent.exception() if sent.done() else None
        if err is None:
            return True
        if isinstance(err, zmq.Again):
            return False
        if isinstance(err, zmq.ZMQError) and err.errno == zmq.EHOSTUNREACH:
            # (disconnected: a stopped process's was closed by ZMQ's heartbeats, and comes back)
            who = self._who.get(ident)
            return self.kept.unreachable(ident, who is not None and stopped(who))
        return None

    def _refuse(self, ident: bytes, code: ErrorCode, why: str) -> None:
        self.observer.bad_message("engine")
        self.send(ident, Error(code=code, message=why))

    def _sender_of(self, ident: bytes, frame: zmq.Frame) -> Creds:
        """The process behind the connection ``frame`` came on: SO_PEERCRED once per connection,
        then a dict lookup (no system call on the hot path)."""
        fd = frame.get(zmq.SRCFD)
        known = self._senders.get(ident)
        if known is not None and known[0] == fd:
            return known[1]
        peer = creds_of_fd(fd)
        if known is not None and known[1] != peer:  # (ROUTER_HANDOVER: the last to claim an identity gets it)
            log.warning("engine connection identity %r moved from %s to %s: replies to it go to the "
                        "new process now", ident, known[1], peer)
        if len(self._senders) >= MAX_SENDERS:
            self._senders.clear()
        if len(self._who) >= MAX_SENDERS:
            self._who.clear()
        self._senders[ident] = (fd, peer)
        self._who[ident] = peer
        return peer

    async def _forget_closed(self) -> None:
        """Drop the credentials of connections that closed: their fd number may come back
        with another process's connection behind it."""
        assert self._monitor is not None
        while True:
            frames = await self._monitor.recv_multipart()
            event, fd = struct.unpack("=Hi", frames[0][:6])  # (event, fd)
            if event & (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_ACCEPTED):
                for ident in [i for i, (f, _) in self._senders.items() if f == fd]:
                    del self._senders[ident]

    async def serve(self) -> None:
        """Take messages until cancelled."""
        if self._monitor is None:
            self._monitor = self.sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_ACCEPTED)
        watch = asyncio.ensure_future(self._forget_closed())
        try:
            await self._serve()
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await watch

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            ident = frames[0].bytes
            sender = self._sender_of(ident, frames[-1])
            if len(frames) != 2:
                self.sender = sender
                self._refuse(ident, ErrorCode.MALFORMED, "expected one frame")
                continue
            pending = self.deliver(ident, frames[-1].buffer, sender, time.monotonic_ns())
            if pending is not None:
                await pending

    def deliver(self, ident: bytes, body: bytes | memoryview, sender: Creds,
                received_ns: int) -> Awaitable[None] | None:
        """Check, decode and dispatch one engine message (from the ZMQ socket or an engine
        ring): what is left to await of an asynchronous handler, if anything."""
        self.received_ns, self.sender = received_ns, sender
        if self.kept.behind(ident):  # (its engine is running: what waits for it may go now)
            self.kept.flush(ident)
        if len(body) > MAX_MESSAGE:
            self._refuse(ident, ErrorCode.MALFORMED,
                         f"message of {len(body)} bytes is too large (max {MAX_MESSAGE})")
            return None
        try:
            msg = engine_request_decoder.decode(body)
        except DECODE_ERRORS as e:
            code = classify_bad_message(body)
            log.warning("bad engine message (%s): %s", code, e)
            self._refuse(ident, code, str(e))
            return None
        return self._dispatch(ident, msg)

    def _dispatch(self, ident: bytes, msg: Any) -> Awaitable[None] | None:
        handler = self._handlers.get(type(msg))
        try:
            if handler is None:
                raise RequestError(ErrorCode.UNKNOWN_MESSAGE, f"{type(msg).__name__} is not handled here")
            result = handler(ident, msg)
        except Exception as e:
            self._failed(ident, msg, e)
            return None
        return None if result is None else self._finish(ident, msg, result)

    async def _finish(self, ident: bytes, msg: Any, result: Awaitable[None]) -> None:
        try:
            await result
        except Exception as e:
            self._failed(ident, msg, e)

    def _failed(self, ident: bytes, msg: Any, e: Exception) -> None:
        if isinstance(e, RequestError):
            self.send(ident, Error(code=e.code, message=e.reason, req_id=e.req_id))
        else:
            log.exception("internal error handling %s", type(msg).__name__, exc_info=e)
            self.send(ident, Error(code=ErrorCode.INTERNAL, message=repr(e)))
