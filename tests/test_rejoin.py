"""A worker's registration with a restarted sidecar is sent again until it is answered
(``kvxfer/connector/rejoin.py``): before, a refused one (or one whose pools could not be
handed back) left the rank unregistered for good, every load recomputed, P/D silently off."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvxfer.connector.rejoin import Rejoin
from kvxfer.errors import KvxferError
from kvxfer.testing.procs import SidecarFactory


def test_backoff_doubles_up_to_its_cap_and_a_restart_starts_over() -> None:
    r = Rejoin(first_s=0.5, max_s=2.0, answer_s=10.0)
    assert not r.active
    assert not r.due(0.0)
    r.restarted(100.0)
    assert r.active
    assert r.due(100.0)
    r.sent(100.0)
    assert not r.due(109.9)
    assert r.due(110.0)  # no answer in answer_s: sent again
    assert [r.failed(t) for t in (101.0, 102.0, 103.0, 104.0)] == [0.5, 1.0, 2.0, 2.0]
    assert not r.due(105.9)
    assert r.due(106.0)
    r.sent(106.0)
    assert r.attempts == 2
    r.answered()
    assert not r.active
    assert not r.due(1e9)
    assert r.failed(200.0) == 0.0  # an error after the answer retries nothing
    assert not r.active
    r.restarted(300.0)
    r.sent(300.0)
    assert r.failed(300.0) == 0.5
    assert r.attempts == 1


@pytest.mark.parametrize("how", ["refused", "not_sent"])
def test_a_refused_or_unsent_re_registration_is_sent_again(sidecars: SidecarFactory, how: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A real sidecar restarts. The worker's first re-registration fails: ``refused`` hands its
    pools back too late (the new sidecar refuses a registration naming pools it does not
    know), ``not_sent`` cannot reach the memory channel. The next attempt is registered, and
    the engine step never waited."""
    import torch

    from kvxfer.connector.settings import ConnectorSettings
    from kvxfer.connector.worker import CacheShape, WorkerSide

    sc = sidecars.start(f"rejoin-{how}")
    ws = WorkerSide(ConnectorSettings(sidecar=sc.endpoint, heartbeat_s=0.1), 0, 1, "cpu")
    ctx = ws.mem_pool_context()
    assert ctx is not None
    assert ws.pools is not None
    with ctx:
        kv = {"l0": torch.zeros(2, 8, 16, 8, 64, dtype=torch.float16)}
    calls: list[float] = []
    real = ws.pools.readopt

    def first_fails() -> int:
        calls.append(time.monotonic())
        if len(calls) > 1:
            return real()
        if how == "not_sent":
            raise KvxferError("memory channel not answering (test)")
        return 0  # (pools not handed back: the registration names pools the sidecar does not know)

    try:
        first = ws.register_kv_caches(kv, CacheShape(8, 16, 8, 8, 64, False))
        monkeypatch.setattr(ws.pools, "readopt", first_fails)
        os.kill(sc.proc.pid, signal.SIGKILL)
        sc.proc.wait()
        sidecars.start(f"rejoin-{how}")  # same socket path, new process
        deadline = time.monotonic() + 30
        slowest = 0.0
        while ws.registered is None or ws.registered.agent_name == first.agent_name:
            assert time.monotonic() < deadline, f"never re-registered ({len(calls)} attempts)"
            t0 = time.monotonic()
            ws.get_transfer_results()
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.02)
        assert len(calls) == 2, calls  # one failed attempt, then the one that took
        assert calls[1] - calls[0] >= 0.45  # after the backoff, not in a tight loop
        assert slowest < 0.5, slowest
        assert not ws._rejoin.active
    finally:
        ws.shutdown()
