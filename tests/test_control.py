"""The control plane over real gRPC against a real sidecar pair moving real KV."""

from __future__ import annotations

import asyncio
import filecmp
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvxfer.client import RemoteBlocks
from kvxfer.control.v1 import control_pb2 as pb
from kvxfer.control.v1 import control_pb2_grpc as pb_grpc
from kvxfer.errors import ErrorCode
from kvxfer.protocol import PROTOCOL_VERSION, Unregister, encode
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port
from tests.test_sidecar import wait_for


class Pair:
    def __init__(self, f: SidecarFactory, tag: str) -> None:
        self.ps = f.start(f"{tag}-p", "--role", "prefill", "--handshake-timeout-s", "1",
                          metrics_port=free_port())
        self.ds = f.start(f"{tag}-d", "--role", "decode", "--handshake-timeout-s", "1",
                          metrics_port=free_port())
        lay = make_layout(layers=2, num_blocks=32, heads=2, head_dim=32)
        self.p = SyntheticEngine(lay, self.ps.endpoint, seed=1)
        self.d = SyntheticEngine(lay, self.ds.endpoint, seed=2)
        self.p.start()
        self.d.start()

    def remote(self, blocks: list[int], **kw: object) -> RemoteBlocks:
        reg = self.p.registered
        assert reg is not None
        return RemoteBlocks(**({"engine_id": reg.engine_id, "host": reg.handshake_host,  # type: ignore[arg-type]
                                "port": reg.handshake_port, "block_ids": blocks} | kw))

    def move(self, name: str, n: int = 2) -> list[int]:
        pb_, db = self.p.allocate(n), self.d.allocate(n)
        self.p.fill(name, pb_)
        self.p.client.hold(name, pb_)
        self.d.client.recv(name, db, self.remote(pb_))
        got = wait_for(self.d.client, lambda a: bool(a.done or a.failed))
        assert not got.failed, got.failed
        assert self.d.verify(name, db)
        wait_for(self.p.client, lambda a: bool(a.released))
        return db

    def close(self) -> None:
        self.p.close()
        self.d.close()


@pytest.fixture(scope="module")
def pair(sidecars: SidecarFactory) -> Iterator[Pair]:
    pr = Pair(sidecars, "ctl")
    yield pr
    pr.close()


def stub(sc: SidecarProc) -> pb_grpc.ControlStub:
    return pb_grpc.ControlStub(grpc.insecure_channel(sc.control))


def test_generated_stubs_are_current(tmp_path: os.PathLike[str]) -> None:
    out = str(tmp_path)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={out}",
                    f"--grpc_python_out={out}", f"--pyi_out={out}", "proto/kvxfer/control/v1/control.proto"],
                   check=True)
    for name in ("control_pb2.py", "control_pb2_grpc.py", "control_pb2.pyi"):
        fresh = os.path.join(out, "kvxfer/control/v1", name)
        assert filecmp.cmp(fresh, f"kvxfer/control/v1/{name}", shallow=False), f"{name} is stale: make proto"


