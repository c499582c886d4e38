"""The sidecar owns the KV memory and hands it to the engine by fd (#18).

The memory channel on its own (a real ``PoolServer`` and ``PoolClient``: memfds passed with
SCM_RIGHTS, what is refused), then real sidecars, engines and NIXL: every process of a P/D
pair SIGKILLed mid-transfer leaves nothing in /dev/shm and gives the memory back
(``Shmem`` in /proc/meminfo); a prefill engine SIGKILLed after its prefill still has its
held blocks read by the decode, bytes verified, and the memory is freed after the release.
(A sidecar restart, where the engine hands its pools back and re-registers the same
memory, is covered by tests/test_generations.py and the connector worker test in
tests/test_faults.py.)
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvxfer.client import RemoteBlocks, SidecarClient
from kvxfer.errors import ErrorCode, KvxferError
from kvxfer.memchannel import (
    PoolAdopt,
    _enc,
    _replies,
    check_memfd,
    mem_socket_path,
    memfd,
    shmem_bytes,
)
from kvxfer.memory import SharedKV
from kvxfer.pool import PoolClient
from kvxfer.sidecar.pool_server import PoolServer
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port

MiB = 1 << 20


def _kvxfer_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("kvxfer-")}


# ----------------------------------------------------------------------------- the channel


def test_the_memory_channel_hands_out_sealed_memfds_and_refuses_what_is_not(tmp_path: Path) -> None:
    server = PoolServer(str(tmp_path / "engine.sock.mem"), max_bytes=64 * MiB)
    server.start()
    client = PoolClient(server.path, timeout_s=5)
    before = _kvxfer_files()
    try:
        assert oct(os.stat(server.path).st_mode & 0o777) == "0o600"
        pool = client.create(8 * MiB, label="t")
        check_memfd(pool.fd, 8 * MiB)  # the engine got a sealed memfd of that size
        with pytest.raises(PermissionError):
            os.ftruncate(pool.fd, MiB)  # sealed: nobody shrinks it under a mapping
        mm = pool.map()
        mm[:4] = b"kvxf"
        fd, size, _ = server.dup(pool.id)  # the sidecar's side: the same pages
        try:
            assert size == 8 * MiB
            assert os.pread(fd, 4, 0) == b"kvxf"
        finally:
            os.close(fd)
        assert server.stats() == (1, 8 * MiB)
        assert _kvxfer_files() == before  # nothing named anywhere
        # Too large: refused before anything is allocated, saying how much is asked and allowed.
        with pytest.raises(KvxferError, match=r"out_of_memory.*max-pool-bytes"):
            client.create(60 * MiB)
        assert server.stats() == (1, 8 * MiB)
        # Only sealed memfds are taken back: not a file, not an unsealed memfd.
        with tempfile.TemporaryFile() as fh:
            fh.truncate(MiB)
            assert "not a memfd" in _adopt_reply(server.path, fh.fileno(), MiB)
        loose = os.memfd_create("loose")
        os.ftruncate(loose, MiB)
        try:
            assert "not sealed" in _adopt_reply(server.path, loose, MiB)
        finally:
            os.close(loose)
        sealed = memfd(MiB)
        try:
            assert "not 4194304" in _adopt_reply(server.path, sealed, 4 * MiB)  # smaller than it says
        finally:
            os.close(sealed)
        with pytest.raises(Exception, match="no pool"):
            server.dup("f" * 32)
        # The engine's connection ends: the sidecar lets go of its pools.
        client.close()
        _until(lambda: server.stats() == (0, 0), "the pools of a closed connection")
    finally:
        client.close()
        server.close()


def _adopt_reply(path: str, fd: int, size: int) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect(path)
        socket.send_fds(s, [_enc.encode(PoolAdopt(pool="a" * 32, size=size))], [fd])
        reply = _replies.decode(s.recv(4096))
        return getattr(reply, "message", repr(reply))


def _until(cond: Any, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what}: timed out"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- real processes

LAYOUT = make_layout(layers=4, num_blocks=256, heads=8, head_dim=128)  # 64 MiB per engine
POOL = LAYOUT.num_regions * LAYOUT.num_blocks * LAYOUT.region_block_len


def _shmem_back_to(baseline: int, what: str, slack: int = 16 * MiB, timeout: float = 20.0) -> int:
    end = time.monotonic() + timeout
    while True:
        now = shmem_bytes()
        if now <= baseline + slack:
            return now
        assert time.monotonic() < end, f"{what}: Shmem {now / MiB:.0f} MiB, was {baseline / MiB:.0f} MiB"
        time.sleep(0.1)


def _prefill_then_die(endpoint: str, conn: Any) -> None:
    eng = SyntheticEngine(LAYOUT, endpoint, seed=1)
    reg = eng.start()
    blocks = eng.allocate(16)
    eng.fill("kept", blocks)
    eng.client.hold("kept", blocks, lease_s=60, token="t-kept")
    eng.client.ping(10)  # the hold has been processed
    conn.send((reg.engine_id, reg.handshake_host, reg.handshake_port, blocks))
    conn.recv()  # the test has measured
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_prefill_engines_held_blocks_are_still_read_then_freed(factory: SidecarFactory) -> None:
    ps = factory.start("orphan-p", "--engine-check-s", "0.2")
    ds = factory.start("orphan-d")
    d = SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    d.start()
    baseline = shmem_bytes()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_prefill_then_die, args=(ps.endpoint, there))
    proc.start()
    try:
        assert here.poll(60), "the prefill engine never held its blocks"
        engine_id, host, port, blocks = here.recv()
        # its pool is there: mapped by the sidecar (shmem is machine-wide: another test's
        # processes exiting meanwhile made it read 40 of the pool's 64 MiB once in a full run)
        assert _maps_a_pool(ps.proc.pid)
        here.send("measured")
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        _until(lambda: f"engine process {proc.pid} exited" in ps.log(),
               "the sidecar noticing its engine died")
        # The decode reads what the dead engine prefilled: every byte.
        local = d.allocate(16)
        d.client.recv("kept", local, RemoteBlocks(engine_id, host, port, blocks, token="t-kept"))
        got = d.client.wait_until(lambda a: bool(a.done or a.failed), 30)
        assert [x.req_id for x in got.done] == ["kept"], got
        assert d.verify("kept", local)
        # Released by the read; the orphaned rank and its memory go with the last lease.
        _until(lambda: "freeing its memory" in ps.log(), "the orphaned rank's removal")
        # Freed: its engine is dead, so the sidecar's mapping was the last reference. Shmem is
        # machine-wide (other processes' memory moves it: this used to fail now and then,
        # before and after the engine rings), so the sidecar's own mappings decide as well.
        _until(lambda: shmem_bytes() <= baseline + 16 * MiB or not _maps_a_pool(ps.proc.pid),
               "the dead engine's pool after its last lease", timeout=20.0)
        assert not _kvxfer_files_of(proc.pid)
    finally:
        if proc.is_alive():
            proc.kill()
        d.close()


def _maps_a_pool(pid: int) -> bool:
    """Whether the process maps a KV pool (a memfd the memory channel made)."""
    with open(f"/proc/{pid}/maps") as fh:
        return any("memfd:kvxfer-kv" in line for line in fh)


def _kvxfer_files_of(pid: int | None) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith("kvxfer-") and str(pid) in f]


def _looping_prefill(endpoint: str, conn: Any) -> None:
    eng = SyntheticEngine(LAYOUT, endpoint, seed=1)
    reg = eng.start()
    i = 0
    while True:  # until killed
        if eng.free_blocks < 32:
            for r in eng.client.wait(0.05).released:
                eng.free(r_blocks.pop(r.req_id))
            continue
        name = f"r{i}"
        blocks = eng.allocate(16)
        eng.fill(name, blocks)
        eng.client.hold(name, blocks, lease_s=30)
        r_blocks[name] = blocks
        conn.send((name, reg.engine_id, reg.handshake_host, reg.handshake_port, blocks))
        for r in eng.client.poll().released:
            eng.free(r_blocks.pop(r.req_id))
        i += 1


r_blocks: dict[str, list[int]] = {}


def _looping_decode(endpoint: str, conn: Any, done: Any) -> None:
    eng = SyntheticEngine(LAYOUT, endpoint, seed=2)
    eng.start()
    waiting: dict[str, list[int]] = {}
    while True:  # until killed
        while conn.poll(0) and eng.free_blocks >= 16:
            name, engine_id, host, port, blocks = conn.recv()
            local = eng.allocate(16)
            waiting[name] = local
            eng.client.recv(name, local, RemoteBlocks(engine_id, host, port, blocks))
        ev = eng.client.wait(0.05)
        for x in ev.done + ev.failed:
            eng.free(waiting.pop(x.req_id))
        if ev.done:
            done.value += len(ev.done)


def test_kill_9_of_a_whole_pd_pair_mid_transfer_leaves_nothing_behind(factory: SidecarFactory) -> None:
    baseline, files = shmem_bytes(), _kvxfer_files()
    ps, ds = factory.start("k9-p"), factory.start("k9-d")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    done = ctx.Value("i", 0)
    engines = [ctx.Process(target=_looping_prefill, args=(ps.endpoint, there)),
               ctx.Process(target=_looping_decode, args=(ds.endpoint, here, done))]
    for e in engines:
        e.start()
    procs: list[SidecarProc | Any] = [ps, ds]
    try:
        _until(lambda: done.value >= 20, "transfers under way", timeout=60)
        assert shmem_bytes() >= baseline + 2 * POOL * 0.9  # both pools exist
        at = done.value
        for pid in [e.pid for e in engines] + [p.proc.pid for p in procs]:
            os.kill(pid, signal.SIGKILL)  # all at once, in the middle of transfers
        for e in engines:
            e.join(10)
        for p in procs:
            p.proc.wait(10)
        print(f"\nkilled a P/D pair after {at} transfers; Shmem {baseline / MiB:.0f} MiB before, "
              f"{shmem_bytes() / MiB:.0f} MiB after")
        assert done.value < 100_000  # (they were moving when killed)
        _shmem_back_to(baseline, "memory after kill -9 of every process")
        assert _kvxfer_files() == files, "files left in /dev/shm"
    finally:
        for e in engines:
            if e.is_alive():
                e.kill()
        with contextlib.suppress(Exception):
            here.close()
            there.close()


def test_a_pool_larger_than_the_machine_is_refused_before_anything_is_allocated(
        factory: SidecarFactory) -> None:
    sc = factory.start("huge", metrics_port=free_port())
    client = PoolClient.for_engine_socket(sc.endpoint)
    assert client is not None
    try:
        with pytest.raises(KvxferError) as ei:
            client.create(1 << 43)  # 8 TiB
        assert ErrorCode.OUT_OF_MEMORY in str(ei.value)
        assert "available" in str(ei.value)
        assert sc.scrape()["kvxfer_pool_bytes"] == 0
        pool = client.create(4 * MiB)  # a reasonable one still works
        assert pool.size == 4 * MiB
        assert sc.scrape()["kvxfer_pool_bytes"] == 4 * MiB
    finally:
        client.close()


def test_the_legacy_engine_owned_file_still_registers_with_a_warning(factory: SidecarFactory) -> None:
    """What still needs it (no pool hook, a tcp:// sidecar) can register a /dev/shm file;
    the sidecar says at once that it is the path that leaks on a SIGKILL."""
    sc = factory.start("legacy")
    layout = make_layout(layers=2, num_blocks=8, heads=2, head_dim=16)
    kv = SharedKV.create(layout)  # no pools: a named 0600 file
    client = SidecarClient(sc.endpoint)
    try:
        client.ping(30)
        reg = client.register(msgspec.structs.replace(kv.register_message(), pid=os.getpid()), 30)
        assert reg.bytes_registered == kv.nbytes
        log = sc.log()
        assert "legacy path" in log
        assert kv.path in log
    finally:
        client.close()
        kv.close()


_NS_ENGINE = """
import sys, time
from kvxfer.testing.engine import SyntheticEngine, make_layout
e = SyntheticEngine(make_layout(layers=2, num_blocks=16, heads=2, head_dim=16), sys.argv[1])
e.start()
import os
print("registered as pid", os.getpid(), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare as root")
def test_an_engine_in_another_pid_namespace_is_seen_to_die(factory: SidecarFactory) -> None:
    """As a Kubernetes pod's containers are (no shareProcessNamespace): the engine's pid means
    nothing to the sidecar, so its death shows only as its memory channel closing."""
    sc = factory.start("ns", "--engine-check-s", "0.2", metrics_port=free_port())
    engine = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", _NS_ENGINE, sc.endpoint],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = engine.stdout.readline() if engine.stdout else ""
        assert line.startswith("registered as pid"), line
        assert int(line.split()[-1]) < 10  # its own namespace's pid, not one the sidecar can check
        assert sc.scrape()["kvxfer_registered_ranks"] == 1
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait(10)
        t0 = time.monotonic()
        while sc.scrape()["kvxfer_registered_ranks"] != 0:
            assert time.monotonic() - t0 < 5, sc.log()[-2000:]
            time.sleep(0.05)
        print(f"\nengine in another PID namespace SIGKILLed: rank dropped in {time.monotonic() - t0:.2f} s")
        assert "exited (its memory channel closed; exited or killed)" in sc.log()
        assert sc.scrape()["kvxfer_pool_bytes"] == 0
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
            engine.wait()
        if engine.stdout:
            engine.stdout.close()


def test_the_memory_channel_serves_past_1024_descriptors(sidecars: SidecarFactory) -> None:
    """1,100 idle connections push the sidecar's descriptor numbers past 1024, where
    ``select()`` fails for good (the channel used to stop answering at ~1,016); with poll
    the next engine still gets its pool."""
    sc = sidecars.start("fd-storm")
    path = mem_socket_path(sc.endpoint)
    end = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < end:  # (the sidecar starting)
        time.sleep(0.05)
    idle = []
    try:
        for _ in range(1100):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(path)
            idle.append(s)
        time.sleep(0.5)  # (accepted by the channel's thread)
        client = PoolClient(path, timeout_s=10.0)
        try:
            pool = client.create(MiB, label="after-storm")
            assert pool.size == MiB
            client.free(pool)
        finally:
            client.close()
    finally:
        for s in idle:
            s.close()


def test_a_storm_of_idle_connections_never_closes_an_engines_channel(tmp_path: Path) -> None:
    """Past its maximum of connections the channel closes the oldest one that holds no pool,
    never an engine's that holds one, and keeps granting pools; refusals are reported."""
    server = PoolServer(str(tmp_path / "e.sock.mem"))
    server.max_connections = 4
    refused: list[int] = []
    server.on_refused = refused.append
    server.start()
    engine = PoolClient(server.path, timeout_s=5)
    idle: list[socket.socket] = []
    try:
        pool = engine.create(MiB, label="engine")
        for _ in range(50):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(server.path)
            idle.append(s)
        late = PoolClient(server.path, timeout_s=5)  # a new engine, in the storm
        try:
            assert late.create(MiB, label="late").size == MiB
            assert len(server._conns) <= 4
            assert len(refused) >= 47
            # every slot holds a pool: a new connection is the one closed
            fillers = [PoolClient(server.path, timeout_s=5) for _ in range(2)]
            for f in fillers:
                f.create(MiB, label="filler")
            extra = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            idle.append(extra)
            extra.connect(server.path)
            extra.settimeout(5)
            assert extra.recv(16) == b""  # closed by the channel
            assert server.holds(pool.id)  # the first engine's channel was never the one closed
            assert engine.create(MiB, label="again").size == MiB
            for f in fillers:
                f.close()
        finally:
            late.close()
    finally:
        for s in idle:
            s.close()
        engine.close()
        server.close()
