"""Two real ``kvxfer serve`` processes, this process as both engines, real NIXL reads."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from urllib.parse import urlparse

import msgspec
import pytest
import zmq

from kvxfer import hostkey
from kvxfer.auth import sign_hello
from kvxfer.client import Drained, RemoteBlocks, SidecarClient
from kvxfer.errors import ErrorCode
from kvxfer.protocol import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    PoolMemory,
    Refused,
    ShmMemory,
    encode,
    handshake_reply_decoder,
)
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, handshake_dealer
from tests.conftest import PD


def wait_for(client: SidecarClient, pred: Callable[[Drained], bool], timeout: float = 20.0) -> Drained:
    """Collect events until ``pred`` holds for everything collected so far."""
    acc = client.wait_until(pred, timeout)
    if not pred(acc):
        raise AssertionError(f"timed out; got {acc}")
    return acc


def remote(pd: PD, blocks: list[int], **kw: object) -> RemoteBlocks:
    reg = pd.p.registered
    assert reg is not None
    fields = {"engine_id": reg.engine_id, "host": reg.handshake_host, "port": reg.handshake_port,
              "block_ids": blocks} | kw
    return RemoteBlocks(**fields)  # type: ignore[arg-type]


def test_engine_socket_is_private(pd: PD) -> None:
    path = urlparse(pd.prefill.endpoint).path or pd.prefill.endpoint[len("ipc://"):]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_blocks_move_and_release_only_after_read(pd: PD) -> None:
    pb, db = pd.p.allocate(5), pd.d.allocate(5)
    pd.p.fill("rel-1", pb)
    pd.d.wipe(db)
    pd.p.client.hold("rel-1", pb)
    # Held, nobody has read: no release may arrive.
    assert not pd.p.client.wait(0.3).released
    pd.d.client.recv("rel-1", db, remote(pd, pb))
    got = wait_for(pd.d.client, lambda a: bool(a.done or a.failed))
    assert not got.failed, got.failed
    assert got.done[0].nbytes == 5 * 4 * 2 * 16 * 4 * 64 * 2
    assert pd.d.verify("rel-1", db)
    rel = wait_for(pd.p.client, lambda a: bool(a.released))
    assert [(r.req_id, r.reason, r.reads) for r in rel.released] == [("rel-1", "read", 1)]
    pd.p.free(pb)
    pd.d.free(db)


HOT_PATH = ["sidecar", "accepted", "planned", "nixl_thread", "planned_descs", "posted", "claim_sent",
            "landed", "loop", "claimed", "reply"]


def test_a_traced_receive_reports_every_hop_in_order(pd: PD) -> None:
    """``Recv(trace=True)``: the Done carries each hop's time, in order, between the moment
    the engine sent the Recv and the moment it got the Done; untraced receives carry none.
    The first read may handshake (a task awaits the peer); the next ones take the hot path,
    planned and posted in the call that took the Recv."""
    pb, db = pd.p.allocate(2), pd.d.allocate(2)
    pd.p.fill("tr", pb)
    for i in range(4):
        pd.d.wipe(db)
        pd.p.client.hold(f"tr-{i}", pb)
        t0 = time.monotonic_ns()
        pd.d.client.recv(f"tr-{i}", db, remote(pd, pb), trace=i < 3)
        got = wait_for(pd.d.client, lambda a: bool(a.done or a.failed))
        t1 = time.monotonic_ns()
        assert not got.failed, got.failed
        assert pd.d.verify("tr", db)
        wait_for(pd.p.client, lambda a: bool(a.released))
        done = got.done[0]
        if i == 3:
            assert done.trace is None
            continue
        assert done.trace is not None
        hops = [h for h, _ in done.trace]
        times = [t for _, t in done.trace]
        assert times == sorted(times), done.trace
        assert t0 <= times[0], done.trace
        assert times[-1] <= t1, done.trace
        # the claim's answer and the landing race each other, and the claim goes out after the
        # post returns (a read handed to the NIXL thread is planned and posted there meanwhile;
        # a small one proved inside the post sends none); every other hop is in order
        expect = HOT_PATH[:2] + ["handshaked"] + HOT_PATH[2:] if "handshaked" in hops else HOT_PATH
        assert i == 0 or "handshaked" not in hops, hops  # (other tests may have handshaked already)
        racy = {"claimed", "landed", "claim_sent"}
        # (a claim that reaches the prefill sidecar before its Hold is asked again: the
        # repeated "claim_sent" hops are that retry; the order is the first of each)
        firsts = list(dict.fromkeys(hops))
        assert [h for h in firsts if h not in racy] == [h for h in expect if h not in racy], hops
        assert hops.index("landed") > hops.index("posted")
        assert hops.index("claimed") > hops.index("claim_sent")
    pd.p.free(pb)
    pd.d.free(db)


def test_lease_expires_without_read(pd: PD) -> None:
    pb = pd.p.allocate(2)
    t0 = time.monotonic()
    pd.p.client.hold("lease-1", pb, lease_s=0.4)
    rel = wait_for(pd.p.client, lambda a: bool(a.released), timeout=5)
    assert time.monotonic() - t0 >= 0.4
    assert [(r.req_id, r.reason) for r in rel.released] == [("lease-1", "expired")]
    pd.p.free(pb)


def test_release_by_engine_abort(pd: PD) -> None:
    pb = pd.p.allocate(1)
    pd.p.client.hold("abort-1", pb)
    pd.p.client.release("abort-1")
    rel = wait_for(pd.p.client, lambda a: bool(a.released))
    assert [(r.req_id, r.reason) for r in rel.released] == [("abort-1", "aborted")]
    pd.p.client.release("abort-1")
    err = wait_for(pd.p.client, lambda a: bool(a.errors))
    assert err.errors[0].code == ErrorCode.UNKNOWN_REQUEST
    pd.p.free(pb)


def test_duplicate_hold_is_refused(pd: PD) -> None:
    pb = pd.p.allocate(1)
    pd.p.client.hold("dup-1", pb)
    pd.p.client.hold("dup-1", pb)
    err = wait_for(pd.p.client, lambda a: bool(a.errors))
    assert (err.errors[0].code, err.errors[0].req_id) == (ErrorCode.DUPLICATE_REQUEST, "dup-1")
    pd.p.client.release("dup-1")
    wait_for(pd.p.client, lambda a: bool(a.released))
    pd.p.free(pb)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"\xc1garbage", ErrorCode.MALFORMED),
        (msgspec.msgpack.encode(["launch_missiles", 1]), ErrorCode.UNKNOWN_MESSAGE),
        (msgspec.msgpack.encode(["hold", "r", ["not-an-int"]]), ErrorCode.MALFORMED),
        (msgspec.msgpack.encode(["recv", "r", [1], "P", "h", 0, [1]]), ErrorCode.MALFORMED),
    ],
)
def test_malformed_engine_messages_get_typed_errors(pd: PD, body: bytes, code: str) -> None:
    pd.d.client.send_raw(body)
    err = wait_for(pd.d.client, lambda a: bool(a.errors))
    assert err.errors[0].code == code
    assert pd.d.client.ping(2).engine_id == "decode"  # still serving


def test_multi_frame_message_is_refused(pd: PD) -> None:
    pd.d.client.send_raw(b"a", b"b")
    err = wait_for(pd.d.client, lambda a: bool(a.errors))
    assert err.errors[0].code == ErrorCode.MALFORMED
    assert pd.d.client.ping(2).seq >= 0


def test_out_of_range_blocks(pd: PD) -> None:
    n = pd.p.layout.num_blocks
    pd.p.client.hold("oor-hold", [1, n])
    err = wait_for(pd.p.client, lambda a: bool(a.errors))
    assert (err.errors[0].code, err.errors[0].req_id) == (ErrorCode.BLOCK_OUT_OF_RANGE, "oor-hold")

    pd.d.client.recv("oor-local", [1, n + 5], remote(pd, [1, 2]))
    got = wait_for(pd.d.client, lambda a: bool(a.failed))
    assert (got.failed[0].code, got.failed[0].block_ids) == (ErrorCode.BLOCK_OUT_OF_RANGE, [1, n + 5])

    pd.d.client.recv("oor-remote", [3, 4], remote(pd, [1, n]))
    got = wait_for(pd.d.client, lambda a: bool(a.failed))
    assert (got.failed[0].code, got.failed[0].block_ids) == (ErrorCode.BLOCK_OUT_OF_RANGE, [3, 4])


def test_unknown_peer_engine_id(pd: PD) -> None:
    pd.d.client.recv("who-1", [3], remote(pd, [1], engine_id="someone-else"))
    got = wait_for(pd.d.client, lambda a: bool(a.failed))
    assert got.failed[0].code == ErrorCode.UNKNOWN_PEER
    assert "someone-else" in got.failed[0].reason


def test_unreachable_peer_fails_within_handshake_timeout(pd: PD) -> None:
    with zmq.Context.instance().socket(zmq.ROUTER) as silent:  # accepts, never answers
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        t0 = time.monotonic()
        pd.d.client.recv("dead-1", [3, 4], remote(pd, [1, 2], port=port))
        got = wait_for(pd.d.client, lambda a: bool(a.failed), timeout=10)
    assert got.failed[0].code == ErrorCode.HANDSHAKE_FAILED
    assert got.failed[0].block_ids == [3, 4]
    assert time.monotonic() - t0 < 5


def test_mismatched_block_counts_are_refused(pd: PD) -> None:
    pd.d.client.recv("ratio-1", [3, 4], remote(pd, [1]))
    got = wait_for(pd.d.client, lambda a: bool(a.failed))
    assert got.failed[0].code == ErrorCode.INCOMPATIBLE


def _hello(port: int, body: bytes | Hello) -> Refused:
    """The listener's refusal of ``body``; a Hello is signed first, answering its challenge
    with this user's host key (a loopback sidecar with no secret challenges every Hello)."""
    with handshake_dealer(zmq.Context.instance(), "127.0.0.1", port) as s:
        s.send(body if isinstance(body, bytes) else encode(body))
        assert s.poll(5000), "handshake listener did not answer"
        reply = handshake_reply_decoder.decode(s.recv_multipart()[0])
        if isinstance(reply, Challenge) and isinstance(body, Hello):
            s.send(encode(sign_hello(hostkey.load(hostkey.default_path()), body, reply.nonce,
                                     reply.agent_name)))
            assert s.poll(5000), "handshake listener did not answer"
            reply = handshake_reply_decoder.decode(s.recv_multipart()[0])
    assert isinstance(reply, Refused), reply
    return reply


