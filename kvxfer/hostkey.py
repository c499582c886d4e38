"""This host's key: a file only the sidecar's user (and root) can read, that proves on this
host what no address can: that a caller runs as that user.

Loopback is no wall between users: any process of any uid on the host (and in a pod, any
container of it) can dial 127.0.0.1. So a sidecar with no shared secret does not run open on
loopback; it authenticates its handshakes with this key instead (``kvxfer.auth``, the same
challenge and MACs as a secret), and its control plane accepts calls signed with it
(``kvxfer.control.access``; ``kvxfer status`` and friends sign with it when they can read it).
Two sidecars of one user on one host find the same file and so trust each other; a user who
cannot read it can neither handshake nor list nor change anything.

The file is made on first use: 32 random bytes (hex), mode 0600, in a directory owned by the
sidecar's user that nobody else can write. A key file or directory that others could read or
replace is refused (ConfigError), never repaired silently. I/O only; no kvxfer imports but
errors.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Mapping

from kvxfer.errors import ConfigError

ENV = "KVXFER_HOST_KEY_FILE"
NAME = "host.key"
SYSTEM_DIR = "/run/kvxfer"  # systemd's RuntimeDirectory=kvxfer; root's default


def default_path(env: Mapping[str, str] | None = None, euid: int | None = None) -> str:
    """Where this user's sidecars keep the key when ``host_key_file`` is not set: /run/kvxfer
    for root or for the user who owns it (a service with RuntimeDirectory=kvxfer), else
    $XDG_RUNTIME_DIR/kvxfer, else ~/.local/state/kvxfer when $HOME is this user's own
    directory, else /tmp/kvxfer-<uid> (which another user can squat: load() then refuses it
    rather than trust it; set KVXFER_HOST_KEY_FILE)."""
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    if env.get(ENV):
        return env[ENV]
    try:
        owner = os.stat(SYSTEM_DIR).st_uid
    except OSError:
        owner = -1
    if euid == 0 or owner == euid:
        return os.path.join(SYSTEM_DIR, NAME)
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "kvxfer", NAME)
    home = env.get("HOME", "")
    try:
        own_home = bool(home) and home != "/" and os.stat(home).st_uid == euid
    except OSError:
        own_home = False
    if own_home:
        return os.path.join(home, ".local", "state", "kvxfer", NAME)
    return f"/tmp/kvxfer-{euid}/{NAME}"


def _private_dir(directory: str) -> None:
    """Make ``directory`` (0700, parents too) if it is missing; refuse one that is a symlink,
    is not ours (or root's) or that others may write (they could replace the key)."""
    with contextlib.suppress(FileExistsError):
        os.makedirs(directory, 0o700)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"host key directory {directory} is not a directory (a symlink?)")
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"host key directory {directory} belongs to uid {st.st_uid}, not to this "
                          f"sidecar's user (uid {os.geteuid()}): someone else made it first")
    if st.st_mode & 0o022:
        raise ConfigError(f"host key directory {directory} is writable by others "
                          f"(mode {stat.S_IMODE(st.st_mode):o}): they could replace the key")


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"host key {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"host key {path} belongs to uid {st.st_uid}, not to this sidecar's "
                              f"user (uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise ConfigError(f"host key {path} is readable or writable by others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it, or remove it "
                              "for a new one")
        key = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(key) < 32:
        raise ConfigError(f"host key {path} holds {len(key)} bytes: too short (remove it for a new one)")
    return key


def load(path: str) -> bytes:
    """The key in ``path``, made first when missing (atomically: two sidecars starting at once
    end up with the same key). ConfigError when it cannot be trusted or had."""
    directory = os.path.dirname(path) or "."
    try:
        _private_dir(directory)
        try:
            return _read(path)
        except FileNotFoundError:
            pass
        fd, tmp = _temp(directory)
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
            os.fsync(fd)
            os.close(fd)
            with contextlib.suppress(FileExistsError):  # another sidecar was first: use its key
                os.link(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return _read(path)
    except OSError as e:
        raise ConfigError(f"host key {path}: {e}") from e


def _temp(directory: str) -> tuple[int, str]:
    for _ in range(16):
        tmp = os.path.join(directory, f".{NAME}.{secrets.token_hex(6)}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o600), tmp
        except FileExistsError:
            continue
    raise ConfigError(f"cannot make a temporary file in {directory}")


def read_if_allowed(path: str) -> bytes | None:
    """A client's view (the CLI): the key when this user may read it, else None (another
    user's sidecar: its control plane then shows only what it shows anyone)."""
    try:
        with open(path, "rb") as fh:
            key = fh.read(4096).strip()
    except OSError:
        return None
    return key or None
