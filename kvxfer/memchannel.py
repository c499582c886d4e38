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
- ``PoolWho()``: answered ``PoolSelf(pid)`` with a pidfd of the sidecar process, the proof of
  its death the engine's connector waits for before it fails loads the sidecar was reading.

When the connection closes (the engine exited or was killed), the sidecar closes the fds
of its pools; a registration's own mapping keeps the memory while leases still hold blocks
in it, and unregistering it gives the memory back.

``device`` (every message; -1: host memory) asks for a GPU pool instead: a CUDA VMM
allocation exported as a POSIX fd (``kvxfer.vmm``; not yet run on a GPU), granted rounded
up to the allocation granularity. The fd plays the memfd's part everywhere above.

This module is what both ends need: the messages and their codecs, the socket's path, the
memfd helpers (create, check, map) and the /proc/meminfo readings. The engine end is
``kvxfer.pool`` (``Pool``, ``PoolClient``), the sidecar end ``kvxfer.sidecar.pool_server``
(``PoolServer``). It never imports either end, nor anything of ``kvxfer.sidecar``, and keeps
no state: no sockets, no threads.
"""

from __future__ import annotations

import mmap
import os
import stat
from typing import Annotated

import msgspec
from msgspec import Meta

from kvxfer.errors import ErrorCode, RequestError

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


class PoolWho(_PoolMsg, tag="who"):
    """Which process is the sidecar: answered ``PoolSelf`` with a pidfd of it (``SCM_RIGHTS``),
    which polls readable once that process has exited, in whatever PID namespace either end
    runs: how an engine proves its sidecar is gone (and can write nothing more) at once."""


class PoolSelf(_PoolMsg, tag="self"):
    pid: int  # in the sidecar's own PID namespace (for logs)


_requests = msgspec.msgpack.Decoder(PoolCreate | PoolAdopt | PoolFree | PoolWho)
_replies = msgspec.msgpack.Decoder(PoolGranted | PoolRefused | PoolSelf)
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
