"""The memory channel's thread serves every engine however one connection behaves (found by a
review): a connection that sends requests and never reads the replies held the thread 5 s a
reply once its socket buffer was full, so other engines' pools waited (14.5 s measured). The
server in this process, its clients real sockets."""

from __future__ import annotations

import os
import socket
import tempfile
import time

import pytest

from kvxfer.memchannel import PoolWho, _enc
from kvxfer.pool import PoolClient
from kvxfer.sidecar.pool_server import PoolServer


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _server() -> tuple[PoolServer, str]:
    """A memory channel's server, started, on a socket in a private folder."""
    folder = tempfile.mkdtemp(prefix="kvxfer-pc-")
    os.chmod(folder, 0o700)
    path = os.path.join(folder, "e.sock.mem")
    server = PoolServer(path)
    server.start()
    return server, path


def test_a_connection_that_reads_no_replies_holds_up_no_other_and_leaks_nothing() -> None:
    server, path = _server()
    try:
        good = PoolClient(path, timeout_s=30)
        good.create(1 << 20)  # (warm: the thread runs, a pool exists)
        before = _open_fds()
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        bad.connect(path)
        bad.setblocking(False)
        sent = 0
        try:
            for _ in range(3000):
                bad.send(_enc.encode(PoolWho()))
                sent += 1
        except BlockingIOError:
            pass
        time.sleep(0.5)  # (the thread answers them into a buffer nobody reads)
        t0 = time.monotonic()
        good.create(1 << 20)
        took = time.monotonic() - t0
        assert took < 1.0, f"another engine's pool took {took:.1f} s behind {sent} unread replies"
        bad.close()
        time.sleep(0.2)
        # (the new pool's fd, in the server and in the client: 2; the unread replies: nothing)
        assert _open_fds() - before <= 4, "replies not sent left fds open"
        good.close()
    finally:
        server.close()


def test_one_connection_cannot_hold_pools_without_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A memfd takes no memory until written, so each pool alone fitted what the machine had
    available: one connection held 3,000 (2.9 TiB on a 21 GiB machine) and as many fds here
    (found by a review). Pools are now bounded per connection, and in bytes by the machine's
    memory beside what is held."""
    from kvxfer.errors import ErrorCode, KvxferError, RequestError
    from kvxfer.sidecar import pool_server

    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(RequestError) as refused:
        pool_server.Room().check(1 << 20, -1, held=phys)
    assert refused.value.code == ErrorCode.OUT_OF_MEMORY
    monkeypatch.setattr(pool_server, "MAX_POOLS_PER_CONNECTION", 3)
    server, path = _server()
    try:
        client = PoolClient(path, timeout_s=30)
        for _ in range(3):
            client.create(1 << 20)
        with pytest.raises(KvxferError, match="holds 3 pools"):
            client.create(1 << 20)
        client.close()
    finally:
        server.close()

