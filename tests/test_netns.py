"""Two sidecars on two "hosts": network namespaces joined by a veth pair, UCX forced onto
TCP so the data really crosses the link. Peer death and link-down are then network
failures, not only a killed process. Needs root (`ip netns`); skipped without it."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from kvxfer.client import RemoteBlocks, SidecarClient
from kvxfer.errors import ErrorCode
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc
from tests.test_sidecar import wait_for

NS_P, NS_D = f"kvxp{os.getpid() % 10000}", f"kvxd{os.getpid() % 10000}"
VETH_P, VETH_D = f"kvp{os.getpid() % 10000}", f"kvd{os.getpid() % 10000}"
IP_P, IP_D = "10.231.7.1", "10.231.7.2"
TCP_ONLY = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "all"}


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def hosts() -> Iterator[None]:
    try:
        ip("netns", "add", NS_P)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot create network namespaces here: {e}")
    try:
        ip("netns", "add", NS_D)
        ip("link", "add", VETH_P, "type", "veth", "peer", "name", VETH_D)
        ip("link", "set", VETH_P, "netns", NS_P)
        ip("link", "set", VETH_D, "netns", NS_D)
        for ns, dev, addr in ((NS_P, VETH_P, IP_P), (NS_D, VETH_D, IP_D)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (NS_P, NS_D):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10, check=False)
        with contextlib.suppress(OSError):
            os.unlink(_secret()[1])


def _secret() -> tuple[str, str]:
    """Both hosts share a secret, as deployed: handshakes across the veth are authenticated
    and encrypted (CurveZMQ), which these tests therefore also cover across hosts."""
    path = os.path.join(tempfile.gettempdir(), f"kvxfer-netns-secret-{os.getpid()}")
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
    return ("--secret-file", path)


def start_decode(f: SidecarFactory, tag: str, *args: str) -> SidecarProc:
    return f.start(f"{tag}-d", "--handshake-host", IP_D, *_secret(), "--ucx-error-mode", "peer",
                   "--handshake-timeout-s", "2", *args, env=TCP_ONLY, prefix=("ip", "netns", "exec", NS_D))


def start_prefill(f: SidecarFactory, tag: str) -> SidecarProc:
    return f.start(f"{tag}-p", "--handshake-host", IP_P, *_secret(), "--ucx-error-mode", "peer",
                   env=TCP_ONLY, prefix=("ip", "netns", "exec", NS_P))


def start_pair(
    f: SidecarFactory, tag: str, decode_args: tuple[str, ...] = ()
) -> tuple[SyntheticEngine, SyntheticEngine, SidecarProc, SidecarProc]:
    ps = start_prefill(f, tag)
    ds = start_decode(f, tag, *decode_args)
    lay = make_layout(layers=32, num_blocks=80, heads=8, head_dim=128)  # 2 MiB blocks
    p, d = SyntheticEngine(lay, ps.endpoint, seed=1), SyntheticEngine(lay, ds.endpoint, seed=2)
    p.start()
    d.start()
    return p, d, ps, ds


def move(p: SyntheticEngine, d: SyntheticEngine, name: str, n: int, deadline_s: float = 0.0) -> None:
    reg = p.registered
    assert reg is not None
    pb, db = p.allocate(n), d.allocate(n)
    p.fill(name, pb)
    p.client.hold(name, pb)
    d.client.recv(name, db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb),
                  deadline_s=deadline_s)
    move.last = (pb, db)  # type: ignore[attr-defined]


def warm_then_cut(p: SyntheticEngine, d: SyntheticEngine, deadline_s: float) -> float:
    """A warm-up read, then a 120 MiB read with ``deadline_s``, then decode's link down
    mid-read; returns when the link went down."""
    move(p, d, "warm", 1)
    assert not wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=60).failed
    move(p, d, "cut", 60, deadline_s=deadline_s)
    time.sleep(0.05)
    ip("-n", NS_D, "link", "set", VETH_D, "down")
    return time.monotonic()


def test_transfer_across_namespaces_then_prefill_host_dies(hosts: None, sidecars: SidecarFactory) -> None:
    p, d, ps, _ = start_pair(sidecars, "ns1")
    try:
        assert p.registered is not None
        assert p.registered.handshake_host == IP_P
        move(p, d, "across", 4)
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=60)
        assert not got.failed, got.failed
        assert d.verify("across", move.last[1])  # type: ignore[attr-defined]
        move(p, d, "dying", 60, deadline_s=30)  # 120 MiB over TCP
        time.sleep(0.05)
        os.kill(ps.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        t0 = time.monotonic()
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=60)
        took = time.monotonic() - t0
        print(f"\nprefill host killed mid-read: {got.failed or got.done} after {took:.3f}s")
        assert got.failed, "the 120 MiB read over TCP finished before the kill"
        assert got.failed[0].code in (ErrorCode.PEER_DISCONNECTED, ErrorCode.TRANSFER_ERROR)
        assert got.failed[0].block_ids == move.last[1]  # type: ignore[attr-defined]
        assert took < 10
        assert d.client.ping(5).engine_id == "ns1-d"
    finally:
        p.close()
        d.close()


def test_link_down_for_good_the_decode_sidecar_fences_by_exiting(
    hosts: None, sidecars: SidecarFactory
) -> None:
    """The link goes down mid-read and stays down. UCX over TCP never fails the in-flight
    GETs (measured: nothing in 150 s, with or without UCX keepalive tuning), so the read
    cannot settle: after settle_timeout_s the decode sidecar exits with status 3, taking
    its endpoints with it, rather than report a failure that would let the engine reuse
    blocks a late chunk may still write. Restarted, it serves again. (The last resort: with
    --peer-stall-s on, the silent peer's removal settles them first; the next test.)"""
    p, d, ps, ds = start_pair(sidecars, "ns2", decode_args=("--settle-timeout-s", "3", "--peer-stall-s", "0"))
    try:
        t0 = warm_then_cut(p, d, deadline_s=1.5)
        try:
            code = ds.proc.wait(30)
            took = time.monotonic() - t0
        finally:
            ip("-n", NS_D, "link", "set", VETH_D, "up")
        print(f"\nlink cut for good: decode sidecar exited {code} after {took:.2f}s")
        assert code == 3
        assert 1.5 + 3 - 0.1 <= took < 1.5 + 3 + 5  # t0 is taken ~50 ms into the read
        assert "no late write can land" in ds.log()
        # The supervisor's restart: same engine socket, the engine re-registers, bytes move.
        ds2 = start_decode(sidecars, "ns2")
        d.client.close()
        d.client = SidecarClient(ds2.endpoint)
        d.start()
        for attempt in range(2):
            move(p, d, f"after{attempt}", 2)
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=60)
            if not got.failed:
                break
            # Only a crashed prefill sidecar excuses a failure here. Upstream NIXL/UCX
            # (nixl-cu12 1.x) sometimes segfaults in the READ target's get_new_notifs when
            # the dead decode's TCP connection errors out as the link returns (about 1 run
            # in 4 under load; faulthandler prints the stack to its log). The supervisor
            # restarts it like any crashed sidecar; its engine re-registers.
            time.sleep(1)
            assert attempt == 0, got.failed
            assert ps.proc.poll() is not None, got.failed
            print(f"prefill sidecar died ({ps.proc.returncode}) when the link came back: "
                  "known NIXL/UCX crash, restarting it")
            ps = start_prefill(sidecars, "ns2")
            p.client.close()
            p.client = SidecarClient(ps.endpoint)
            p.start()
        assert d.verify(f"after{attempt}", move.last[1])  # type: ignore[attr-defined]
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("stall", ["0", "1"])
def test_a_failed_read_is_reported_only_when_no_late_write_can_land(
    hosts: None, sidecars: SidecarFactory, stall: str
) -> None:
    """The read hits its deadline while the link is down with GETs in flight. Reporting
    Failed then would let the engine reuse the blocks while the prefill side's queued
    responses wait to be retransmitted (measured: they land once the link is back). The
    sidecar reports Failed only when those chunks stopped; the blocks, reused at once by
    the engine (here: another request's data), stay intact. With --peer-stall-s 0 they stop
    when the link is back; with it on, the silent peer is dropped after --peer-stall-s and
    the removal of its NIXL entry stops them at once (closes its endpoints), before."""
    p, d, _, ds = start_pair(sidecars, f"ns3{stall}", decode_args=("--peer-stall-s", stall))
    try:
        t_cut = warm_then_cut(p, d, deadline_s=1.5)
        restore = threading.Timer(3.0, ip, ("-n", NS_D, "link", "set", VETH_D, "up"))
        restore.start()
        try:
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=60)
            took = time.monotonic() - t_cut
        finally:
            restore.join()
            ip("-n", NS_D, "link", "set", VETH_D, "up")
        _, db = move.last  # type: ignore[attr-defined]
        d.fill("reused", db)  # what vLLM does next: recompute into the same blocks
        print(f"\nFailed after {took:.2f}s (deadline 1.5s, link back at 3s): {got.failed[0].reason}")
        assert got.failed, "the 120 MiB read over TCP finished before the cut"
        # (stalled at --peer-stall-s 1, before the deadline: unless the deadline came first)
        assert got.failed[0].code in ((ErrorCode.DEADLINE,) if stall == "0"
                                      else (ErrorCode.PEER_STALLED, ErrorCode.DEADLINE))
        assert got.failed[0].block_ids == db
        if stall == "0":
            assert took > 3.0, "Failed was reported while chunks were still in flight"
        else:
            assert took < 3.0, "the stalled peer's chunks were not stopped before the link came back"
            assert "stalled" in ds.log()
        time.sleep(3)  # anything still queued anywhere has had time to arrive
        assert d.verify("reused", db), "a late NIXL write landed in blocks reused after Failed"
        # and the pair keeps working
        move(p, d, "after", 2)
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=60)
        assert not got.failed, got.failed
        assert d.verify("after", move.last[1])  # type: ignore[attr-defined]
    finally:
        p.close()
        d.close()
