"""How late the event loop's own timer ran, and why: the sidecar's answer to "was it the
sidecar or the host?" when a watchdog fired or requests slowed.

A timer that should fire every ``period_s`` fired ``lag`` later. Over that interval the
loop's thread (this one: /proc/thread-self/schedstat, where the kernel counts a thread's
time on a CPU and its time runnable but waiting for one) either ran on a CPU (a callback
held the loop: the sidecar's doing), or waited for a CPU (the host is short of CPU: its
engine, other pods), or did neither (stopped or blocked: SIGSTOP, the GIL held by another
thread in a C call, a page fault, a blocking system call; a hypervisor's steal too, which
the kernel counts as neither). ``LoopLag.tick`` is pure
arithmetic over readings passed in; ``read_schedstat`` reads the kernel's counters;
``heartbeat`` is the sidecar's timer that feeds it and pings systemd's watchdog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvxfer.observe import Observer
    from kvxfer.systemd import Notifier

log = logging.getLogger("kvxfer.sidecar")

HEARTBEAT_S = 0.5  # the loop's own heartbeat without a systemd watchdog (it measures the loop's lag)
STATUS_S = 5.0  # a systemd STATUS= line this often


@dataclass(frozen=True)
class Stall:
    late_s: float  # how much later than its period the timer ran
    interval_s: float  # since the tick before (its period + late_s)
    ran_s: float | None  # the loop thread's time on a CPU over the interval (None: unknown)
    waited_s: float | None  # its time runnable, waiting for a CPU

    def why(self) -> str:
        head = f"event loop ran {self.late_s:.2f}s late"
        if self.ran_s is None or self.waited_s is None:
            return head + " (the kernel's schedstat is not readable here: cause unknown)"
        # (``other``, neither running nor waiting, holds the loop's own sleep of up to a period:
        # runnable or not is decided first, then whose CPU time it was; comparing waited with
        # max(ran, other) called a callback on a host that gave it half a CPU, 0.4 s ran and 0.4
        # s waited of 1.3 s, "stopped or blocked": found by a review)
        other = max(0.0, self.interval_s - self.ran_s - self.waited_s)
        if self.ran_s + self.waited_s >= other:
            cause = ("the host is short of CPU (the loop was runnable, waiting for a CPU)"
                     if self.waited_s >= self.ran_s else
                     "a callback held the loop (it ran on a CPU most of the time)")
        else:
            cause = ("the process was stopped or blocked (neither running nor waiting for a CPU: "
                     "SIGSTOP or a frozen cgroup, the GIL held by another thread, a blocking call, "
                     "paging, a hypervisor's steal)")
        return (f"{head}; over the last {self.interval_s:.2f}s its thread ran {self.ran_s:.2f}s on a CPU "
                f"and waited {self.waited_s:.2f}s for one: {cause}")


class LoopLag:
    """Feed it every tick of a periodic timer; it names the ticks that came late."""

    def __init__(self, period_s: float, warn_s: float) -> None:
        self.period_s = period_s
        self.warn_s = warn_s
        self._last: tuple[float, tuple[float, float] | None] | None = None  # (monotonic, schedstat)
        self.worst_s = 0.0  # the most a tick came late, ever
        self.stalls = 0  # ticks later than warn_s, ever

    def tick(self, now: float, sched: tuple[float, float] | None) -> Stall | None:
        """A tick at ``now`` with the thread's cumulative (CPU, wait) times (None: unknown); a
        Stall when it came more than ``warn_s`` after its time (the first tick starts the clock)."""
        last, self._last = self._last, (now, sched)
        if last is None:
            return None
        interval = now - last[0]
        late = interval - self.period_s
        self.worst_s = max(self.worst_s, late)
        if late <= self.warn_s:
            return None
        self.stalls += 1
        if sched is None or last[1] is None:
            return Stall(late, interval, None, None)
        return Stall(late, interval, max(0.0, sched[0] - last[1][0]), max(0.0, sched[1] - last[1][1]))


def read_schedstat(path: str = "/proc/thread-self/schedstat") -> tuple[float, float] | None:
    """A thread's (time on a CPU, time waiting for one) in seconds: this one's, or another's
    (``/proc/<pid>/schedstat``: a process's main thread). None: not readable, or a kernel
    without schedstats, which shows zeros."""
    try:
        with open(path) as f:
            ran, waited, _slices = f.read().split()
    except (OSError, ValueError):
        return None
    return (int(ran) / 1e9, int(waited) / 1e9) if int(ran) else None


async def heartbeat(systemd: Notifier, observer: Observer, status_line: Callable[[], str]) -> None:
    """Watchdog pings (only while the loop itself runs: a stuck loop is killed), a STATUS=
    line every STATUS_S, and the loop's lateness, explained: the first thing to read when a
    watchdog fired or requests slowed (``kvxfer_loop_stalls_total``, a ``loop_stalled`` event)."""
    period = systemd.watchdog_s or HEARTBEAT_S
    lag = LoopLag(period, max(0.25, period))
    status_at = 0.0
    lag.tick(time.monotonic(), read_schedstat())  # (the clock starts now)
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        stall = lag.tick(now, read_schedstat())
        observer.totals.loop_lag_worst_s = lag.worst_s  # (GetStatus's and the gauge's, one number)
        if systemd.watchdog_s:
            systemd.watchdog()
        if stall is not None:
            observer.loop_stalled(stall.late_s, stall.why())
        if systemd.enabled and now - status_at >= STATUS_S:
            status_at = now
            try:
                systemd.status(status_line())
            except Exception:  # (a status line is cosmetic: never the heartbeat's end)
                log.exception("STATUS= line not sent")
