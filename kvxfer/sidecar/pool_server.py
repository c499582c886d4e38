"""The sidecar end of the memory channel (``kvxfer.memchannel``): ``PoolServer`` creates
the engine's pools (memfds, or CUDA VMM allocations), takes them back from an engine after a
restart, and closes them when the engine's connection ends.

It runs on its own thread with blocking sockets; the table it keeps is read by the NIXL
thread under a lock (``dup``). An I/O shell of the sidecar: the engine side never imports it.

A pool belongs to the connection that created or handed it back, and to that connection's
process (``SO_PEERCRED``): only that process may register memory of it (``dup`` checks), and
no other connection can hand back (``PoolAdopt``) an id that is still held: knowing a pool's
id is not owning it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import select
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.memchannel import (
    _PACKET,
    PoolAdopt,
    PoolCreate,
    PoolGranted,
    PoolRefused,
    PoolSelf,
    PoolWho,
    _enc,
    _PoolMsg,
    _requests,
    available_memory,
    check_memfd,
    gib,
    memfd,
)
from kvxfer.protocol import DECODE_ERRORS
from kvxfer.sidecar.ownership import Creds, pool_refusal
from kvxfer.sidecar.sockdir import check_private
from kvxfer.vmm import align_up

if TYPE_CHECKING:
    from kvxfer.vmm import Vmm

log = logging.getLogger("kvxfer.pool")  # the name its log lines carried before the split
# Connections held at once. An engine process holds one (each worker rank: a node's few dozen
# at most); past this, a new connection takes the place of the oldest one that holds no pool
# (a storm, or an engine that connected and never asked), or is closed if every one does.
MAX_CONNECTIONS = 256
MAX_POOLS_PER_CONNECTION = 4096  # (an engine makes a few per cache; each is an fd here)


@dataclass
class _Held:
    id: str
    fd: int
    size: int
    conn: int  # the connection's fileno: its pools close with it
    pid: int
    label: str
    device: int = -1
    uid: int = -1  # (with pid: the creating process, the only one that may register it)


class Room:
    """Where a pool's memory comes from and whether it fits: host memory (what the machine
    has available, ``--max-pool-bytes``) or a GPU (``kvxfer.vmm``, loaded on first use)."""

    def __init__(self, max_bytes: int = 0, vmm: Vmm | None = None) -> None:
        self.max_bytes = max_bytes  # 0: no limit but the machine's memory
        self.vmm: Vmm | None = vmm  # GPU pools (kvxfer.vmm.shared() on first use)

    def gpu(self) -> Vmm:
        if self.vmm is None:
            from kvxfer import vmm

            self.vmm = vmm.shared()
        return self.vmm

    def local_device(self, device: int, uuid: str) -> int:
        """The sidecar's ordinal of the engine's GPU (by UUID when the engine sent one)."""
        if device < 0 or not uuid:
            return device
        return self.gpu().ordinal_of(uuid)

    def check(self, size: int, device: int, held: int) -> None:
        """OUT_OF_MEMORY unless a pool of ``size`` fits beside ``held`` bytes on ``device``."""
        if device >= 0:
            size = align_up(size, self.gpu().granularity(device))
        if self.max_bytes and held + size > self.max_bytes:
            where = "host memory" if device < 0 else f"GPU {device}"
            raise RequestError(ErrorCode.OUT_OF_MEMORY, f"a pool of {size} bytes would exceed this "
                               f"sidecar's --max-pool-bytes ({held} of {self.max_bytes} of {where} in use)")
        if device >= 0:
            free = self.gpu().free_memory(device)
            if size > free:
                raise RequestError(ErrorCode.OUT_OF_MEMORY, f"a pool of {gib(size)} needs more memory than "
                                   f"GPU {device} has free ({gib(free)})")
            return
        avail = available_memory()
        if avail is not None and size > avail:
            raise RequestError(ErrorCode.OUT_OF_MEMORY, f"a pool of {gib(size)} needs more memory than "
                               f"this machine has available ({gib(avail)})")
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if held + size > phys:  # (memfds take no memory until written: each pool alone fit, and one
            # connection held 3,000 of them, 2.9 TiB on a 21 GiB machine: found by a review)
            raise RequestError(ErrorCode.OUT_OF_MEMORY, f"a pool of {gib(size)} beside the {gib(held)} "
                               f"of pools held would exceed this machine's memory ({gib(phys)})")


    def prove(self, fd: int, size: int, device: int) -> None:
        """Raise unless ``fd`` is a pool's memory of ``size`` bytes on ``device``: a sealed
        memfd, or a VMM allocation that maps on that GPU."""
        if device < 0:
            check_memfd(fd, size)
            return
        try:
            self.gpu().import_fd(fd, size, device).close()
        except RequestError as e:
            raise RequestError(ErrorCode.INVALID_MEMORY, f"not a GPU pool of {size} bytes "
                               f"on GPU {device}: {e.reason}") from e


@functools.cache
def self_pidfd() -> int:
    """A pidfd of this process, open for its life (each ``PoolSelf`` reply carries a copy)."""
    try:
        return os.pidfd_open(os.getpid())
    except OSError as e:  # (Linux < 5.3)
        raise RequestError(ErrorCode.UNSUPPORTED, f"no pidfd here: {e}") from None


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class PoolServer:
    """The sidecar end of the memory channel (its own thread)."""

    def __init__(self, path: str, max_bytes: int = 0, vmm: Vmm | None = None) -> None:
        self.path = path
        self.room = Room(max_bytes, vmm)
        self._pools: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: dict[int, tuple[socket.socket, int, int]] = {}  # fileno -> (sock, pid, uid)
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self.created = 0
        self.adopted = 0
        # called (on this server's thread) with the pool ids and pid of a connection that closed:
        # the engine died. The only death notice across PID namespaces (a pod's other container).
        self.on_closed: Callable[[list[str], int], None] | None = None
        self._shut = False
        self._ino = 0
        self.max_connections = MAX_CONNECTIONS
        # (this thread) for each connection closed because max_connections were held: counted
        self.on_refused: Callable[[int], None] | None = None
        self._catching_up = False  # (``_adopt``: serving another connection's backlog now)

    # --------------------------------------------------------------- queries (any thread)

    def dup(self, pool: str, user: Creds | None = None) -> tuple[int, int, int]:
        """(a duplicate of the pool's fd for the caller to close, its size, its device: -1 for
        host); RequestError when unknown or ``user`` (None: the caller vouches) did not make it."""
        with self._lock:
            held = self._pools.get(pool)
            if held is None:
                raise RequestError(ErrorCode.INVALID_MEMORY, f"no pool {pool!r} here (its engine must "
                                   "create or hand it back over the memory channel first)")
            why = "" if user is None else pool_refusal(pool, Creds(held.pid, held.uid), user)
            if why:
                raise RequestError(ErrorCode.INVALID_MEMORY, why)
            return os.dup(held.fd), held.size, held.device

    def holds(self, pool: str) -> bool:
        """Is ``pool`` held (its engine's channel open, or handed back on a new one)?"""
        with self._lock:
            return pool in self._pools

    def stats(self) -> tuple[int, int]:
        """(pools, bytes) held."""
        with self._lock:
            return len(self._pools), sum(h.size for h in self._pools.values())

    # --------------------------------------------------------------- lifecycle

    def start(self) -> None:
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, mode=0o700, exist_ok=True)
        check_private(directory, f"memory channel {self.path}")  # (else another user could swap it)
        self._listener, self._ino = listen_private(self.path)
        self._thread = threading.Thread(target=self._run, name="kvxfer-pools", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._shut:
            return
        self._shut = True
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            for held in self._pools.values():
                with contextlib.suppress(OSError):
                    os.close(held.fd)
            self._pools.clear()
        for sock, _, _ in self._conns.values():
            sock.close()
        self._conns.clear()
        if self._listener is not None:
            self._listener.close()
            unlink_if_same(self.path, self._ino)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # --------------------------------------------------------------- the thread

    def _run(self) -> None:
        assert self._listener is not None
        listener = self._listener.fileno()
        while True:
            # poll, not select: select fails for good once a descriptor's number reaches 1024
            # (a connection storm on any socket of the sidecar), and the channel with it
            poller = select.poll()
            for fd in (self._wake_r, listener, *self._conns):
                poller.register(fd, select.POLLIN)
            try:
                ready = [fd for fd, _events in poller.poll()]
            except OSError:
                log.exception("memory channel: poll failed; the channel stops")
                return
            for fd in ready:
                if fd == self._wake_r:
                    return
                try:
                    if fd == self._listener.fileno():
                        self._accept()
                    else:
                        self._serve(fd)
                except Exception:  # never let one request end the channel
                    log.exception("memory channel request failed")

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
        if uid not in (os.geteuid(), 0):
            log.warning("memory channel: refused a connection from uid %d (pid %d)", uid, pid)
            conn.close()
            return
        if len(self._conns) >= self.max_connections and not self._make_room():
            conn.close()
            self._refused()
            return
        conn.setblocking(True)
        conn.settimeout(5.0)
        self._conns[conn.fileno()] = (conn, pid, uid)

    def _make_room(self) -> bool:
        """Close the oldest connection that holds no pool, so that the channel keeps serving
        engines through a storm of idle connections; False when every connection holds one."""
        with self._lock:
            holding = {h.conn for h in self._pools.values()}
        oldest = next((fd for fd in self._conns if fd not in holding), None)  # (dicts keep order)
        if oldest is None:
            return False
        conn, _, _ = self._conns.pop(oldest)
        conn.close()
        self._refused()
        return True

    def _refused(self) -> None:
        if self.on_refused is not None:
            try:
                self.on_refused(self.max_connections)
            except Exception:  # never let the notice end the channel
                log.exception("memory channel: on_refused failed")

    def _serve(self, fileno: int) -> None:
        conn, pid, uid = self._conns[fileno]
        try:
            data, fds, _, _ = socket.recv_fds(conn, _PACKET, 4)
        except OSError:
            data, fds = b"", []
        if not data:
            self._closed(fileno)
            return
        try:
            msg = _requests.decode(data)
        except DECODE_ERRORS as e:
            for fd in fds:
                os.close(fd)
            self._reply(conn, PoolRefused(code=ErrorCode.MALFORMED, message=f"bad pool request: {e}"))
            return
        try:
            if isinstance(msg, PoolCreate):
                self._grant(conn, fileno, Creds(pid, uid), msg)
            elif isinstance(msg, PoolAdopt):
                taken, fds = fds, []  # _adopt owns (keeps or closes) them
                self._adopt(conn, fileno, Creds(pid, uid), msg, taken)
            elif isinstance(msg, PoolWho):
                self._reply(conn, PoolSelf(pid=os.getpid()), self_pidfd())
            else:
                self._free(fileno, msg.pool)
        except RequestError as e:
            self._reply(conn, PoolRefused(code=e.code, message=e.reason))
        finally:
            for fd in fds:
                os.close(fd)

    def _reply(self, conn: socket.socket, msg: _PoolMsg, fd: int | None = None) -> None:
        """Never waits: a connection not reading its replies loses them (found by a review)."""
        timeout = conn.gettimeout()
        conn.settimeout(0.0)  # (MSG_DONTWAIT alone is not enough: a socket with a timeout waits for it)
        try:
            if fd is None:
                conn.send(_enc.encode(msg))
            else:
                socket.send_fds(conn, [_enc.encode(msg)], [fd])
        except OSError as e:
            log.warning("memory channel: reply not sent: %s", e)
        finally:
            conn.settimeout(timeout)

    def gpu(self) -> Vmm:
        return self.room.gpu()

    def _grant(self, conn: socket.socket, fileno: int, peer: Creds, msg: PoolCreate) -> None:
        device = self.room.local_device(msg.device, msg.device_uuid)
        with self._lock:
            held = sum(h.size for h in self._pools.values() if h.device == device)
            mine = sum(1 for h in self._pools.values() if h.conn == fileno)
        if mine >= MAX_POOLS_PER_CONNECTION:
            raise RequestError(ErrorCode.OUT_OF_MEMORY, f"this connection holds {mine} pools already")
        self.room.check(msg.size, device, held)
        size = msg.size
        if device >= 0:
            fd, size = self.gpu().create_exported(msg.size, device)  # RequestError if it cannot
        else:
            try:
                fd = memfd(msg.size)
            except OSError as e:
                raise RequestError(ErrorCode.OUT_OF_MEMORY, f"memfd of {msg.size} bytes: {e}") from e
        pool = secrets.token_hex(16)
        with self._lock:
            self._pools[pool] = _Held(pool, fd, size, fileno, peer.pid, msg.label, device, peer.uid)
        self.created += 1
        where = "" if device < 0 else f" on GPU {device}"
        log.info("pool %s: %s%s for pid %d %s", pool[:8], gib(size), where, peer.pid, msg.label)
        self._reply(conn, PoolGranted(pool=pool, size=size, device=msg.device), fd)

    def _adopt(self, conn: socket.socket, fileno: int, peer: Creds, msg: PoolAdopt, fds: list[int]) -> None:
        """Take a pool back from the engine that held it over a restart of this sidecar. An id
        still held here is refused unless this very connection holds it: another connection
        presenting it would put its memory where the holder's registrations and its peers'
        reads expect the holder's."""
        with self._lock:
            held = self._pools.get(msg.pool)
        if held is not None and held.conn != fileno and not self._catching_up:
            self._catching_up = True  # (once: two connections adopting each other's pools recursed
            try:  # until RecursionError, leaking the fds they sent: found by a review)
                self._catch_up(held.conn)  # (an engine handing its pools back on a fresh connection)
            finally:
                self._catching_up = False
            with self._lock:
                held = self._pools.get(msg.pool)
        if held is not None and held.conn != fileno:
            _close_all(fds)
            log.warning("memory channel: pid %d (uid %d) tried to hand back pool %s, which pid %d holds; "
                        "refused", peer.pid, peer.uid, msg.pool[:8], held.pid)
            raise RequestError(ErrorCode.UNAUTHORIZED, f"pool {msg.pool[:8]} is held by another "
                               "connection: only its holder hands it back")
        if len(fds) != 1:
            _close_all(fds)
            raise RequestError(ErrorCode.MALFORMED, f"adopt carries {len(fds)} fds, not 1")
        fd = fds[0]
        try:
            device = self.room.local_device(msg.device, msg.device_uuid)
            self.room.prove(fd, msg.size, device)
        except (RequestError, OSError) as e:
            os.close(fd)
            raise e if isinstance(e, RequestError) else RequestError(ErrorCode.INVALID_MEMORY, str(e)) from e
        with self._lock:  # (only this thread adds pools: the holder checked above is still it)
            old = self._pools.get(msg.pool)
            self._pools[msg.pool] = _Held(msg.pool, fd, msg.size, fileno, peer.pid, msg.label, device,
                                          peer.uid)
        if old is not None:
            os.close(old.fd)
        self.adopted += 1
        log.info("pool %s: %s handed back by pid %d %s", msg.pool[:8], gib(msg.size), peer.pid, msg.label)
        self._reply(conn, PoolGranted(pool=msg.pool, size=msg.size))

    def _catch_up(self, fileno: int) -> None:
        """Serve what connection ``fileno`` already sent, its end included: an engine that
        hands its pools back on a fresh connection closed the old one first, but this thread
        may see the new one's request before the old one's end."""
        while fileno in self._conns:
            poller = select.poll()
            poller.register(fileno, select.POLLIN)
            if not poller.poll(0):
                return
            self._serve(fileno)

    def _free(self, fileno: int, pool: str) -> None:
        with self._lock:
            held = self._pools.get(pool)
            if held is None or held.conn != fileno:
                return
            del self._pools[pool]
        os.close(held.fd)

    def _closed(self, fileno: int) -> None:
        """The engine's connection ended (it exited, or was killed): close its pools' fds.
        Registered ranks keep their own mappings until they are unregistered."""
        conn, pid, _ = self._conns.pop(fileno)
        conn.close()
        with self._lock:
            gone = [h for h in self._pools.values() if h.conn == fileno]
            for h in gone:
                del self._pools[h.id]
        for h in gone:
            os.close(h.fd)
        if gone:
            log.info("memory channel of pid %d closed: %d pools (%s) let go", pid, len(gone),
                     gib(sum(h.size for h in gone)))
            if self.on_closed is not None:
                try:
                    self.on_closed([h.id for h in gone], pid)
                except Exception:  # never let the notice end the channel
                    log.exception("memory channel: on_closed failed")


def listen_private(path: str) -> tuple[socket.socket, int]:
    """A unix ``SOCK_SEQPACKET`` listener at ``path`` (mode 0600 from the start; a file left
    there by a predecessor replaced: the caller owns the directory and the socket's lock), and
    the inode it bound (for ``unlink_if_same``)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(64)
    return s, os.stat(path).st_ino


def unlink_if_same(path: str, ino: int) -> None:
    """Remove the socket file at ``path`` only if it is still inode ``ino``, the one this
    process bound: never one another process put there since."""
    with contextlib.suppress(FileNotFoundError):
        if ino and os.stat(path).st_ino == ino:
            os.unlink(path)
