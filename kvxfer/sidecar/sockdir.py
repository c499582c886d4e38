"""The directory of the engine socket, and the files the sidecar makes in it (the socket,
``<socket>.lock``, ``<socket>.mem``): the directory must be private, the lock is never
reached through a link.

A user who can write that directory could plant ``<socket>.lock`` as a link to any file, and
a sidecar running as root would truncate it and write its pid there (#40); or swap the
socket files for their own. So the sidecar refuses to start unless the directory is owned by
its uid (or root) and writable by no one else, a sticky world-writable one like ``/tmp``
included (engine sockets belong in a private directory such as ``/run/kvxfer``, mode 0700).
It only checks and opens: it never binds or listens.
"""

from __future__ import annotations

import errno
import os
import stat

from kvxfer.errors import ListenError


def check_private(directory: str, what: str) -> None:
    """ListenError unless ``directory`` is owned by this process's uid (or root) and nobody
    else may write it. ``what`` names the socket for the message."""
    try:
        st = os.stat(directory)
    except OSError as e:
        raise ListenError(f"{what}: its directory {directory}: {e.strerror or e}") from None
    euid = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        raise ListenError(f"{what}: {directory} is not a directory")
    if st.st_uid in (euid, 0) and not mode & (stat.S_IWGRP | stat.S_IWOTH):
        return
    shared = mode & (stat.S_IWGRP | stat.S_IWOTH)
    own = os.path.join(directory, "kvxfer") if shared or st.st_uid not in (euid, 0) else directory
    raise ListenError(
        f"{what}: its directory {directory} (mode {mode:04o}, owner uid {st.st_uid}) is "
        f"{'writable by others' if shared else 'owned by another user'}: the sidecar needs a private "
        f"directory, owned by uid {euid}{' or root' if euid else ''} and writable by no one else, or "
        f"others could plant files beside its socket. Put the socket in a directory of its own (e.g. "
        f"`install -d -m 0700 {own}` and a path inside it; never change the mode of a shared "
        f"directory such as /tmp)")


def open_lock(path: str) -> int:
    """Open (creating it 0600) the lock file at ``path``: never through a link, and only a
    regular file of this uid. Returns the fd (close-on-exec); ListenError otherwise."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise ListenError(f"lock file {path}: {why}: remove it (and find out who put it there)") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise ListenError(f"lock file {path} is {kind} owned by uid {st.st_uid}, not this sidecar's "
                          f"uid {os.geteuid()}: remove it (and find out who put it there)")
    return fd