def test_handshake_rejects_bad_input(pd: PD) -> None:
    reg = pd.p.registered
    assert reg is not None
    assert _hello(reg.handshake_port, b"\x00\xffnot msgpack").code == ErrorCode.MALFORMED
    old = Hello(version=PROTOCOL_VERSION + 1, compat_hash="x", engine_id="x", agent_name="x")
    refused = _hello(reg.handshake_port, old)
    assert refused.code == ErrorCode.INCOMPATIBLE
    assert "protocol version" in refused.reason
    wrong = Hello(version=PROTOCOL_VERSION, compat_hash="0" * 16, engine_id="x", agent_name="x")
    assert _hello(reg.handshake_port, wrong).code == ErrorCode.INCOMPATIBLE
    assert pd.p.client.ping(2).engine_id == "prefill"


def test_incompatible_layout_refused_at_handshake(sidecars: SidecarFactory, pd: PD) -> None:
    other = sidecars.start("decode-hd32")
    eng = SyntheticEngine(make_layout(layers=4, num_blocks=16, heads=4, head_dim=32), other.endpoint)
    try:
        eng.start()
        eng.client.recv("incompat-1", [1], remote(pd, [1]))
        got = wait_for(eng.client, lambda a: bool(a.failed))
        assert got.failed[0].code == ErrorCode.INCOMPATIBLE
        assert "refused the handshake" in got.failed[0].reason
    finally:
        eng.close()


