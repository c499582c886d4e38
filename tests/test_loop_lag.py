"""The sidecar says when its event loop ran late, and why (``kvxfer.sidecar.loop_lag``): a
watchdog that fires (WatchdogSec=2) is the sidecar's fault when a callback held the loop, the
host's when the loop waited for a CPU, neither when the process was stopped or blocked. Found
by the soak: two sidecars killed by their watchdogs while a test suite starved this 2-core
machine, with nothing in their logs to tell a stuck loop from a starved one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvxfer.sidecar.loop_lag import LoopLag, Stall
from kvxfer.testing.procs import SidecarFactory, free_port


def test_a_late_tick_is_named_with_where_the_time_went() -> None:
    lag = LoopLag(period_s=0.5, warn_s=0.5)
    assert lag.tick(100.0, (1.0, 1.0)) is None  # (the first tick only starts the clock)
    assert lag.tick(100.6, (1.01, 1.0)) is None  # 0.1 s late: fine
    stall = lag.tick(102.6, (1.02, 2.4))  # 1.5 s late, 1.4 s of 2 waiting for a CPU
    assert stall is not None
    assert stall.late_s == pytest.approx(1.5)
    assert stall.interval_s == pytest.approx(2.0)
    assert stall.waited_s == pytest.approx(1.4)
    assert "short of CPU" in stall.why()
    assert lag.stalls == 1
    assert lag.worst_s == pytest.approx(1.5)
    assert "a callback held the loop" in Stall(1.5, 2.0, 1.9, 0.1).why()
    assert "stopped or blocked" in Stall(1.5, 2.0, 0.05, 0.05).why()
    # runnable most of the time on a host that gave it half a CPU: whose CPU time it was, not
    # "stopped or blocked" (its own sleep, up to a period, is neither running nor waiting)
    assert "short of CPU" in Stall(0.8, 1.3, 0.4, 0.4).why()
    assert "a callback held the loop" in Stall(0.8, 1.3, 0.45, 0.35).why()
    # busy for most of its period, then blocked for longer: blocked, not a callback
    assert "stopped or blocked" in Stall(0.6, 1.1, 0.45, 0.02).why()
    # no schedstat here: late, cause unknown
    assert "cause unknown" in lag.tick(105.0, None).why()  # type: ignore[union-attr]


def _heartbeat_running(sc: object) -> None:
    """Wait until the heartbeat ticked after starting its clock (its worst lateness is then a
    tiny positive number): a sidecar just started may not have run it yet (on a loaded
    machine a SIGSTOP 1 s after ready once came before its first tick: nothing to compare)."""
    end = time.monotonic() + 20
    while True:
        with contextlib.suppress(OSError):  # (its metrics listener may not be up yet)
            if sc.scrape().get("kvxfer_loop_lag_worst_seconds", 0.0) > 0.0:  # type: ignore[attr-defined]
                return
        assert time.monotonic() < end, "the heartbeat never ticked"
        time.sleep(0.1)


def _late_lines(sc: object, since: int) -> list[str]:
    log = sc.log()[since:]  # type: ignore[attr-defined]
    return [line for line in log.splitlines() if "event loop ran" in line]


def test_a_stopped_sidecar_says_its_loop_ran_late_and_that_it_was_not_busy() -> None:
    with SidecarFactory() as f:
        sc = f.start("lag", metrics_port=free_port())
        _heartbeat_running(sc)
        assert sc.scrape()["kvxfer_loop_stalls_total"] == 0
        since = len(sc.log())
        os.kill(sc.proc.pid, signal.SIGSTOP)
        time.sleep(1.5)
        os.kill(sc.proc.pid, signal.SIGCONT)
        end = time.monotonic() + 10
        while not _late_lines(sc, since) and time.monotonic() < end:
            time.sleep(0.1)
        lines = _late_lines(sc, since)
        assert len(lines) == 1, sc.log()[since:]
        assert "stopped or blocked" in lines[0], lines[0]
        late = float(lines[0].split("event loop ran ")[1].split("s late")[0])
        assert 0.8 < late < 3.0, lines[0]
        got = sc.scrape()
        assert got["kvxfer_loop_stalls_total"] == 1
        assert 0.8 < got["kvxfer_loop_lag_worst_seconds"] < 3.0
        # and from a shell: kvxfer status (its --json totals, and a line of the text)
        cli = [sys.executable, "-m", "kvxfer", "status", "--target", sc.control]
        js = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True, check=True).stdout)
        assert int(js["totals"]["loop_stalls"]) == 1, js["totals"]
        assert 0.8 < js["totals"]["loop_lag_worst_s"] < 3.0
        text = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
        assert "event loop late 1 times" in text, text


SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    pass
"""


def _can_run_realtime() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        return False
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return len(os.sched_getaffinity(0)) >= 2


@pytest.mark.skipif(not _can_run_realtime(), reason="needs root (a real-time spinner) and 2 CPUs")
def test_a_starved_sidecar_says_the_host_was_short_of_cpu() -> None:
    """A real-time spinner takes the CPU the sidecar is pinned to for 1.2 s: the loop runs
    late, waiting for a CPU, not busy. The sidecar beats every 0.25 s here (as under a 1 s
    WatchdogSec), not the default 0.5 s: a kernel that keeps 5 % of each second for others
    (6.12+, the fair server) gives the starved loop 50 ms about 0.95 s into the spin, and at
    0.5 s a tick that ran there was 0.45-0.55 s late, either side of the 0.5 s reported (CI
    missed it once; 6 of 15 runs here). At 0.25 s it is at least 0.7 s late, past the 0.25 s
    reported, whatever the phase. (1.2 s: whatever else runs on that CPU meanwhile, a soak's
    supervised sidecars among them, stays under their 2 s watchdog: at 1.5 s one beside this
    test was killed.)"""
    with SidecarFactory() as f:
        sc = f.start("lag", metrics_port=free_port(), env={"WATCHDOG_USEC": "1000000"})
        _heartbeat_running(sc)
        cpu = max(os.sched_getaffinity(0))
        for task in os.listdir(f"/proc/{sc.proc.pid}/task"):  # (every thread: NIXL's, UCX's too)
            os.sched_setaffinity(int(task), {cpu})
        since = len(sc.log())
        subprocess.run([sys.executable, "-c", SPIN, str(cpu), "1.2"], check=True, timeout=30)
        end = time.monotonic() + 10
        while not _late_lines(sc, since) and time.monotonic() < end:
            time.sleep(0.1)
        lines = _late_lines(sc, since)
        assert lines, sc.log()[since:]
        assert all("short of CPU" in line for line in lines), lines
