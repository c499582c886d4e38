"""A lease covers the whole receive (#16 item 2), with real sidecar processes and NIXL.

* A read *claims* its lease at the prefill, in parallel with the read: a lease that was
  already over (the blocks may hold another request's KV by then) fails the load with code
  ``expired`` instead of delivering those bytes.
* A decode request still waiting for local blocks keeps its prefill lease alive
  (``KeepAlive`` → ``LeaseRenew``, as vLLM's NixlConnector heartbeats waiting requests); a
  lease already gone comes back as ``expired`` and the request is computed locally.
* The engine worker frees a hold on its own only when its sidecar is silent: a live sidecar
  may have extended the lease. It asks a live one after its overdue holds instead, and frees
  those it does not hold (their Hold or their Released was lost).
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

from kvxfer.client import RemoteBlocks
from kvxfer.errors import ErrorCode
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, free_port

LAYOUT = make_layout(layers=2, num_blocks=32, heads=2, head_dim=32)


def _pair(factory: SidecarFactory, lease_s: str) -> tuple[SyntheticEngine, SyntheticEngine, object]:
    ps = factory.start("lp", "--lease-s", lease_s, metrics_port=free_port())
    ds = factory.start("ld", "--handshake-timeout-s", "2")
    p, d = SyntheticEngine(LAYOUT, ps.endpoint, seed=1), SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    p.start()
    d.start()
    return p, d, ps


def test_a_read_of_an_expired_lease_fails_instead_of_delivering_reused_blocks(
    factory: SidecarFactory,
) -> None:
    p, d, ps = _pair(factory, "1")
    try:
        reg = p.registered
        assert reg is not None
        pb = p.allocate(4)
        p.fill("old", pb)
        p.client.hold("old", pb)
        got = p.client.wait_until(lambda a: bool(a.released), 10.0).released
        assert [(r.req_id, r.reason) for r in got] == [("old", "expired")]
        p.fill("someone-else", pb)  # the engine reused the blocks the moment the lease ended
        db = d.allocate(4)
        d.client.recv("old", db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb))
        ans = d.client.wait_until(lambda a: bool(a.done or a.failed), 20.0)
        assert not ans.done, "a read of blocks whose lease was over was delivered as Done"
        assert [f.code for f in ans.failed] == [ErrorCode.EXPIRED]
        assert "lease" in ans.failed[0].reason
        assert sorted(ans.failed[0].block_ids) == sorted(db)  # vLLM marks exactly these invalid
        m = ps.scrape()  # type: ignore[attr-defined]
        assert m.get('kvxfer_stray_notices_total{kind="expired_lease"}', 0) >= 1
    finally:
        p.close()
        d.close()


def test_a_claimed_read_succeeds_and_extends_the_lease(factory: SidecarFactory) -> None:
    """The claim is not a cost on the happy path: a live lease is read, verified, released."""
    p, d, _ = _pair(factory, "30")
    try:
        reg = p.registered
        assert reg is not None
        for i in range(5):
            pb, db = p.allocate(3), d.allocate(3)
            p.fill(f"ok-{i}", pb)
            p.client.hold(f"ok-{i}", pb)
            where = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb)
            d.client.recv(f"ok-{i}", db, where)
            ans = d.client.wait_until(lambda a: bool(a.done or a.failed), 20.0)
            assert not ans.failed, ans.failed
            assert d.verify(f"ok-{i}", db)
            rel = p.client.wait_until(lambda a: bool(a.released), 10.0).released
            assert [(r.req_id, r.reason) for r in rel] == [(f"ok-{i}", "read")]
    finally:
        p.close()
        d.close()


def test_keepalives_hold_a_lease_past_its_length_while_the_decode_waits(factory: SidecarFactory) -> None:
    p, d, _ = _pair(factory, "1.5")
    try:
        reg = p.registered
        assert reg is not None
        where = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, [])
        pb = p.allocate(3)
        p.fill("waiting", pb)
        p.client.hold("waiting", pb)
        end = time.monotonic() + 4.0  # well past the 1.5 s lease
        while time.monotonic() < end:
            d.client.keepalive(where, ["waiting"], ["local-waiting"])
            assert not d.client.wait(0.4).errors
        assert not p.client.wait(0.1).released, "the lease ran out although the decode kept it alive"
        db = d.allocate(3)
        d.client.recv("local-waiting", db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port,
                                                        pb, req_id="waiting"))
        ans = d.client.wait_until(lambda a: bool(a.done or a.failed), 20.0)
        assert not ans.failed, ans.failed
        assert d.verify("waiting", db)
        # Once nobody renews it, a lease runs out as before; a keep-alive for it then says so.
        pb2 = p.allocate(2)
        p.client.hold("abandoned", pb2)
        rel = p.client.wait_until(lambda a: any(r.req_id == "abandoned" for r in a.released), 10.0).released
        assert ("abandoned", "expired") in [(r.req_id, r.reason) for r in rel]
        d.client.keepalive(where, ["abandoned"], ["local-abandoned"])
        errs = d.client.wait_until(lambda a: bool(a.errors), 10.0).errors
        assert [(e.req_id, e.code) for e in errs] == [("local-abandoned", ErrorCode.EXPIRED)]
    finally:
        p.close()
        d.close()


def test_the_decode_scheduler_keeps_waiting_requests_alive_and_recomputes_lost_ones(
    factory: SidecarFactory,
) -> None:
    """``SchedulerSide`` (vLLM-free part of the connector) with real sidecars: a request that
    waits for blocks longer than the prefill lease keeps it; one whose lease is gone is
    computed locally instead of read."""
    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.connector.settings import ConnectorSettings

    p, d, _ = _pair(factory, "1.5")
    sched = SchedulerSide(ConnectorSettings(sidecar=factory.procs[1].endpoint, keepalive_s=0.3), tp_size=1)
    try:
        reg = p.registered
        assert reg is not None
        gone = p.allocate(2)
        p.client.hold("gone-req", gone)
        rel = p.client.wait_until(lambda a: bool(a.released), 10.0).released
        assert [(r.req_id, r.reason) for r in rel] == [("gone-req", "expired")]
        pb = p.allocate(2)
        p.client.hold("kept", pb)
        params = {"do_remote_prefill": True, "remote_engine_id": reg.engine_id, "remote_request_id": "kept",
                  "remote_block_ids": pb, "remote_host": reg.handshake_host,
                  "remote_port": reg.handshake_port, "tp_size": 1}
        req = SimpleNamespace(request_id="d-kept", kv_transfer_params=dict(params),
                              prompt_token_ids=list(range(20)))
        lost = SimpleNamespace(request_id="d-lost", prompt_token_ids=list(range(20)),
                               kv_transfer_params={**params, "remote_request_id": "gone-req"})
        assert sched.get_num_new_matched_tokens(req, 0) == (20, True)
        assert sched.get_num_new_matched_tokens(lost, 0) == (20, True)
        end = time.monotonic() + 4.0
        while time.monotonic() < end:  # engine steps while both wait for blocks
            sched.take_plan()
            time.sleep(0.05)
        assert not p.client.wait(0.1).released, "the waiting request's lease ran out"
        assert sched.get_num_new_matched_tokens(req, 0) == (20, True)
        assert sched.get_num_new_matched_tokens(lost, 0) == (0, False)  # computed here
        lost.status = SimpleNamespace(name="FINISHED_STOPPED")
        _, extra = sched.request_finished(lost, [])
        assert extra is not None
        assert "lease expired" in extra["kvxfer_error"]
    finally:
        sched.shutdown()
        p.close()
        d.close()


def test_a_worker_frees_a_hold_on_its_own_only_when_its_sidecar_is_silent_or_does_not_hold_it(
    factory: SidecarFactory,
) -> None:
    import torch

    from kvxfer.client import SidecarClient
    from kvxfer.connector.settings import ConnectorSettings
    from kvxfer.connector.worker import CacheShape, WorkerSide

    sc = factory.start("silent", "--lease-s", "60")
    ws = WorkerSide(ConnectorSettings(sidecar=sc.endpoint, heartbeat_s=0.1, grace_s=1.0), 0, 1, "cpu")
    ctx = ws.mem_pool_context()
    assert ctx is not None
    with ctx:
        kv = {"l0": torch.zeros(2, 8, 16, 8, 64, dtype=torch.float16)}
    scheduler = SidecarClient(sc.endpoint)  # (the Holds come from the scheduler's own connection)
    try:
        ws.register_kv_caches(kv, CacheShape(8, 16, 8, 8, 64, False))
        scheduler.hold("held", [0, 1], lease_s=60, notify_ranks=True)  # held (as if a decode extended it)
        scheduler.ping()
        # ... and "lost", whose Hold never reached the sidecar: the engine's own deadlines pass at once
        ws.bind({}, {"held": time.monotonic() + 0.2, "lost": time.monotonic() + 0.2})
        freed: set[str] = set()
        end = time.monotonic() + 3.0
        while time.monotonic() < end:  # the sidecar answers heartbeats: it may have extended the lease
            freed |= ws.get_transfer_results().finished_sending
            assert "held" not in freed
            time.sleep(0.05)
        assert freed == {"lost"}, "a hold the live sidecar does not hold was never freed"
        os.kill(sc.proc.pid, signal.SIGSTOP)  # silent now
        try:
            deadline = time.monotonic() + 10
            while "held" not in ws.get_transfer_results().finished_sending:
                assert time.monotonic() < deadline, "a silent sidecar's hold was never freed"
                time.sleep(0.05)
        finally:
            os.kill(sc.proc.pid, signal.SIGCONT)
    finally:
        scheduler.close()
        ws.shutdown()



def test_a_read_the_decode_refuses_to_plan_frees_the_prefills_blocks_at_once(factory: SidecarFactory) -> None:
    """A receive refused at its plan (here: blocks the prefill does not have) was never told to
    the prefill: its blocks stayed held until the lease ran out. Now the prefill is told this
    reader will not read, on the handshake's path and on the warm one."""
    p, d, _ = _pair(factory, "60")
    try:
        reg = p.registered
        assert reg is not None
        remote = lambda blocks: RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port,  # noqa: E731
                                             blocks, generation=p.client.ping().generation)
        for name in ("cold", "warm"):  # (the first handshakes; the second plans on the cached peer)
            pb = p.allocate(2)
            p.client.hold(name, pb, lease_s=60)
            d.client.recv(name, d.allocate(2), remote([pb[0], LAYOUT.num_blocks + 5]))
            failed = d.client.wait_until(lambda a: bool(a.failed), 20.0).failed
            assert [f.code for f in failed] == [ErrorCode.BLOCK_OUT_OF_RANGE], failed
            got = p.client.wait_until(lambda a: bool(a.released), 5.0).released
            assert [(r.req_id, r.reason) for r in got] == [(name, "aborted")], name
    finally:
        p.close()
        d.close()