def test_bad_registration_gets_typed_error(sidecars: SidecarFactory) -> None:
    sc = sidecars.start("badreg")
    eng = SyntheticEngine(make_layout(layers=2, num_blocks=8, heads=2, head_dim=16), sc.endpoint)
    try:
        eng.client.ping(60)
        msg = eng.kv.register_message()
        size = msg.memory[0].size
        for ref, says in ((ShmMemory(path="/dev/shm/kvxfer-no-such", size=size), "No such file"),
                          (PoolMemory(pool="f" * 32, size=size), "no pool"),
                          (msgspec.structs.replace(msg.memory[0], size=size * 2), "registration claims")):
            with pytest.raises(Exception, match=f"invalid_memory.*{says}"):
                eng.client.register(msgspec.structs.replace(msg, memory=[ref]), timeout=10)
        too_big = msgspec.structs.replace(
            msg, regions=[msgspec.structs.replace(r, offset=r.offset + (1 << 30)) for r in msg.regions]
        )
        with pytest.raises(Exception, match="invalid_layout"):
            eng.client.register(too_big, timeout=10)
        # Holding before any registration is refused, then a good registration works.
        eng.client.hold("early", [1])
        err = wait_for(eng.client, lambda a: bool(a.errors))
        assert err.errors[0].code == ErrorCode.NOT_REGISTERED
        assert eng.client.register(msg, timeout=10).bytes_registered == eng.kv.nbytes
    finally:
        eng.close()