def test_health_and_reflection(pair: Pair) -> None:
    ch = grpc.insecure_channel(pair.ps.control)
    health = health_pb2_grpc.HealthStub(ch)
    for service in ("", "liveness", "readiness", "kvxfer.control.v1.Control"):
        got = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert got.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as ei:
        health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    (resp,) = list(refl.ServerReflectionInfo(iter([ask])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"kvxfer.control.v1.Control", "grpc.health.v1.Health"} <= names


def test_status_identity_and_ranks(pair: Pair) -> None:
    st = stub(pair.ps).GetStatus(pb.GetStatusRequest(), timeout=5)
    ident = st.identity
    assert (ident.engine_id, ident.role, ident.protocol_version) == ("ctl-p", "prefill", PROTOCOL_VERSION)
    assert st.identity.nixl_backends == ["UCX"]
    assert st.ready
    assert not st.draining
    (rank,) = st.ranks
    assert (rank.tp_rank, rank.num_layers, rank.num_blocks, rank.mem_type) == (0, 2, 32, "DRAM")
    assert rank.bytes_registered == pair.p.kv.nbytes


def test_connect_peer_prewarms_handshake_and_watch_sees_transfer(pair: Pair) -> None:
    d = stub(pair.ds)
    reg = pair.p.registered
    assert reg is not None
    peer = d.ConnectPeer(pb.ConnectPeerRequest(host=reg.handshake_host, port=reg.handshake_port), timeout=10)
    assert (peer.engine_id, peer.state) == ("ctl-p", "connected")
    assert peer.handshake_ms > 0
    assert [p.endpoint for p in d.ListPeers(pb.ListPeersRequest(), timeout=5).peers] == [peer.endpoint]
    before = d.GetStatus(pb.GetStatusRequest(), timeout=5).totals.handshakes
    assert before == 1

    events: list[pb.Event] = []
    ready = threading.Event()

    def watch() -> None:
        call = stub(pair.ds).WatchEvents(pb.WatchEventsRequest(kinds=["transfer_done"]), timeout=20)
        ready.set()
        for ev in call:
            events.append(ev)
            break

    t = threading.Thread(target=watch)
    t.start()
    ready.wait(5)
    time.sleep(0.3)  # the server registers the subscriber when the stream starts
    pair.move("watched")
    t.join(20)
    assert [(e.kind, e.request_id) for e in events] == [("transfer_done", "watched")]
    assert events[0].bytes > 0
    st = d.GetStatus(pb.GetStatusRequest(), timeout=5)
    assert st.totals.handshakes == before  # the transfer reused the pre-warmed peer
    assert st.totals.transfers_ok >= 1
    assert st.peers[0].reads >= 1


def test_disconnect_peer_forces_a_new_handshake(pair: Pair) -> None:
    d = stub(pair.ds)
    pair.move("pre-disconnect")
    before = d.GetStatus(pb.GetStatusRequest(), timeout=5).totals.handshakes
    assert d.DisconnectPeer(pb.DisconnectPeerRequest(endpoint="ctl-p"), timeout=5).disconnected is True
    assert not d.ListPeers(pb.ListPeersRequest(), timeout=5).peers
    assert d.DisconnectPeer(pb.DisconnectPeerRequest(endpoint="ctl-p"), timeout=5).disconnected is False
    pair.move("post-disconnect")
    assert d.GetStatus(pb.GetStatusRequest(), timeout=5).totals.handshakes == before + 1


def test_list_cancel_and_load_of_a_stuck_transfer(pair: Pair) -> None:
    d = stub(pair.ds)
    with zmq.Context.instance().socket(zmq.ROUTER) as silent:  # accepts, never answers
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        db = pair.d.allocate(3)
        pair.d.client.recv("stuck", db, pair.remote([1, 2, 3], port=port), deadline_s=30)
        deadline = time.monotonic() + 5
        while not d.ListTransfers(pb.ListTransfersRequest(request_id="stuck"), timeout=5).transfers:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        (tr,) = d.ListTransfers(pb.ListTransfersRequest(request_id="stuck"), timeout=5).transfers
        assert (tr.state, tr.num_blocks) == ("handshake", 3)
        load = d.GetLoad(pb.GetLoadRequest(), timeout=5)
        assert (load.queued_requests, load.queued_bytes) == (1, tr.bytes)
        assert d.CancelTransfer(pb.CancelTransferRequest(request_id="stuck"), timeout=5).cancelled == 1
        got = wait_for(pair.d.client, lambda a: bool(a.failed))
    assert (got.failed[0].code, got.failed[0].block_ids) == (ErrorCode.CANCELLED, db)
    assert not d.ListTransfers(pb.ListTransfersRequest(), timeout=5).transfers
    pair.d.free(db)


def test_metrics_show_transfers(pair: Pair) -> None:
    pair.move("metered")
    d, p = pair.ds.scrape(), pair.ps.scrape()
    assert d['kvxfer_transfers_total{result="ok"}'] >= 1
    assert d["kvxfer_transfer_duration_seconds_count"] >= 1
    assert d["kvxfer_transfer_bytes_sum"] > 0
    assert d["kvxfer_transfer_descriptors_count"] >= 1
    assert d['kvxfer_transfer_descriptors_bucket{le="10.0"}'] >= 0
    st = stub(pair.ds).GetStatus(pb.GetStatusRequest(), timeout=5)
    assert d['kvxfer_handshakes_total{result="ok"}'] == st.totals.handshakes  # not one per transfer
    assert d['kvxfer_transfers_total{result="ok"}'] == st.totals.transfers_ok > st.totals.handshakes
    assert d["kvxfer_inflight_transfers"] == 0
    assert p['kvxfer_leases_released_total{reason="read"}'] >= 1
    assert p["kvxfer_ready"] == 1.0
    assert all(":" not in name.split("{")[0] for name in d | p)


def test_status_cli(pair: Pair) -> None:
    pair.move("cli")
    out = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", pair.ds.control],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert "ctl-d" in out.stdout
    assert "SERVING" in out.stdout
    assert "ctl-p" in out.stdout  # the peer table
    assert "transfers ok" in out.stdout
    js = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", pair.ps.control, "--json"],
                        capture_output=True, text=True, timeout=30, check=False)
    assert js.returncode == 0
    d = json.loads(js.stdout)
    assert d["identity"]["engine_id"] == "ctl-p"
    assert d["serving"] is True
    assert int(d["totals"]["leases_released"]) >= 1
    gone = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", "unix:///tmp/kvx-none.ctl",
                           "--timeout", "1"], capture_output=True, text=True, timeout=30, check=False)
    assert gone.returncode == 2
    assert "cannot reach sidecar" in gone.stderr


