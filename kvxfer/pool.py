"""The memory channel: the sidecar owns the KV memory and hands it to the engine by fd.

A unix ``SOCK_SEQPACKET`` socket beside the engine socket (``<engine socket>.mem``, same
directory rules, 0600) carries one msgpack message per packet and file descriptors with
``SCM_RIGHTS`` (ZMQ cannot pass fds). An engine worker keeps one connection open for as
long as it uses its pools:

- ``PoolCreate(size)``: the sidecar creates a memfd of that size (sealed: it can neither
  grow nor shrink, so a mapping of it never faults with SIGBUS), and answers
  ``PoolGranted(pool, size)`` with the fd. The engine maps it and builds its KV cache in it;
  its registration names the pool (``PoolMemory``), not a path. Nothing appears in
  ``/dev/shm``: the memory is freed by the kernel when the last fd and mapping are gone.
- ``PoolAdopt(pool, size)`` with the fd: a restarted sidecar gets the engine's pools back
  (same ids, so the engine's registration is valid as it was).
- ``PoolFree(pool)``: the engine is done with it (the sidecar's own mapping, if a rank is
  registered in it, lives until that rank is unregistered).

When the connection closes (the engine exited or was killed), the sidecar closes the fds
of its pools; a registration's own mapping keeps the memory while leases still hold blocks
in it, and unregistering it gives the memory back.

``device`` (every message; -1: host memory) asks for a GPU pool instead: a CUDA VMM
allocation exported as a POSIX fd (``kvxfer.vmm``; not yet run on a GPU), granted rounded
up to the allocation granularity. The fd plays the memfd's part everywhere above.

The sidecar side (``PoolServer``) runs on its own thread with blocking sockets; the table
it keeps is read by the NIXL thread under a lock (``dup``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import msgspec
from msgspec import Meta

from kvxfer.errors import ErrorCode, KvxferError, RequestError
from kvxfer.vmm import align_up

if TYPE_CHECKING:
    from kvxfer.vmm import Vmm, VmmMapping

log = logging.getLogger(__name__)

PoolId = Annotated[str, Meta(min_length=1, max_length=64)]
MAX_POOL_BYTES = 1 << 44  # 16 TiB: a sanity bound, not a policy
_PACKET = 4096
_SEALS = 0x0001 | 0x0002 | 0x0004  # F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW
_F_ADD_SEALS, _F_GET_SEALS = 1033, 1034


class _PoolMsg(msgspec.Struct, tag_field="t", forbid_unknown_fields=False, array_like=True):
    pass


Device = Annotated[int, Meta(ge=-1, le=1023)]  # -1: host memory; else a CUDA device ordinal


class PoolCreate(_PoolMsg, tag="create"):
    size: Annotated[int, Meta(gt=0, le=MAX_POOL_BYTES)]
    label: Annotated[str, Meta(max_length=256)] = ""  # shown in logs (which rank, which cache)
    device: Device = -1
    device_uuid: Annotated[str, Meta(max_length=64)] = ""  # the GPU's, as the engine sees it


class PoolAdopt(_PoolMsg, tag="adopt"):
    pool: PoolId
    size: Annotated[int, Meta(gt=0, le=MAX_POOL_BYTES)]
    label: Annotated[str, Meta(max_length=256)] = ""
    device: Device = -1
    device_uuid: Annotated[str, Meta(max_length=64)] = ""


class PoolFree(_PoolMsg, tag="free"):
    pool: PoolId


class PoolGranted(_PoolMsg, tag="granted"):
    pool: PoolId
    size: int
    device: int = -1


class PoolRefused(_PoolMsg, tag="refused"):
    code: str
    message: str


_requests = msgspec.msgpack.Decoder(PoolCreate | PoolAdopt | PoolFree)
_replies = msgspec.msgpack.Decoder(PoolGranted | PoolRefused)
_enc = msgspec.msgpack.Encoder()


def mem_socket_path(engine_socket: str) -> str:
    """The memory channel of the sidecar behind ``engine_socket`` (an ``ipc://`` path)."""
    if not engine_socket.startswith("ipc://"):
        raise ValueError(f"the memory channel needs an ipc:// engine socket, not {engine_socket!r}")
    return engine_socket[len("ipc://"):] + ".mem"


def memfd(size: int, name: str = "kvxfer-kv") -> int:
    """A sealed memfd of ``size`` bytes (close-on-exec)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        import fcntl

        fcntl.fcntl(fd, _F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_memfd(fd: int, size: int) -> None:
    """Refuse an fd that is not a sealed memfd of at least ``size`` bytes (RequestError)."""
    import fcntl

    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RequestError(ErrorCode.INVALID_MEMORY, "the fd is not a regular (memfd) file")
    target = os.readlink(f"/proc/self/fd/{fd}")
    if not target.startswith("/memfd:"):
        raise RequestError(ErrorCode.INVALID_MEMORY, f"the fd is {target!r}, not a memfd")
    seals = fcntl.fcntl(fd, _F_GET_SEALS)
    if seals & 0x0002 == 0:  # F_SEAL_SHRINK: else the owner could shrink it under our mapping
        raise RequestError(ErrorCode.INVALID_MEMORY, "the memfd is not sealed against shrinking")
    if st.st_size < size:
        raise RequestError(ErrorCode.INVALID_MEMORY, f"the memfd is {st.st_size} bytes, not {size}")


def map_fd(fd: int, size: int, populate: bool = True) -> mmap.mmap:
    """A read-write shared mapping of ``size`` bytes of ``fd``."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)


# ----------------------------------------------------------------------------- engine side


@dataclass
class Pool:
    """One pool as the engine holds it: the fd (kept: a restarted sidecar gets it back) and
    the engine's own mapping."""

    id: str
    size: int
    fd: int
    label: str = ""
    device: int = -1  # a CUDA device: a VMM allocation, mapped with map_gpu()
    device_uuid: str = ""
    mm: mmap.mmap | None = field(default=None, repr=False)
    gpu: VmmMapping | None = field(default=None, repr=False)

    def map(self) -> mmap.mmap:
        if self.device >= 0:
            raise ValueError(f"pool {self.id[:8]} is GPU memory: map_gpu()")
        if self.mm is None:
            self.mm = map_fd(self.fd, self.size, populate=False)
        return self.mm

    def map_gpu(self) -> VmmMapping:
        """The GPU pool mapped in this process (``.tensor()`` is a CUDA uint8 tensor over it)."""
        if self.device < 0:
            raise ValueError(f"pool {self.id[:8]} is host memory: map()")
        if self.gpu is None:
            from kvxfer import vmm

            self.gpu = vmm.shared().import_fd(self.fd, self.size, self.device)
        return self.gpu


class PoolClient:
    """An engine worker's connection to its sidecar's memory channel. The connection stays
    open while the engine uses its pools (its end tells the sidecar the engine is gone)."""

    def __init__(self, path: str, timeout_s: float = 30.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.pools: dict[str, Pool] = {}
        self._fd = -1  # the connection, as a bare fd: no socket object to warn when collected
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_engine_socket(cls, engine_socket: str, timeout_s: float = 30.0) -> PoolClient | None:
        """The client for the sidecar behind ``engine_socket``; None for a non-ipc socket."""
        if not engine_socket.startswith("ipc://"):
            return None
        return cls(mem_socket_path(engine_socket), timeout_s)

    @contextlib.contextmanager
    def _socket(self) -> Iterator[socket.socket]:
        if self._fd < 0:
            self._fd = self._connect()
            self._finalizer = weakref.finalize(self, _close_fd, self._fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=self._fd)
        try:
            sock.settimeout(self.timeout_s)
            yield sock
        finally:
            sock.detach()

    def _connect(self) -> int:
        end = time.monotonic() + self.timeout_s
        while True:  # the sidecar may still be starting
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                s.connect(self.path)
                return s.detach()
            except (FileNotFoundError, ConnectionRefusedError) as e:
                s.close()
                if time.monotonic() > end:
                    raise KvxferError(f"cannot reach the sidecar's memory channel {self.path}: {e}") from e
                time.sleep(0.05)
            except OSError as e:
                s.close()
                raise KvxferError(f"cannot reach the sidecar's memory channel {self.path}: {e}") from e

    def _call(self, msg: _PoolMsg, fd: int | None = None) -> tuple[PoolGranted, int | None]:
        try:
            with self._socket() as sock:
                if fd is None:
                    sock.send(_enc.encode(msg))
                else:
                    socket.send_fds(sock, [_enc.encode(msg)], [fd])
                data, fds, _, _ = socket.recv_fds(sock, _PACKET, 1)
        except OSError as e:
            self._disconnect()
            raise KvxferError(f"memory channel {self.path}: {e}") from e
        if not data:
            self._disconnect()
            raise KvxferError(f"memory channel {self.path} closed")
        reply = _replies.decode(data)
        if isinstance(reply, PoolRefused):
            for extra in fds:
                os.close(extra)
            raise KvxferError(f"[{reply.code}] {reply.message}")
        return reply, (fds[0] if fds else None)

    def create(self, size: int, label: str = "", device: int = -1, device_uuid: str = "") -> Pool:
        """A new pool of at least ``size`` bytes from the sidecar (mapped on first ``map()``,
        or ``map_gpu()`` for a pool on CUDA ``device``, whose UUID tells the sidecar which GPU
        that is where its CUDA_VISIBLE_DEVICES differs)."""
        with self._lock:
            granted, fd = self._call(PoolCreate(size=size, label=label, device=device,
                                                device_uuid=device_uuid))
            if fd is None:
                raise KvxferError("the sidecar granted a pool without its fd")
            if granted.device != device or granted.size < size:
                os.close(fd)
                raise KvxferError(f"the sidecar granted {granted.size} bytes on device {granted.device}, "
                                  f"asked {size} on {device}")
            pool = Pool(granted.pool, granted.size, fd, label, device, device_uuid)
            self.pools[pool.id] = pool
            return pool

    def readopt(self) -> int:
        """Hand every pool back to a (restarted) sidecar on a fresh connection; returns how
        many. Their ids stay the same, so registrations naming them are valid again."""
        with self._lock:
            self._disconnect()
            for pool in self.pools.values():
                self._call(PoolAdopt(pool=pool.id, size=pool.size, label=pool.label, device=pool.device,
                                     device_uuid=pool.device_uuid), pool.fd)
            return len(self.pools)

    def free(self, pool: Pool) -> None:
        with self._lock:
            self.pools.pop(pool.id, None)
            if self._fd >= 0:
                try:
                    with self._socket() as sock:
                        sock.send(_enc.encode(PoolFree(pool=pool.id)))
                except OSError:  # the sidecar is gone: nothing to tell
                    self._disconnect()
            _close_pool(pool)

    def close(self) -> None:
        with self._lock:
            for pool in self.pools.values():
                _close_pool(pool)
            self.pools.clear()
            self._disconnect()

    def _disconnect(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # closes the fd, once
            self._finalizer = None
        self._fd = -1


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _close_pool(pool: Pool) -> None:
    pool.gpu = None  # unmapped when the last tensor over it is gone (VmmMapping.__del__)
    if pool.mm is not None:
        with contextlib.suppress(BufferError):  # a view is still alive: freed with it
            pool.mm.close()
        pool.mm = None
    with contextlib.suppress(OSError):
        os.close(pool.fd)


# ----------------------------------------------------------------------------- sidecar side


@dataclass
class _Held:
    id: str
    fd: int
    size: int
    conn: int  # the connection's fileno: its pools close with it
    pid: int
    label: str
    device: int = -1


class PoolServer:
    """The sidecar end of the memory channel (its own thread)."""

    def __init__(self, path: str, max_bytes: int = 0, vmm: Vmm | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes  # 0: no limit but the machine's memory
        self._pools: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: dict[int, tuple[socket.socket, int, int]] = {}  # fileno -> (sock, pid, uid)
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self.vmm: Vmm | None = vmm  # GPU pools (kvxfer.vmm.shared() on first use)
        self.created = 0
        self.adopted = 0
        # called (on this server's thread) with the pool ids of a connection that closed, and
        # its pid: the engine exited or was killed. The only death notice that works when
        # the engine runs in another PID namespace (a Kubernetes pod's other container).
        self.on_closed: Callable[[list[str], int], None] | None = None
        self._shut = False
        self._ino = 0

    # --------------------------------------------------------------- queries (any thread)

    def dup(self, pool: str) -> tuple[int, int, int]:
        """(a duplicate of the pool's fd, its size, its device: -1 for host memory);
        RequestError when unknown. The caller closes the duplicate (its mapping keeps the
        memory)."""
        with self._lock:
            held = self._pools.get(pool)
            if held is None:
                raise RequestError(ErrorCode.INVALID_MEMORY, f"no pool {pool!r} here (its engine must "
                                   "create or hand it back over the memory channel first)")
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            s.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        s.listen(64)
        self._listener = s
        self._ino = os.stat(self.path).st_ino
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
        while True:
            fds = [self._wake_r, self._listener.fileno(), *self._conns]
            try:
                ready, _, _ = select.select(fds, [], [])
            except (OSError, ValueError):
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
        conn.setblocking(True)
        conn.settimeout(5.0)
        self._conns[conn.fileno()] = (conn, pid, uid)

    def _serve(self, fileno: int) -> None:
        conn, pid, _ = self._conns[fileno]
        try:
            data, fds, _, _ = socket.recv_fds(conn, _PACKET, 4)
        except OSError:
            data, fds = b"", []
        if not data:
            self._closed(fileno)
            return
        try:
            msg = _requests.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            for fd in fds:
                os.close(fd)
            self._reply(conn, PoolRefused(code=ErrorCode.MALFORMED, message=f"bad pool request: {e}"))
            return
        try:
            if isinstance(msg, PoolCreate):
                self._grant(conn, fileno, pid, msg)
            elif isinstance(msg, PoolAdopt):
                taken, fds = fds, []  # _adopt owns (keeps or closes) them
                self._adopt(conn, fileno, pid, msg, taken)
            else:
                self._free(fileno, msg.pool)
        except RequestError as e:
            self._reply(conn, PoolRefused(code=e.code, message=e.reason))
        finally:
            for fd in fds:
                os.close(fd)

    def _reply(self, conn: socket.socket, msg: _PoolMsg, fd: int | None = None) -> None:
        try:
            if fd is None:
                conn.send(_enc.encode(msg))
            else:
                socket.send_fds(conn, [_enc.encode(msg)], [fd])
        except OSError as e:
            log.warning("memory channel: reply not sent: %s", e)

    def gpu(self) -> Vmm:
        if self.vmm is None:
            from kvxfer import vmm

            self.vmm = vmm.shared()
        return self.vmm

    def _local_device(self, device: int, uuid: str) -> int:
        """The sidecar's ordinal of the engine's GPU (by UUID when the engine sent one)."""
        if device < 0 or not uuid:
            return device
        return self.gpu().ordinal_of(uuid)

    def _check_room(self, size: int, device: int = -1) -> None:
        if device >= 0:
            size = align_up(size, self.gpu().granularity(device))
        with self._lock:
            held = sum(h.size for h in self._pools.values() if h.device == device)
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

    def _grant(self, conn: socket.socket, fileno: int, pid: int, msg: PoolCreate) -> None:
        device = self._local_device(msg.device, msg.device_uuid)
        self._check_room(msg.size, device)
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
            self._pools[pool] = _Held(pool, fd, size, fileno, pid, msg.label, device)
        self.created += 1
        where = "" if device < 0 else f" on GPU {device}"
        log.info("pool %s: %s%s for pid %d %s", pool[:8], gib(size), where, pid, msg.label)
        self._reply(conn, PoolGranted(pool=pool, size=size, device=msg.device), fd)

    def _adopt(self, conn: socket.socket, fileno: int, pid: int, msg: PoolAdopt, fds: list[int]) -> None:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RequestError(ErrorCode.MALFORMED, f"adopt carries {len(fds)} fds, not 1")
        fd = fds[0]
        device = -1
        try:
            device = self._local_device(msg.device, msg.device_uuid)
            if device >= 0:  # proof it is a VMM allocation of that size on that GPU: it maps
                try:
                    self.gpu().import_fd(fd, msg.size, device).close()
                except RequestError as e:
                    raise RequestError(ErrorCode.INVALID_MEMORY, f"not a GPU pool of {msg.size} bytes "
                                       f"on GPU {device}: {e.reason}") from e
            else:
                check_memfd(fd, msg.size)
        except (RequestError, OSError) as e:
            os.close(fd)
            raise e if isinstance(e, RequestError) else RequestError(ErrorCode.INVALID_MEMORY, str(e)) from e
        with self._lock:
            old = self._pools.pop(msg.pool, None)
            self._pools[msg.pool] = _Held(msg.pool, fd, msg.size, fileno, pid, msg.label, device)
        if old is not None:
            os.close(old.fd)
        self.adopted += 1
        log.info("pool %s: %s handed back by pid %d %s", msg.pool[:8], gib(msg.size), pid, msg.label)
        self._reply(conn, PoolGranted(pool=msg.pool, size=msg.size))

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


def unlink_if_same(path: str, ino: int) -> None:
    """Remove the socket file at ``path`` only if it is still inode ``ino``, the one this
    process bound: never one another process put there since."""
    with contextlib.suppress(FileNotFoundError):
        if ino and os.stat(path).st_ino == ino:
            os.unlink(path)


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None: unknown)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def shmem_bytes() -> int:
    """Shmem from /proc/meminfo (memfd and /dev/shm pages), in bytes."""
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"

