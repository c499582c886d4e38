"""A frozen decode sidecar costs seconds (#37 part 2): its supervisor's watchdog kills it,
and the engine's connector, proven by the sidecar's pidfd that it is gone, fails its loads
and frees its holds at once (never while it might still write), then re-registers with the
restarted sidecar. The supervisor here is ``kvxfer.testing.supervise``, a stand-in for
systemd's watchdog (this machine has no systemd); ``deploy/systemd/kvxfer@.service`` asks
systemd for the same (``WatchdogSec=2``, ``TimeoutAbortSec=1``), and the last test runs a
transient unit with those settings where systemd is PID 1 (skipped here)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
            fired = events(state)[1]  # what the supervisor saw: stopped, not busy, not starved
            threads = fired["threads"]
            assert isinstance(threads, dict)
            assert threads
            assert set(threads.values()) == {"T"}, threads
            assert float(str(fired["ran_s"])) < 0.2
            assert float(str(fired["waited_s"])) < 0.2
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


def _systemd() -> bool:
    return (os.path.isdir("/run/systemd/system") and shutil.which("systemd-run") is not None
            and os.geteuid() == 0)


@pytest.mark.skipif(not _systemd(), reason="no systemd here (PID 1 is not systemd): the stand-in covers it")
def test_under_systemd_a_frozen_sidecar_is_killed_by_its_watchdog_and_restarted(tmp_path: Path) -> None:
    """The real supervisor, where the machine has one: the unit's watchdog settings on a
    transient unit (systemd-run), the sidecar SIGSTOPped, a new main process soon after."""
    unit = f"kvxfer-watchdog-test-{os.getpid()}"

    def main_pid() -> int:
        out = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", unit], capture_output=True,
                             text=True, check=False).stdout.strip()
        return int(out or 0)

    props = ["Type=notify", "NotifyAccess=main", "WatchdogSec=2", "WatchdogSignal=SIGABRT",
             "TimeoutAbortSec=1", "Restart=on-failure", "RestartSec=1"]
    serve = [sys.executable, "-m", "kvxfer", "serve", "--engine-id", "wd", "--engine-socket",
             f"ipc://{tmp_path}/e.sock", "--handshake-port", "0", "--control-target", "",
             "--metrics-port", "0"]
    args = [a for p in props for a in ("-p", p)]
    subprocess.run(["systemd-run", "--unit", unit, "--collect", *args, *serve], check=True, timeout=30)
    try:
        end = time.monotonic() + 60
        while (first := main_pid()) == 0:
            assert time.monotonic() < end, "the sidecar never became the unit's main process"
            time.sleep(0.2)
        time.sleep(3.0)  # serving: its pings keep the watchdog quiet
        assert main_pid() == first
        os.kill(first, signal.SIGSTOP)
        t0 = time.monotonic()
        while main_pid() in (first, 0):
            assert time.monotonic() - t0 < 30, "the frozen sidecar was not replaced"
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert took < 2 + 1 + 1 + 5, took  # watchdog, abort, RestartSec, a start
    finally:
        subprocess.run(["systemctl", "stop", unit], capture_output=True, check=False, timeout=60)


def test_an_aborted_decode_cancels_its_load_only_while_it_may_run() -> None:
    """The scheduler's ``Cancel``: sent for a decode request aborted while its load may still
    run, not for one that finished well, nor once the workers reported its load ended (an
    abort mid-decoding), nor for a request it posted no load for."""
    from types import SimpleNamespace
    from typing import Any

    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.connector.settings import ConnectorSettings
    from kvxfer.protocol import Cancel, Pong

    class Client:
        def __init__(self) -> None:
            self.sent: list[Any] = []

        def ping(self, _timeout: float) -> Pong:
            return Pong(seq=0, engine_id="e", version=6, handshake_host="127.0.0.1", handshake_port=1)

        def send(self, msg: Any) -> None:
            self.sent.append(msg)

    client = Client()
    sched = SchedulerSide(ConnectorSettings(sidecar="ipc:///nowhere"), tp_size=2, client=client,  # type: ignore[arg-type]
                          engine_id="D")

    def finish(req_id: str, status: str) -> None:
        req = SimpleNamespace(request_id=req_id, status=SimpleNamespace(name=status),
                              kv_transfer_params={"do_remote_prefill": False, "remote_host": "h"})
        assert sched.request_finished(req, [1, 2]) == (False, None)

    for r in ("aborted", "ok", "loaded"):
        sched._loads[r] = time.monotonic() + 60  # (posted: what update_state_after_alloc records)
    sched.loads_ended({"loaded"})  # (its workers reported the load: finished_recving)
    finish("aborted", "FINISHED_ABORTED")
    finish("ok", "FINISHED_LENGTH_CAPPED")
    finish("loaded", "FINISHED_ABORTED")
    finish("never-posted", "FINISHED_ABORTED")
    assert client.sent == [Cancel(req_id="aborted", engine_id="D")]