def test_peers_cli_connect(pair: Pair) -> None:
    reg = pair.p.registered
    assert reg is not None
    endpoint = f"{reg.handshake_host}:{reg.handshake_port}"
    out = subprocess.run([sys.executable, "-m", "kvxfer", "peers", "connect", endpoint,
                          "--target", pair.ds.control, "--json"],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["engine_id"] == "ctl-p"


def test_drain_finishes_work_then_refuses(sidecars: SidecarFactory) -> None:
    pr = Pair(sidecars, "drn")
    try:
        pr.move("before-drain")
        p, d = stub(pr.ps), stub(pr.ds)
        # A hold nobody reads: draining the prefill side waits, then releases it.
        blocks = pr.p.allocate(2)
        pr.p.client.hold("never-read", blocks)
        t0 = time.monotonic()
        res = p.Drain(pb.DrainRequest(timeout_s=0.5), timeout=10)
        assert (res.drained, res.released, res.failed) == (False, 1, 0)
        assert time.monotonic() - t0 >= 0.5
        rel = wait_for(pr.p.client, lambda a: bool(a.released))
        assert [(r.req_id, r.reason) for r in rel.released] == [("never-read", "aborted")]
        pr.p.client.hold("after-drain", blocks)
        err = wait_for(pr.p.client, lambda a: bool(a.errors))
        assert err.errors[0].code == ErrorCode.DRAINING
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(pr.ps.control))
        assert health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        # The decode side has nothing in flight: drained at once; new receives are refused.
        assert d.Drain(pb.DrainRequest(timeout_s=5), timeout=10).drained is True
        pr.d.client.recv("late", [1], pr.remote([1]))
        got = wait_for(pr.d.client, lambda a: bool(a.failed))
        assert got.failed[0].code == ErrorCode.DRAINING
        st = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", pr.ps.control],
                            capture_output=True, text=True, timeout=30, check=False)
        assert st.returncode == 1
        assert "not serving (draining)" in st.stderr
        assert health.Check(health_pb2.HealthCheckRequest(service="engine"), timeout=5).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        # Resume undoes it: health, new holds and a verified transfer again
        out = subprocess.run([sys.executable, "-m", "kvxfer", "resume", "--target", pr.ps.control, "--json"],
                             capture_output=True, text=True, timeout=30, check=False)
        assert json.loads(out.stdout) == {"resumed": True}, out.stderr
        assert d.Resume(pb.ResumeRequest(), timeout=10).resumed is True
        assert d.Resume(pb.ResumeRequest(), timeout=10).resumed is False  # not draining any more
        for service in ("readiness", "engine"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING, service
        pr.move("after-resume")
        assert "drain requested over the control API" in pr.ps.log()
        assert "resume requested over the control API" in pr.ps.log()
    finally:
        pr.close()


def test_engine_health_needs_a_registered_engine(sidecars: SidecarFactory) -> None:
    """'readiness' goes SERVING once the sidecar can take its engine (the engine starts after
    it); 'engine' only while an engine rank is registered."""
    sc = sidecars.start("lonely")
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(sc.control))

    def status(service: str) -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5,
                            wait_for_ready=True).status

    assert status("readiness") == health_pb2.HealthCheckResponse.SERVING
    assert status("engine") == health_pb2.HealthCheckResponse.NOT_SERVING
    text = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", sc.control],
                          capture_output=True, text=True, timeout=30, check=False).stdout
    assert "SERVING (no engine registered yet" in text, text
    eng = SyntheticEngine(make_layout(layers=1, num_blocks=8, heads=1, head_dim=8), sc.endpoint)
    eng.start()
    deadline = time.monotonic() + 5
    while status("engine") != health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status("engine") == health_pb2.HealthCheckResponse.SERVING
    eng.client.send_raw(encode(Unregister(tp_rank=0)))  # as a worker shutting down does
    deadline = time.monotonic() + 5
    while status("engine") != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status("engine") == health_pb2.HealthCheckResponse.NOT_SERVING
    eng.close()


