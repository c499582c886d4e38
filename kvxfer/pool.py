"""The engine end of the memory channel (``kvxfer.memchannel``): ``PoolClient`` asks the
sidecar for pools and hands them back to a restarted one; ``Pool`` is one pool as the engine
holds it (the fd and the engine's own mapping).

Imported by the engine side (``kvxfer.memory``, ``kvxfer.connector``, ``kvxfer.testing``):
it never imports the sidecar end (``kvxfer.sidecar.pool_server``) nor anything else of
``kvxfer.sidecar``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from kvxfer.errors import KvxferError
from kvxfer.memchannel import (
    _PACKET,
    PoolAdopt,
    PoolCreate,
    PoolFree,
    PoolGranted,
    PoolRefused,
    PoolSelf,
    PoolWho,
    _enc,
    _PoolMsg,
    _replies,
    map_fd,
    mem_socket_path,
)

if TYPE_CHECKING:
    from kvxfer.vmm import VmmMapping


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
    def _socket(self, timeout_s: float = 0.0) -> Iterator[socket.socket]:
        if self._fd < 0:
            self._fd = self._connect(timeout_s)
            self._finalizer = weakref.finalize(self, _close_fd, self._fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=self._fd)
        try:
            sock.settimeout(timeout_s or self.timeout_s)
            yield sock
        finally:
            sock.detach()

    def _connect(self, timeout_s: float = 0.0) -> int:
        end = time.monotonic() + (timeout_s or self.timeout_s)
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

    def _call(self, msg: _PoolMsg, fd: int | None = None,
              timeout_s: float = 0.0) -> tuple[PoolGranted, int | None]:
        try:
            with self._socket(timeout_s) as sock:
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

    def readopt(self, timeout_s: float = 0.0) -> int:
        """Hand every pool back to a (restarted) sidecar on a fresh connection; returns how
        many. Their ids stay the same, so registrations naming them are valid again.
        ``timeout_s``: each call's bound (0: the client's; an engine step passes a short one)."""
        with self._lock:
            self._disconnect()
            for pool in self.pools.values():
                self._call(PoolAdopt(pool=pool.id, size=pool.size, label=pool.label, device=pool.device,
                                     device_uuid=pool.device_uuid), pool.fd, timeout_s)
            return len(self.pools)

    def sidecar_pidfd(self, timeout_s: float = 0.0) -> int | None:
        """A pidfd of the sidecar process (it polls readable once that process exited; the
        caller owns it); None when the sidecar gives none (an older one, no pidfd there) or
        not within ``timeout_s`` (0: the client's). Asked on a connection of its own, closed
        after: the one that holds the pools must never close for a slow answer (the sidecar
        takes that for the engine's death and drops its ranks, while the worker believes them
        registered: found by a review), and a late reply then answers nobody."""
        try:
            fd = self._connect(timeout_s)
        except KvxferError:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd)
        fds: list[int] = []
        try:
            sock.settimeout(timeout_s or self.timeout_s)
            sock.send(_enc.encode(PoolWho()))
            data, fds, _, _ = socket.recv_fds(sock, _PACKET, 1)
            reply = _replies.decode(data) if data else None
        except (OSError, msgspec.DecodeError, ValueError):
            reply = None
        finally:
            sock.close()
        if isinstance(reply, PoolSelf) and fds:
            for extra in fds[1:]:
                os.close(extra)
            return fds[0]
        for extra in fds:
            os.close(extra)
        return None

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
