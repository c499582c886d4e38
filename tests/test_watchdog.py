"""A frozen decode sidecar costs seconds (#37 part 2): its supervisor's watchdog kills it,
and the engine's connector, proven by the sidecar's pidfd that it is gone, fails its loads
and frees its holds at once (never while it might still write), then re-registers with the
restarted sidecar. The supervisor here is ``kvxfer.testing.supervise``, a stand-in for
systemd's watchdog (this machine has no systemd); ``deploy/systemd/kvxfer@.service`` asks
systemd for the same (``WatchdogSec=2``, ``TimeoutAbortSec=1``)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from kvxfer.testing.procs import SidecarFactory

WATCHDOG_S, ABORT_S = 1.0, 0.5
RESTART_S = 3.0  # (systemd's RestartSec=2 and a start: a successor's answer is no quicker proof)


def supervised(state: Path) -> tuple[str, ...]:
    return (sys.executable, "-m", "kvxfer.testing.supervise", "--watchdog-s", str(WATCHDOG_S),
            "--abort-s", str(ABORT_S), "--restart-s", str(RESTART_S), "--state", str(state), "--")


def events(state: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in state.read_text().splitlines()] if state.exists() else []


def test_a_frozen_sidecar_is_killed_and_its_loads_fail_at_once(tmp_path: Path) -> None:
    import torch

    from kvxfer.connector.settings import ConnectorSettings
    from kvxfer.connector.worker import CacheShape, WorkerSide

    state = tmp_path / "state"
    with SidecarFactory() as f:
        sc = f.start("wd", prefix=supervised(state))
        # grace_s and settle_s far away: only the proof of death can fail the load early
        settings = ConnectorSettings(sidecar=sc.endpoint, heartbeat_s=0.1, grace_s=60.0, settle_s=60.0)
        ws = WorkerSide(settings, 0, 1, "cpu")
        ctx = ws.mem_pool_context()
        assert ctx is not None
        with ctx:
            kv = {"l0": torch.zeros(2, 8, 16, 8, 64, dtype=torch.float16)}
        try:
            first = ws.register_kv_caches(kv, CacheShape(8, 16, 8, 8, 64, False))
            assert ws.death.watching, "the sidecar gave no pidfd"
            far = time.monotonic() + 120
            ws.bind({"in-flight": ([1, 2], far)}, {"held": far})
            pid = int(str(events(state)[-1]["pid"]))
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            sending, failed = set(), set()
            while "in-flight" not in failed or "held" not in sending:
                assert time.monotonic() - t0 < 20, "the frozen sidecar's load was not failed"
                res = ws.get_transfer_results()
                sending |= res.finished_sending
                failed |= res.failed_recving
                time.sleep(0.01)
            took = time.monotonic() - t0
            print(f"\nfrozen sidecar: load failed {took:.2f}s after SIGSTOP "
                  f"(watchdog {WATCHDOG_S}s + abort {ABORT_S}s)")
            assert took < WATCHDOG_S + ABORT_S + 1.5, took
            assert [e["event"] for e in events(state)][:3] == ["started", "watchdog", "exited"]
            assert ws.take_invalid_block_ids() == {1, 2}
            # until a successor answers, a load bound now fails at once (nothing could serve it)
            ws.bind({"meanwhile": ([3], far)}, {})
            # the successor: the worker re-registers with it, and loads wait for it again
            end = time.monotonic() + 60
            while ws.registered is None or ws.registered.agent_name == first.agent_name:
                assert time.monotonic() < end, "never re-registered with the restarted sidecar"
                failed |= ws.get_transfer_results().failed_recving
                time.sleep(0.05)
            assert "meanwhile" in failed
            ws.bind({"after": ([4], far)}, {})
            for _ in range(20):
                assert "after" not in ws.get_transfer_results().failed_recving
                time.sleep(0.05)
        finally:
            ws.shutdown()


def test_a_load_refused_to_a_rank_not_registered_yet_fails_in_its_worker_at_once() -> None:
    """Right after a sidecar restart a rank's Recv can reach the sidecar before the rank's
    re-registration: the sidecar answers Failed to the socket the Recv came from (the
    scheduler's). The scheduler passes it to that rank's worker, which used to wait for the
    load's deadline + settle_s (50 s in the vLLM test that found it)."""
    from kvxfer.client import Drained
    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.connector.settings import ConnectorSettings
    from kvxfer.connector.worker import WorkerSide
    from kvxfer.protocol import Failed, Pong

    class Client:
        def __init__(self) -> None:
            self.pending = Drained()

        def ping(self, _timeout: float) -> Pong:
            return Pong(seq=0, engine_id="e", version=6, handshake_host="127.0.0.1", handshake_port=1)

        def heartbeat(self) -> None:
            pass

        def poll(self) -> Drained:
            out, self.pending = self.pending, Drained()
            return out

    settings = ConnectorSettings(sidecar="ipc:///nowhere")
    client = Client()
    sched = SchedulerSide(settings, tp_size=2, client=client)  # type: ignore[arg-type]
    sched._loads["load"] = time.monotonic() + 60  # (posted: what update_state_after_alloc records)
    sched._loads["old"] = time.monotonic() + 60
    client.pending.failed += [
        Failed(req_id="load", block_ids=[5], code="not_registered", reason="x", tp_rank=1, pp_rank=0),
        Failed(req_id="release-only", block_ids=[], code="handshake_failed", reason="y"),
        Failed(req_id="old", block_ids=[6], code="not_registered", reason="z")]  # (no rank: an older sidecar)
    plan = sched.take_plan()
    assert plan.refused == {"load": [(0, 1)]}
    workers = [WorkerSide(settings, rank, 2, "cpu") for rank in (0, 1)]
    for w in workers:
        w.bind({"load": ([5], time.monotonic() + 60)}, {}, refused=plan.refused)
    assert "load" in workers[0]._recvs  # rank 0's Recv is its sidecar's to answer
    assert workers[1]._failed_now == {"load": [5]}  # rank 1 reports it failed at its next step
    assert "load" not in workers[1]._recvs