def test_many_concurrent_requests(pd: PD) -> None:
    reqs = {f"conc-{i}": (pd.p.allocate(2), pd.d.allocate(2)) for i in range(24)}
    for name, (pb, _) in reqs.items():
        pd.p.fill(name, pb)
        pd.p.client.hold(name, pb)
    for name, (pb, db) in reqs.items():
        pd.d.client.recv(name, db, remote(pd, pb))
    got = wait_for(pd.d.client, lambda a: len(a.done) + len(a.failed) >= len(reqs))
    assert not got.failed
    assert all(pd.d.verify(name, db) for name, (_, db) in reqs.items())
    rel = wait_for(pd.p.client, lambda a: len(a.released) >= len(reqs))
    assert {r.req_id for r in rel.released} == set(reqs)
    assert {r.reason for r in rel.released} == {"read"}
    for pb, db in reqs.values():
        pd.p.free(pb)
        pd.d.free(db)


def test_lease_outlives_a_read_in_progress(sidecars: SidecarFactory) -> None:
    """A read that starts before the lease ends keeps the prefill blocks held until it is over."""
    ps = sidecars.start("ext-p")
    ds = sidecars.start("ext-d", "--chunk-mib", "1", "--max-inflight-chunks", "1")
    lay = make_layout(layers=32, num_blocks=200, heads=8, head_dim=128)  # 2 MiB blocks
    p, d = SyntheticEngine(lay, ps.endpoint, seed=1), SyntheticEngine(lay, ds.endpoint, seed=2)
    try:
        p.start()
        d.start()
        reg = p.registered
        assert reg is not None
        rem = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, [])
        d.client.recv("warm", [], rem)  # pay the handshake first
        wait_for(d.client, lambda a: bool(a.done))
        pb, db = p.allocate(190), d.allocate(190)  # 380 MiB in 1 MiB chunks, one at a time
        p.fill("long", pb)
        t0 = time.monotonic()
        p.client.hold("long", pb, lease_s=0.05)
        d.client.recv("long", db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb))
        got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=60)
        took = time.monotonic() - t0
        assert not got.failed, got.failed
        assert d.verify("long", db)
        rel = wait_for(p.client, lambda a: bool(a.released))
        assert [(r.req_id, r.reason) for r in rel.released] == [("long", "read")]
        assert took > 0.05  # the read outlasted the original lease
    finally:
        p.close()
        d.close()


def _rss_shmem_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssShmem:"))


