"""Faults with real processes and real NIXL: peer death, restarts, and garbage input."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.client import RemoteBlocks
from kvxfer.errors import ErrorCode
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, free_port, handshake_dealer
from tests.test_sidecar import wait_for

BIG = make_layout(layers=32, num_blocks=260, heads=8, head_dim=128)  # 2 MiB per block


def remote_of(eng: SyntheticEngine, blocks: list[int]) -> RemoteBlocks:
    reg = eng.registered
    assert reg is not None
    return RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, blocks)


def test_prefill_sidecar_killed_mid_transfer(sidecars: SidecarFactory) -> None:
    ds = sidecars.start("fault-d", "--chunk-mib", "2", "--max-inflight-chunks", "1",
                        "--handshake-timeout-s", "2")
    d = SyntheticEngine(BIG, ds.endpoint, seed=2)
    d.start()
    try:
        failed = None
        for attempt in range(3):  # the kill must land while the read runs
            ps = sidecars.start(f"fault-p{attempt}")
            p = SyntheticEngine(BIG, ps.endpoint, seed=1)
            try:
                p.start()
                pb, db = p.allocate(256), d.allocate(256)  # 512 MiB
                p.client.hold("victim", pb)
                d.client.recv("warm", [], remote_of(p, []))  # handshake first
                wait_for(d.client, lambda a: bool(a.done))
                d.client.recv(f"victim-{attempt}", db, remote_of(p, pb), deadline_s=30)
                time.sleep(0.03)
                t_kill = time.monotonic()
                os.kill(ps.proc.pid, signal.SIGKILL)
                got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
                took = time.monotonic() - t_kill
                d.free(db)
            finally:
                p.close()
            if got.failed:
                failed = got.failed[0]
                break
        assert failed is not None, "the read always finished before the kill"
        assert failed.code in (ErrorCode.PEER_DISCONNECTED, ErrorCode.TRANSFER_ERROR)
        assert failed.block_ids == db
        assert took < 5, f"failure reported after {took:.1f}s"
        assert d.client.ping(2).engine_id == "fault-d"  # the decode sidecar lives on

        # A restarted prefill sidecar (new address, new agent) is handshaked afresh.
        ps2 = sidecars.start("fault-p-new")
        p2 = SyntheticEngine(BIG, ps2.endpoint, seed=3)
        try:
            p2.start()
            pb, db = p2.allocate(4), d.allocate(4)
            p2.fill("after", pb)
            p2.client.hold("after", pb)
            d.client.recv("after", db, remote_of(p2, pb))
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
            assert not got.failed, got.failed
            assert d.verify("after", db)
        finally:
            p2.close()
    finally:
        d.close()


def test_decode_that_never_reads_lets_the_lease_expire(sidecars: SidecarFactory) -> None:
    ps = sidecars.start("lease-p")
    ds = sidecars.start("lease-d")
    lay = make_layout(layers=2, num_blocks=16, heads=2, head_dim=16)
    p, d = SyntheticEngine(lay, ps.endpoint), SyntheticEngine(lay, ds.endpoint)
    try:
        p.start()
        d.start()
        pb = p.allocate(2)
        p.client.hold("orphan", pb, lease_s=0.5)
        os.kill(ds.proc.pid, signal.SIGKILL)  # the decode side dies before reading
        rel = wait_for(p.client, lambda a: bool(a.released), timeout=5)
        assert [(r.req_id, r.reason) for r in rel.released] == [("orphan", "expired")]
    finally:
        p.close()
        d.close()


frames = st.lists(st.binary(max_size=300), min_size=1, max_size=3)
tagged = st.builds(
    lambda tag, rest: msgspec.msgpack.encode([tag, *rest]),
    st.sampled_from(["register", "unregister", "hold", "release", "recv", "ping", "nope", ""]),
    st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=20), st.binary(max_size=20),
                       st.lists(st.integers(-5, 1 << 40), max_size=5), st.none(), st.floats()),
             max_size=12),
)


def test_fuzz_engine_and_handshake_sockets_then_move_bytes(sidecars: SidecarFactory) -> None:
    ps = sidecars.start("fuzz-p")
    ds = sidecars.start("fuzz-d")
    lay = make_layout(layers=2, num_blocks=32, heads=2, head_dim=16)
    p, d = SyntheticEngine(lay, ps.endpoint, seed=1), SyntheticEngine(lay, ds.endpoint, seed=2)
    ctx = zmq.Context.instance()
    sent = {"n": 0}
    try:
        p.start()
        d.start()
        reg = p.registered
        assert reg is not None
        raw = ctx.socket(zmq.DEALER)
        raw.connect(ds.endpoint)
        # the listener is a CurveZMQ server (keys from this user's host key): fuzz what gets
        # through the encryption, as a holder of the key would
        hs = handshake_dealer(ctx, "127.0.0.1", reg.handshake_port)

        @settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.one_of(frames, tagged.map(lambda b: [b])), st.booleans())
        def throw(parts: list[bytes], to_handshake: bool) -> None:
            (hs if to_handshake else raw).send_multipart(parts)
            sent["n"] += 1

        throw()
        time.sleep(0.5)
        for sock in (raw, hs):  # every frame got an answer (typed error or refusal)
            answers = 0
            while sock.poll(200):
                sock.recv_multipart()
                answers += 1
            assert answers > 0
        raw.close(0)
        hs.close(0)
        # Both sidecars still move bytes correctly.
        pb, db = p.allocate(3), d.allocate(3)
        p.fill("post-fuzz", pb)
        d.wipe(db)
        p.client.hold("post-fuzz", pb)
        d.client.recv("post-fuzz", db, remote_of(p, pb))
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
        assert not got.failed, got.failed
        assert d.verify("post-fuzz", db)
        assert sent["n"] >= 1000
    finally:
        p.close()
        d.close()


def test_oversized_message_is_refused(sidecars: SidecarFactory) -> None:
    ds = sidecars.start("big-msg")
    c = SyntheticEngine(make_layout(layers=1, num_blocks=8, heads=1, head_dim=8), ds.endpoint)
    try:
        c.client.ping(60)
        c.client.send_raw(b"\x00" * (20 << 20))
        err = wait_for(c.client, lambda a: bool(a.errors), timeout=20)
        assert err.errors[0].code == ErrorCode.MALFORMED
        assert "too large" in err.errors[0].message
        assert c.client.ping(5).engine_id == "big-msg"
    finally:
        c.close()


def test_a_deeply_nested_message_is_refused_and_the_sidecar_keeps_serving(sidecars: SidecarFactory) -> None:
    """5,000 nested msgpack arrays used to end the sidecar (RecursionError out of the engine
    loop, exit 1): now a typed error on the engine socket, a refusal on the handshake
    listener, and both keep answering."""
    ds = sidecars.start("deep-msg")
    c = SyntheticEngine(make_layout(layers=1, num_blocks=8, heads=1, head_dim=8), ds.endpoint)
    deep = b"\x91" * 5000 + b"\xc0"
    try:
        c.start()
        reg = c.registered
        assert reg is not None
        c.client.send_raw(deep)
        err = wait_for(c.client, lambda a: bool(a.errors), timeout=20)
        assert err.errors[0].code == ErrorCode.MALFORMED
        with handshake_dealer(zmq.Context.instance(), "127.0.0.1", reg.handshake_port) as hs:
            hs.send(deep)
            assert hs.poll(5000), "the handshake listener stopped answering"
            assert b"bad hello" in hs.recv_multipart()[0]
        assert ds.proc.poll() is None
        assert c.client.ping(5).engine_id == "deep-msg"
    finally:
        c.close()


def _engine_that_dies(endpoint: str, conn: object) -> None:
    eng = SyntheticEngine(make_layout(layers=2, num_blocks=16, heads=2, head_dim=16), endpoint)
    eng.start()
    conn.send(os.getpid())  # type: ignore[attr-defined]
    os._exit(0)  # no clean-up, like a crash


def test_engine_death_drops_its_registration(sidecars: SidecarFactory) -> None:
    """An engine that dies holding nothing: its rank goes at once. (One that dies holding
    blocks keeps them readable until their leases end: tests/test_memory_ownership.py.)"""
    import multiprocessing as mp

    import grpc

    from kvxfer.control.v1 import control_pb2 as pb
    from kvxfer.control.v1 import control_pb2_grpc as pb_grpc

    sc = sidecars.start("death", "--engine-check-s", "0.2")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_engine_that_dies, args=(sc.endpoint, there))
    proc.start()
    assert here.poll(60)
    here.recv()
    proc.join(10)
    ctl = pb_grpc.ControlStub(grpc.insecure_channel(sc.control))
    deadline = time.monotonic() + 10
    while True:
        st = ctl.GetStatus(pb.GetStatusRequest(), timeout=5)
        if not st.ranks and not st.leases:
            break
        assert time.monotonic() < deadline, f"still registered: {st.ranks} {st.leases}"
        time.sleep(0.1)
    assert "engine process" in sc.log()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"kvxfer-{proc.pid}-")]  # cleaned up


def test_a_read_stopped_past_its_deadline_posts_nothing_more(sidecars: SidecarFactory) -> None:
    """A decode sidecar stopped (SIGSTOP, a frozen cgroup) in the middle of a read, past its
    deadline: the engine may have given up on those blocks by then, so after it resumes the
    chunk it was copying may finish, but no further chunk is posted; the read fails."""
    import numpy as np

    # 8 chunks in flight; the deadline, not the stall guard, is what this test judges (under load
    # the guard, seeing the prefill silent across the stop, fired first: tests/test_stalls.py has it)
    ds = sidecars.start("stop-d", "--chunk-mib", "2", "--handshake-timeout-s", "2", "--peer-stall-s", "0")
    ps = sidecars.start("stop-p")
    d, p = SyntheticEngine(BIG, ds.endpoint, seed=2), SyntheticEngine(BIG, ps.endpoint, seed=1)
    d.start()
    p.start()
    try:
        assert d.kv is not None
        chunk = 2 << 20
        for attempt in range(3):  # the stop must land while the read runs
            pb, db = p.allocate(256), d.allocate(256)  # 512 MiB in 2 MiB chunks
            p.fill(f"stopped-{attempt}", pb)
            want = p.kv.blocks()[:, :, np.asarray(pb), :] if p.kv is not None else None
            assert want is not None
            p.client.hold(f"stopped-{attempt}", pb)
            d.client.recv("warm", [], remote_of(p, []))  # handshake first
            wait_for(d.client, lambda a: bool(a.done))
            d.client.recv(f"stopped-{attempt}", db, remote_of(p, pb), deadline_s=1.0)
            time.sleep(0.03)
            os.kill(ds.proc.pid, signal.SIGSTOP)
            try:
                landed = int((d.kv.blocks()[:, :, np.asarray(db), :] == want).sum())
                time.sleep(1.5)  # past the deadline while stopped
            finally:
                os.kill(ds.proc.pid, signal.SIGCONT)
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
            after = int((d.kv.blocks()[:, :, np.asarray(db), :] == want).sum())
            d.free(db)
            p.free(pb)
            if got.failed:
                assert got.failed[0].code == ErrorCode.DEADLINE, got.failed
                # at most the rest of the chunk that was being copied when it stopped
                late = (after - landed) / chunk
                assert late <= 1, f"{late:.2f} chunks landed after the deadline"
                return
        raise AssertionError("the read always finished before the stop")
    finally:
        d.close()
        p.close()


def test_a_lease_over_while_its_sidecar_was_stopped_is_never_renewed(sidecars: SidecarFactory) -> None:
    """A prefill sidecar stopped past a lease's end: its engine may free those blocks (a
    silent sidecar's holds are freed at their deadline), so a claim that is answered after it
    resumes must find the lease over, not extend it (even before its expiry timer has run)."""
    ds = sidecars.start("lstop-d", "--handshake-timeout-s", "5", "--peer-stall-s", "0")  # (the lease, not
    # the stall, is what this test judges: tests/test_stalls.py has those)
    ps = sidecars.start("lstop-p", metrics_port=free_port())
    d, p = SyntheticEngine(BIG, ds.endpoint, seed=2), SyntheticEngine(BIG, ps.endpoint, seed=1)
    d.start()
    p.start()
    try:
        d.client.recv("warm", [], remote_of(p, []))  # handshake first
        wait_for(d.client, lambda a: bool(a.done))
        pb, db = p.allocate(2), d.allocate(2)
        p.fill("late", pb)
        p.client.hold("late", pb, lease_s=1.0)
        end = time.monotonic() + 10
        while ps.scrape().get("kvxfer_held_leases", 0) < 1:  # the hold is in before the stop
            assert time.monotonic() < end, "the hold never arrived"
            time.sleep(0.01)
        os.kill(ps.proc.pid, signal.SIGSTOP)
        try:
            d.client.recv("late", db, remote_of(p, pb), deadline_s=20)  # its claim waits in the socket
            time.sleep(2.0)  # the lease ran out meanwhile
        finally:
            os.kill(ps.proc.pid, signal.SIGCONT)
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=15)
        assert not got.done, "a lease that ran out while its sidecar was stopped was renewed and read"
        assert got.failed[0].code == ErrorCode.EXPIRED, got.failed
    finally:
        d.close()
        p.close()


def test_connector_worker_survives_a_sidecar_restart(sidecars: SidecarFactory) -> None:
    import torch

    from kvxfer.connector.settings import ConnectorSettings
    from kvxfer.connector.worker import CacheShape, WorkerSide

    sc = sidecars.start("restart")
    ws = WorkerSide(ConnectorSettings(sidecar=sc.endpoint, heartbeat_s=0.1), 0, 1, "cpu")
    ctx = ws.mem_pool_context()
    assert ctx is not None
    with ctx:
        kv = {"l0": torch.zeros(2, 8, 16, 8, 64, dtype=torch.float16)}  # above min_bytes
    try:
        first = ws.register_kv_caches(kv, CacheShape(8, 16, 8, 8, 64, False))
        far = time.monotonic() + 600
        ws.bind({"in-flight": ([1, 2], far)}, {"held": far})
        os.kill(sc.proc.pid, signal.SIGKILL)
        sc.proc.wait()
        sidecars.start("restart")  # same socket path, new process
        sending, recving, failed = set(), set(), set()
        deadline = time.monotonic() + 60
        while "in-flight" not in failed or "held" not in sending:
            assert time.monotonic() < deadline, "the restart was not noticed"
            res = ws.get_transfer_results()
            sending |= res.finished_sending
            recving |= res.finished_recving
            failed |= res.failed_recving
            time.sleep(0.05)
        assert "in-flight" in recving  # failed loads are also finished, so vLLM stops waiting
        assert ws.take_invalid_block_ids() == {1, 2}
        while ws.registered is None or ws.registered.agent_name == first.agent_name:
            assert time.monotonic() < deadline, "never re-registered with the new sidecar"
            ws.get_transfer_results()  # the registration's answer comes back through poll
            time.sleep(0.05)
    finally:
        ws.shutdown()


def test_what_an_engine_gave_up_at_a_sidecar_restart_is_never_read_or_held(sidecars: SidecarFactory) -> None:
    """The scheduler sends Recv and Hold on its own socket; its worker notices a sidecar
    restart on another, fails the loads (vLLM recomputes into their blocks), frees the held
    blocks and registers again. If such a Recv or Hold reaches the new sidecar after that
    registration, it must be refused: a read would overwrite the recomputed KV (real vLLM
    decoded wrong tokens from exactly this), a hold would let a decode read reused blocks."""
    import torch

    from kvxfer.client import SidecarClient
    from kvxfer.connector.settings import ConnectorSettings
    from kvxfer.connector.worker import CacheShape, WorkerSide

    shape = CacheShape(8, 16, 8, 8, 64, False)
    args = ("--handshake-timeout-s", "2")
    ps, ds = sidecars.start("abandon-p", *args), sidecars.start("abandon-d", *args)
    wp = WorkerSide(ConnectorSettings(sidecar=ps.endpoint, heartbeat_s=0.1), 0, 1, "cpu")
    wd = WorkerSide(ConnectorSettings(sidecar=ds.endpoint, heartbeat_s=0.1), 0, 1, "cpu")
    clients: list[SidecarClient] = []
    try:
        kv: dict[str, torch.Tensor] = {}
        for name, w in (("p", wp), ("d", wd)):
            ctx = w.mem_pool_context()
            assert ctx is not None
            with ctx:  # [K/V, blocks, block_size, heads, head_dim], in the sidecar's pool
                kv[name] = torch.zeros(2, 8, 16, 8, 64, dtype=torch.float16)
            w.register_kv_caches({"l0": kv[name]}, shape)
        kv["p"].copy_(torch.randn(kv["p"].shape, generator=torch.Generator().manual_seed(7)))
        far = time.monotonic() + 600
        # Each scheduler posted work (its Hold / Recv still on the way) and then both sidecars died.
        wp.bind({}, {"h1": far})
        wd.bind({"r1": ([1, 2], far)}, {})
        for sc in (ps, ds):
            os.kill(sc.proc.pid, signal.SIGKILL)
            sc.proc.wait()
        ps, ds = sidecars.start("abandon-p", *args), sidecars.start("abandon-d", *args)  # same sockets
        first = (wp.registered, wd.registered)
        freed: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + 60
        while wp.registered is first[0] or wd.registered is first[1] or {"h1", "r1"} - freed - failed:
            assert time.monotonic() < deadline, "the restarts were not noticed"
            freed |= wp.get_transfer_results().finished_sending
            failed |= wd.get_transfer_results().failed_recving
            time.sleep(0.05)
        assert kv["d"][:, 1:3].abs().sum() == 0
        # Now what was on the schedulers' sockets arrives, and a hold and a load posted after.
        prefill, decode = SidecarClient(ps.endpoint), SidecarClient(ds.endpoint)
        clients += [prefill, decode]
        prefill.hold("h1", [1, 2], lease_s=60, expires_unix=time.time() + 60)
        prefill.hold("h2", [3, 4], lease_s=60, expires_unix=time.time() + 60)
        prefill.hold("r1", [6, 7], lease_s=60, expires_unix=time.time() + 60)  # still there for r1
        refused = wait_for(prefill, lambda a: bool(a.errors), timeout=5).errors
        assert [(e.req_id, e.code) for e in refused] == [("h1", ErrorCode.EXPIRED)], refused
        reg = wp.registered
        assert reg is not None
        for req, local, remote in (("r1", [1, 2], [6, 7]), ("h2", [5, 6], [3, 4])):
            where = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, remote)
            decode.recv(req, local, where, expires_unix=time.time() + 60)
        got = wait_for(decode, lambda a: len(a.done) + len(a.failed) >= 2)
        assert [f.req_id for f in got.failed] == ["r1"], got
        assert [d.req_id for d in got.done] == ["h2"], got
        assert got.failed[0].code == ErrorCode.EXPIRED
        assert "restarted" in got.failed[0].reason
        assert kv["d"][:, 1:3].abs().sum() == 0, "an abandoned load was read into recomputed blocks"
        assert torch.equal(kv["d"][:, 5:7], kv["p"][:, 3:5])  # the new sidecars move what they should
    finally:
        for c in clients:
            c.close()
        wd.shutdown()
        wp.shutdown()


def test_re_registration_never_blocks_an_engine_step(tmp_path: os.PathLike[str]) -> None:
    """A restarted sidecar that answers heartbeats but not (yet) the registration: every
    get_transfer_results still returns at once (the old code waited sidecar_timeout_s)."""
    from tests.test_rejoin import Answer, registered, stand_in_sidecar

    def answer(n: int) -> Answer:  # instance "one" registers; then "two" only answers pings
        return (0.0, registered("one") if n == 1 else None)

    with stand_in_sidecar(tmp_path, answer) as (ws, registrations, pools):
        slowest = 0.0
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            t0 = time.monotonic()
            ws.get_transfer_results()
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.01)
        assert len(registrations) >= 2  # the restart was noticed and re-registration sent
        assert slowest < 0.5, slowest  # never waited for the answer inside the step
        assert pools.adopted == 1  # the "restarted" sidecar got the KV pool back first


def test_shared_secret_handshake(sidecars: SidecarFactory, tmp_path: os.PathLike[str]) -> None:
    from kvxfer.protocol import PROTOCOL_VERSION, Challenge, Hello, Refused, handshake_reply_decoder

    good, bad = os.path.join(tmp_path, "good"), os.path.join(tmp_path, "bad")
    for path, secret in ((good, "correct horse"), (bad, "battery staple")):
        with open(path, "w") as fh:
            fh.write(secret + "\n")
    lay = make_layout(layers=2, num_blocks=16, heads=2, head_dim=16)
    ps = sidecars.start("auth-p", "--secret-file", good)
    engines = []
    try:
        p = SyntheticEngine(lay, ps.endpoint, seed=1)
        engines.append(p)
        p.start()
        reg = p.registered
        assert reg is not None
        results = {}
        quick = ("--handshake-timeout-s", "2")  # (a peer without the secret gets no answer: 2 s, not 5)
        for name, args in (("auth-ok", ("--secret-file", good)), ("auth-none", quick),
                           ("auth-wrong", ("--secret-file", bad, *quick))):
            d = SyntheticEngine(lay, sidecars.start(name, *args).endpoint, seed=2)
            engines.append(d)
            d.start()
            pb, db = p.allocate(2), d.allocate(2)
            p.fill(name, pb)
            p.client.hold(name, pb)
            d.client.recv(name, db, remote_of(p, pb))
            got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
            results[name] = got.failed[0] if got.failed else ("done", d.verify(name, db))
        assert results["auth-ok"] == ("done", True)
        # The listener is a CurveZMQ server keyed by the secret: a peer without it, or with
        # another, gets no answer at all (and the reason says what that may mean).
        for name in ("auth-none", "auth-wrong"):
            assert results[name].code == ErrorCode.HANDSHAKE_FAILED, results[name]
            assert "secret" in results[name].reason, results[name]
        # An outsider on the port speaking plain ZMQ gets nothing, NIXL metadata least of all.
        with zmq.Context.instance().socket(zmq.DEALER) as s:
            s.setsockopt(zmq.SNDTIMEO, 5000)  # a send that cannot queue fails here, never hangs
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{reg.handshake_port}")
            # (the listener drops a connection whose CURVE handshake fails, and libzmq then has
            # no pipe to queue on until it reconnects: a send may time out, which is nothing too;
            # CI saw it once on a loaded machine)
            with contextlib.suppress(zmq.Again):
                s.send(encode_hello(Hello(version=PROTOCOL_VERSION, compat_hash="x", engine_id="x",
                                          agent_name="x")))
            assert not s.poll(1500)
        # Without encryption the protocol itself refuses: a Hello without the secret's MAC is
        # answered by a challenge, a forged answer to it by a refusal, never by metadata.
        open_ps = sidecars.start("auth-plain", "--secret-file", good, "--handshake-encryption", "none")
        q = SyntheticEngine(lay, open_ps.endpoint, seed=3)
        engines.append(q)
        q.start()
        assert q.registered is not None
        with zmq.Context.instance().socket(zmq.DEALER) as s:
            s.setsockopt(zmq.SNDTIMEO, 5000)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{q.registered.handshake_port}")
            hello = Hello(version=PROTOCOL_VERSION, compat_hash="x", engine_id="x", agent_name="x")
            s.send(encode_hello(hello))
            assert s.poll(5000)
            frames = s.recv_multipart()
            challenge = handshake_reply_decoder.decode(frames[0])
            assert isinstance(challenge, Challenge), challenge
            forged = msgspec.structs.replace(hello, nonce="n", challenge=challenge.nonce,
                                             target=challenge.agent_name, mac="00" * 32)
            s.send(encode_hello(forged))
            assert s.poll(5000)
            frames = s.recv_multipart()
        assert len(frames) == 1
        reply = handshake_reply_decoder.decode(frames[0])
        assert isinstance(reply, Refused)
        assert reply.code == ErrorCode.UNAUTHORIZED
    finally:
        for e in engines:
            e.close()


def encode_hello(hello: object) -> bytes:
    from kvxfer.protocol import encode

    return encode(hello)  # type: ignore[arg-type]


def test_worker_leaves_overdue_loads_to_a_live_sidecar_and_fails_them_when_it_falls_silent(
    sidecars: SidecarFactory,
) -> None:
    """The engine-side deadline is a safety net for a dead or wedged sidecar. While the
    sidecar answers heartbeats it decides (a failed read may be settling: its chunks could
    still write), up to settle_s past the deadline; once it falls silent (SIGSTOP here) the
    worker fails the load after grace_s."""
    import torch

    from kvxfer.connector.settings import ConnectorSettings
    from kvxfer.connector.worker import CacheShape, WorkerSide

    sc = sidecars.start("silent")
    settings = ConnectorSettings(sidecar=sc.endpoint, heartbeat_s=0.1, grace_s=1.0, settle_s=4.0)
    ws = WorkerSide(settings, 0, 1, "cpu")
    ctx = ws.mem_pool_context()
    assert ctx is not None
    with ctx:
        kv = {"l0": torch.zeros(2, 8, 16, 8, 64, dtype=torch.float16)}

    def failed_after(req_id: str, blocks: list[int], deadline_in: float) -> float:
        t0 = time.monotonic()
        ws.bind({req_id: (blocks, t0 + deadline_in)}, {})
        while True:
            res = ws.get_transfer_results()
            if req_id in res.failed_recving:
                assert req_id in res.finished_recving
                return time.monotonic() - t0
            assert time.monotonic() - t0 < 30, "never failed"
            time.sleep(0.02)

    try:
        ws.register_kv_caches(kv, CacheShape(8, 16, 8, 8, 64, False))
        alive = failed_after("alive", [1], 0.2)
        assert 0.2 + 4.0 <= alive < 0.2 + 4.0 + 1.0, alive  # deadline + settle_s, not + grace
        os.kill(sc.proc.pid, signal.SIGSTOP)
        try:
            silent = failed_after("silent", [2], 0.2)
        finally:
            os.kill(sc.proc.pid, signal.SIGCONT)
        assert 0.8 <= silent < 2.5, silent  # grace_s (1) after the last pong (0.1 s cadence)
        assert ws.take_invalid_block_ids() == {1, 2}
    finally:
        ws.shutdown()


def test_a_read_that_cannot_settle_exits_3_at_once() -> None:
    """A read whose chunks never stop (its target frozen: in UCX peer mode a READ completes
    only when the target progresses) makes the decode sidecar exit 3 right after
    --settle-timeout-s, with the reason in its log: no graceful teardown, which could block
    on the frozen peer's endpoints or on open handshake sockets."""
    with SidecarFactory() as f:
        ps = f.start("stuck-p", "--handshake-timeout-s", "2")
        # (--peer-stall-s 0: the last resort, for a read that settles no other way; UCX_TLS
        # without CMA: CMA reads a stopped process's memory, so over CMA whether this READ
        # settles depends on whether the endpoint's flush waits for the frozen target (it does
        # after a notification, unless a fence took that wait); over TCP the target serves
        # every GET itself, and a frozen one serves none)
        ds = f.start("stuck-d", "--handshake-timeout-s", "2", "--settle-timeout-s", "1",
                     "--peer-stall-s", "0", env={"UCX_TLS": "^cma"})
        lay = make_layout(layers=2, num_blocks=32, heads=2, head_dim=64)
        p, d = SyntheticEngine(lay, ps.endpoint, seed=1), SyntheticEngine(lay, ds.endpoint, seed=2)
        try:
            reg = p.start()
            d.start()
            where = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, [1, 2])
            p.client.hold("warm", [1, 2])
            d.client.recv("warm", [3, 4], where)
            assert d.client.wait_until(lambda a: bool(a.done or a.failed), 10).done
            # a handshake that will never be answered stays open in the decode sidecar
            silent = socket.socket()
            silent.bind(("127.0.0.1", 0))
            silent.listen(1)
            d.client.recv("hangs", [5], RemoteBlocks("x", "127.0.0.1", silent.getsockname()[1], [1]),
                          deadline_s=60)
            p.client.hold("stuck", list(range(5, 29)))
            os.kill(ps.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                blocks = list(range(5, 29))
                d.client.recv("stuck", blocks, RemoteBlocks(reg.engine_id, reg.handshake_host,
                                                            reg.handshake_port, blocks), deadline_s=1.0)
                code = ds.proc.wait(30)
                took = time.monotonic() - t0
            finally:
                os.kill(ps.proc.pid, signal.SIGCONT)
                silent.close()  # (even when the wait failed: left open, a later test's gc warns of it)
            assert code == 3
            assert 2.0 <= took < 3.5, took  # deadline 1 s + settle 1 s, then out
            assert "exiting so that no late write can land" in ds.log()
        finally:
            p.close()
            d.close()


def test_read_stuck_exits_without_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler leaves through os._exit(3) at once, never through the graceful stop."""
    from kvxfer.config import Config
    from kvxfer.sidecar import app as sc_mod
    from kvxfer.sidecar.nixl_types import ReadStuck

    calls: list[int] = []

    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        calls.append(code)
        raise Exited

    monkeypatch.setattr(sc_mod.os, "_exit", fake_exit)
    sidecar = sc_mod.Sidecar(Config(engine_socket="ipc:///tmp/kvx-stuck-unit.sock"))
    try:
        with pytest.raises(Exited):
            sidecar._read_stuck(ReadStuck("r", "peer", 21.0))
        assert calls == [3]
        assert not sidecar._stop.is_set()  # no graceful stop was started
    finally:
        sidecar._close()


def test_a_gpu_sidecar_sets_its_ucx_options_before_ucx_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX reads its global options (the memory-type cache among them) once, when libucs is
    loaded, and the build-info metric loads it while the sidecar is built: set later (as the
    NIXL thread did), ``UCX_MEMTYPE_CACHE=n`` came too late for IPC-imported VRAM (taken for
    host memory, its registration fails): the likely cause of the ipc failure on the first GPU
    run (2026-11-26), which the next GPU run must confirm."""
    import kvxfer.observe as observe_mod
    import kvxfer.sidecar.app as sc_mod
    from kvxfer.config import Config

    env = dict(os.environ)
    for k in ("UCX_MEMTYPE_CACHE", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"):
        env.pop(k, None)
    monkeypatch.setattr(os, "environ", env)
    seen: list[tuple[str | None, str | None]] = []
    real = observe_mod.build_info

    def spy() -> dict[str, str]:
        seen.append((os.environ.get("UCX_MEMTYPE_CACHE"), os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")))
        return real()

    monkeypatch.setattr(observe_mod, "build_info", spy)
    sidecar = sc_mod.Sidecar(Config(engine_socket="ipc:///tmp/kvx-cuda-env-unit.sock", cuda="on"))
    try:
        assert seen == [("n", "y")]
    finally:
        sidecar._close()