def test_cli_json_numbers_are_numbers_and_peers_list_is_a_table(pair: Pair) -> None:
    pair.move("numbers")
    js = json.loads(subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target",
                                    pair.ds.control, "--json"],
                                   capture_output=True, text=True, timeout=30, check=False).stdout)
    assert isinstance(js["totals"]["bytes"], int)  # uint64: a number, not proto3 JSON's string
    assert js["totals"]["bytes"] > 0
    assert isinstance(js["ranks"][0]["bytes_registered"], int)
    assert isinstance(js["peers"][0]["reads"], int)
    out = subprocess.run([sys.executable, "-m", "kvxfer", "peers", "list", "--target", pair.ds.control],
                         capture_output=True, text=True, timeout=30, check=False).stdout
    assert out.splitlines()[0].split()[:3] == ["ENDPOINT", "ENGINE", "STATE"], out
    assert "ctl-p" in out
    assert "{" not in out  # no Python repr
    lst = json.loads(subprocess.run([sys.executable, "-m", "kvxfer", "peers", "list", "--target",
                                     pair.ds.control, "--json"], capture_output=True, text=True, timeout=30,
                                    check=False).stdout)
    assert isinstance(lst["peers"][0]["bytes"], int)


def test_drain_waits_for_inflight_reads(sidecars: SidecarFactory) -> None:
    pr = Pair(sidecars, "drw")
    try:
        pb_, db = pr.p.allocate(4), pr.d.allocate(4)
        pr.p.fill("inflight", pb_)
        pr.p.client.hold("inflight", pb_)
        pr.d.client.recv("inflight", db, pr.remote(pb_))

        async def both() -> pb.DrainResponse:
            ch = grpc.aio.insecure_channel(pr.ds.control)
            res = await pb_grpc.ControlStub(ch).Drain(pb.DrainRequest(timeout_s=10), timeout=15)
            await ch.close()
            return res

        res = asyncio.run(both())
        assert res.drained is True
        assert res.failed == 0
        got = wait_for(pr.d.client, lambda a: bool(a.done or a.failed))
        assert got.done
        assert not got.failed
        assert pr.d.verify("inflight", db)
    finally:
        pr.close()


