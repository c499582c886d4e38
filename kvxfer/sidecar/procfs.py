"""What the kernel says about the processes that talk to this sidecar: a connection's
credentials (``SO_PEERCRED``), a process's ancestry and whether it has a file open or
mapped (/proc). The facts ``kvxfer.sidecar.ownership`` decides on; no decision here.

Never trust a pid a message carries for any of this: only the kernel's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct

from kvxfer.sidecar.ownership import UNKNOWN, Creds, Holder

_CRED = struct.Struct("3i")
MAX_ANCESTORS = 64


def creds_of(sock: socket.socket) -> Creds:
    """The pid and uid of the process at the other end of a unix socket (UNKNOWN: not one)."""
    try:
        pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError:
        return UNKNOWN
    return Creds(pid, uid, start_time(pid))


def creds_of_fd(fd: int) -> Creds:
    """``peer_of`` for a descriptor someone else owns (a ZMQ connection's): read through a
    duplicate, closed again at once."""
    if fd < 0:
        return UNKNOWN
    try:
        dup = os.dup(fd)
    except OSError:
        return UNKNOWN
    with socket.socket(fileno=dup) as s:
        if s.family != socket.AF_UNIX:
            return UNKNOWN
        return creds_of(s)


def _stat(pid: int) -> list[bytes]:
    """The fields of /proc/<pid>/stat after the command name ([]: gone, not visible from
    here, no pid)."""
    if pid <= 0:
        return []
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def parent_of(pid: int) -> int:
    """A process's parent pid (0: gone, or not visible here)."""
    fields = _stat(pid)
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return 0


def start_time(pid: int) -> str:
    """A process's start time (clock ticks since boot, /proc/<pid>/stat field 22); "" when
    not visible from here (gone, another PID namespace, no pid)."""
    fields = _stat(pid)
    return fields[19].decode() if len(fields) > 19 else ""


def stopped(creds: Creds) -> bool:
    """Whether a connection's process is stopped (SIGSTOP, a debugger: state T or t) and
    is still the process that connected (same start time, when known)."""
    fields = _stat(creds.pid)
    return fields[:1] in ([b"T"], [b"t"]) and (not creds.start or fields[19:20] == [creds.start.encode()])


def lineage(pid: int) -> tuple[int, ...]:
    """``pid`` and its ancestors, nearest first, without init (pid 1: everyone's ancestor) unless
    it is ``pid`` itself; () for an unknown pid."""
    if pid <= 0:
        return ()
    chain = [pid]
    while len(chain) < MAX_ANCESTORS:
        parent = parent_of(chain[-1])
        if parent <= 1 or parent in chain:
            break
        chain.append(parent)
    return tuple(chain)


def holder(creds: Creds) -> Holder:
    """The registering process's facts: its credentials and its ancestry."""
    chain = lineage(creds.pid)
    return Holder(creds, chain, tuple(start_time(p) for p in chain))


def has_open(pid: int, dev: int, ino: int) -> bool:
    """Whether process ``pid`` has the file (``dev``, ``ino``) open or mapped right now."""
    if pid <= 0:
        return False
    fds = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for name in os.listdir(fds):
            with contextlib.suppress(OSError):
                st = os.stat(f"{fds}/{name}")  # (follows the magic link to the open file itself)
                if (st.st_dev, st.st_ino) == (dev, ino):
                    return True
    want = f"{os.major(dev):02x}:{os.minor(dev):02x} {ino} "
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as fh:
        for line in fh:  # address perms offset dev inode path
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and f"{fields[3]} {fields[4]} " == want:
                return True
    return False