def test_sidecar_maps_engine_memory_with_page_tables_filled(sidecars: SidecarFactory) -> None:
    """The engine's shared KV is mapped populated: no page fault inside the first copies."""
    sc = sidecars.start("populate")
    lay = make_layout(layers=8, num_blocks=128, heads=8, head_dim=128)  # 64 MiB
    eng = SyntheticEngine(lay, sc.endpoint)
    try:
        eng.client.ping(30)
        before = _rss_shmem_kib(sc.proc.pid)
        eng.start()
        mapped = _rss_shmem_kib(sc.proc.pid) - before
        assert mapped * 1024 >= eng.kv.nbytes, (mapped, eng.kv.nbytes)  # untouched by any read yet
    finally:
        eng.close()


def test_requests_that_arrive_after_the_engine_gave_up_are_refused(pd: PD) -> None:
    """A Recv or Hold queued while the sidecar was frozen and delivered after its
    expires_unix: the engine has already recomputed / freed those blocks, so the sidecar
    must not read into them or hold them."""
    pb, db = pd.p.allocate(2), pd.d.allocate(2)
    pd.p.fill("late-1", pb)
    pd.p.client.hold("late-1", pb)
    pd.d.wipe(db)
    pd.d.client.recv("late-1", db, remote(pd, pb), expires_unix=time.time() - 1)
    got = wait_for(pd.d.client, lambda a: bool(a.done or a.failed))
    assert got.failed[0].code == ErrorCode.EXPIRED
    assert not pd.d.verify("late-1", db)  # nothing was read
    pd.p.client.hold("late-2", pd.p.allocate(1), expires_unix=time.time() - 1)
    err = wait_for(pd.p.client, lambda a: bool(a.errors))
    assert (err.errors[0].code, err.errors[0].req_id) == (ErrorCode.EXPIRED, "late-2")
    pd.p.client.release("late-1")
    wait_for(pd.p.client, lambda a: bool(a.released))
    # In time: read as usual, and the read's deadline never outlives expires_unix.
    pd.p.client.hold("late-3", pb)
    pd.d.client.recv("late-3", db, remote(pd, pb), expires_unix=time.time() + 30)
    got = wait_for(pd.d.client, lambda a: bool(a.done or a.failed))
    assert got.done
    wait_for(pd.p.client, lambda a: bool(a.released))


def test_a_read_started_after_the_lease_expired_is_counted_and_reported(pd: PD) -> None:
    """Until the prefill can refuse such a read (#16), it is at least visible: a metric, an
    event and a warning naming the reader."""
    import grpc

    from kvxfer.control.v1 import control_pb2 as pb
    from kvxfer.control.v1 import control_pb2_grpc as pb_grpc

    events = pb_grpc.ControlStub(grpc.insecure_channel(pd.prefill.control)).WatchEvents(
        pb.WatchEventsRequest(kinds=["stray_notice"]), timeout=20)
    pb_, db = pd.p.allocate(1), pd.d.allocate(1)
    pd.p.client.hold("too-late", pb_, lease_s=0.2)
    assert wait_for(pd.p.client, lambda a: bool(a.released)).released[0].reason == "expired"
    pd.d.client.recv("too-late", db, remote(pd, pb_))
    wait_for(pd.d.client, lambda a: bool(a.done or a.failed))
    kinds = set()
    for ev in events:
        kinds.add(ev.code)
        if {"expired_lease", "unknown"} <= kinds:
            break
    events.cancel()
    assert ev.request_id == "too-late"
    assert "after its lease expired" in pd.prefill.log()
    pd.p.free(pb_)
    pd.d.free(db)


def test_a_refused_message_is_named_from_its_header_alone() -> None:
    """16 MiB of empty arrays: naming its kind decoded it whole (1.1 GiB, 3.6 s of the loop)."""
    import time

    from kvxfer.sidecar.engine_server import MAX_MESSAGE, classify_bad_message

    n = MAX_MESSAGE - 16
    body = b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    start = time.monotonic()
    assert classify_bad_message(body) == ErrorCode.MALFORMED
    assert time.monotonic() - start < 0.5