def test_a_resume_during_a_drain_keeps_the_work_taken_after_it(sidecars: SidecarFactory) -> None:
    """Found by review: a Drain still waiting when a Resume came ended, at its timeout, the
    holds taken after the Resume (and reported them released). Also: receives refused at
    admission are counted as failed transfers; an unknown event kind is refused, not waited
    on for ever; the CLI says an absent sidecar is unreachable (exit 2); a pre-warm to this
    sidecar's own listener is a typed refusal."""
    pr = Pair(sidecars, "drr")
    try:
        p, d = stub(pr.ps), stub(pr.ds)
        old = pr.p.allocate(2)
        pr.p.client.hold("old", old)
        drain = p.Drain.future(pb.DrainRequest(timeout_s=2.0), timeout=20)
        time.sleep(0.5)
        assert p.Resume(pb.ResumeRequest(), timeout=10).resumed is True
        new = pr.p.allocate(2)
        pr.p.client.hold("after-resume", new)
        assert pr.p.client.ping().seq is not None  # (the hold is in before the drain's timeout)
        res = drain.result()
        assert (res.drained, res.released, res.failed) == (False, 0, 0)
        time.sleep(0.3)
        assert not pr.p.client.poll().released  # (neither hold was ended by the drain)
        assert {lease.request_id for lease in p.GetStatus(pb.GetStatusRequest(), timeout=10).leases} >= \
            {"old", "after-resume"}
        # a refused receive is a failed transfer in the metrics
        before = pr.ds.scrape().get('kvxfer_transfers_total{result="failed"}', 0)
        pr.d.client.recv("out-of-range", [10_000], pr.remote([1]))
        got = wait_for(pr.d.client, lambda a: bool(a.failed))
        assert got.failed[0].code == ErrorCode.BLOCK_OUT_OF_RANGE
        # (counted right after the engine is answered: a loaded machine may scrape in between)
        end = time.monotonic() + 5
        while pr.ds.scrape().get('kvxfer_transfers_total{result="failed"}', 0) < before + 1:
            assert time.monotonic() < end, "the refused receive was not counted"
            time.sleep(0.02)
        assert pr.ds.scrape()['kvxfer_transfers_total{result="failed"}'] == before + 1
        # an unknown event kind: INVALID_ARGUMENT at once
        with pytest.raises(grpc.RpcError) as e:
            next(iter(d.WatchEvents(pb.WatchEventsRequest(kinds=["transfer-done"]), timeout=5)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # a pre-warm to itself: a typed refusal, not UNKNOWN
        reg = pr.d.registered
        assert reg is not None
        with pytest.raises(grpc.RpcError) as e:
            d.ConnectPeer(pb.ConnectPeerRequest(host=reg.handshake_host, port=reg.handshake_port), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
        # the CLI against a socket that is not there: unreachable, exit 2
        for verb in (["drain"], ["resume"], ["peers", "list"]):
            out = subprocess.run([sys.executable, "-m", "kvxfer", *verb, "--target", "unix:///nonexistent.sock",
                                  "--timeout", "2"], capture_output=True, text=True, timeout=30, check=False)
            assert out.returncode == 2, (verb, out.stderr)
    finally:
        pr.close()


def test_every_event_the_sidecar_emits_is_a_known_kind() -> None:
    import pathlib
    import re

    from kvxfer.observe import EVENT_KINDS

    root = pathlib.Path(__file__).resolve().parents[1] / "kvxfer"
    pattern = re.compile(r'\bEvent\(\s*"([a-z_]+)"')
    emitted = {m for path in root.rglob("*.py") for m in pattern.findall(path.read_text())}
    emitted.add("lease_released")  # (observe.lease_released names it by reason)
    assert emitted <= EVENT_KINDS, emitted - EVENT_KINDS
    assert len(emitted) >= 15


def test_a_sidecar_stopping_on_sigterm_refuses_to_resume(sidecars: SidecarFactory) -> None:
    """SIGTERM drains, then exits: a Resume meanwhile used to make it ready again (new holds
    taken, then released at the exit); now it is refused (FAILED_PRECONDITION)."""
    import signal

    sc = sidecars.start("stop-resume", "--drain-timeout-s", "3", metrics_port=free_port())
    eng = SyntheticEngine(make_layout(layers=2, num_blocks=16, heads=2, head_dim=32), sc.endpoint, seed=3)
    eng.start()
    try:
        eng.client.hold("held", eng.allocate(2))
        assert eng.client.ping().seq is not None
        sc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as e:
            stub(sc).Resume(pb.ResumeRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
        assert "stopping" in (e.value.details() or "")
        assert sc.proc.wait(timeout=20) == 0
    finally:
        eng.close()
