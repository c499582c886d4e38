"""A stand-in for systemd's service watchdog, for machines without systemd (tests, CI).

    python -m kvxfer.testing.supervise [--watchdog-s 2] [--abort-s 1] [--restart-s 0.5]
        [--state FILE] -- kvxfer serve ...

What ``deploy/systemd/kvxfer@.service`` asks of systemd, written out: the command runs with
``NOTIFY_SOCKET`` and ``WATCHDOG_USEC``; once it said ``READY=1``, a ``WATCHDOG=1`` must
come at least every ``--watchdog-s`` (``WatchdogSec``), else it gets SIGABRT
(``WatchdogSignal``; a live but wedged sidecar dumps its stacks) and, if it still lives
``--abort-s`` later, SIGKILL (``TimeoutAbortSec``: a frozen process handles no signal).
It is restarted ``--restart-s`` after it exited with anything but 0 or 2
(``Restart=on-failure``, ``RestartPreventExitStatus=2``). SIGINT or SIGTERM is passed on
and ends the supervision. ``--state`` gets one JSON line per event (``started`` with the
pid, ``watchdog`` when it fired, ``exited`` with the status) for tests to follow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from kvxfer.sidecar.loop_lag import read_schedstat


class Supervisor:
    def __init__(self, cmd: list[str], watchdog_s: float, abort_s: float, restart_s: float,
                 state: str = "") -> None:
        self.cmd = cmd
        self.watchdog_s = watchdog_s
        self.abort_s = abort_s
        self.restart_s = restart_s
        self.state = state
        self.stopping = False
        self.child: subprocess.Popen[bytes] | None = None
        self.dir = tempfile.mkdtemp(prefix="kvxsv")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(os.path.join(self.dir, "notify"))

    def note(self, event: str, **fields: Any) -> None:
        print(f"supervise: {event} {fields}", file=sys.stderr, flush=True)
        if self.state:
            with open(self.state, "a") as f:
                f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")

    def stop(self, signum: int, _frame: Any) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def run(self) -> int:
        env = {**os.environ, "NOTIFY_SOCKET": self.sock.getsockname(),
               "WATCHDOG_USEC": str(int(self.watchdog_s * 1e6))}
        while True:
            self._drain()  # (a dead child's last WATCHDOG=1 must not arm the next one's watchdog)
            self.child = subprocess.Popen(self.cmd, env=env)
            self.note("started", pid=self.child.pid)
            code = self._watch(self.child)
            self.note("exited", pid=self.child.pid, status=code)
            if self.stopping or code in (0, 2):
                return code if code >= 0 else 128 - code
            time.sleep(self.restart_s)
            if self.stopping:  # (a SIGTERM during the pause)
                return code if code >= 0 else 128 - code

    def _drain(self) -> None:
        self.sock.setblocking(False)
        try:
            while True:
                self.sock.recv(4096)
        except BlockingIOError:
            pass

    def _watch(self, child: subprocess.Popen[bytes]) -> int:
        last = 0.0  # the last READY=1 or WATCHDOG=1 (0: not ready yet, no watchdog)
        base = (0.0, 0.0)  # the main thread's schedstat then
        self.sock.settimeout(0.05)
        while child.poll() is None:
            try:
                lines = self.sock.recv(4096).decode(errors="replace").splitlines()
            except TimeoutError:
                lines = []
            if "READY=1" in lines or ("WATCHDOG=1" in lines and last):  # (armed at READY=1)
                last = time.monotonic()
                base = _schedstat(child.pid)
            if last and time.monotonic() - last > self.watchdog_s and not self.stopping:
                ran, waited = (max(0.0, a - b) for a, b in zip(_schedstat(child.pid), base, strict=True))
                # (where the main thread's silence went: on a CPU, its loop busy; waiting for
                # one, the host starved it; neither, stopped or blocked; and every thread's state)
                self.note("watchdog", pid=child.pid, silent_s=round(time.monotonic() - last, 3),
                          ran_s=round(ran, 3), waited_s=round(waited, 3), threads=_states(child.pid))
                child.send_signal(signal.SIGABRT)
                try:
                    child.wait(self.abort_s)
                except subprocess.TimeoutExpired:
                    child.kill()
                break
        return child.wait()


def _schedstat(pid: int) -> tuple[float, float]:
    """A process's main thread's (time on a CPU, time waiting for one), seconds ((0, 0): unknown)."""
    return read_schedstat(f"/proc/{pid}/schedstat") or (0.0, 0.0)


def _states(pid: int) -> dict[str, str]:
    """Each thread's name and state (R running or runnable, S sleeping, D in the kernel
    uninterruptibly, T stopped), as "name/tid": state."""
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    head, _, rest = f.read().rpartition(")")
                out[f"{head.partition('(')[2]}/{tid}"] = rest.split()[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.testing.supervise")
    ap.add_argument("--watchdog-s", type=float, default=2.0)
    ap.add_argument("--abort-s", type=float, default=1.0)
    ap.add_argument("--restart-s", type=float, default=0.5)
    ap.add_argument("--state", default="")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command to supervise")
    sv = Supervisor(cmd, args.watchdog_s, args.abort_s, args.restart_s, args.state)
    signal.signal(signal.SIGINT, sv.stop)
    signal.signal(signal.SIGTERM, sv.stop)
    try:
        return sv.run()
    finally:
        sv.sock.close()
        shutil.rmtree(sv.dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
