"""systemd's notify protocol, written out (no libsystemd): READY=1, STATUS=, WATCHDOG=1,
STOPPING=1 as datagrams to ``$NOTIFY_SOCKET``. Every call is a no-op when the variable is
unset, so the daemon behaves the same under systemd, Kubernetes or a shell."""

from __future__ import annotations

import contextlib
import os
import socket


class Notifier:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        self.address = env.get("NOTIFY_SOCKET", "")
        if self.address.startswith("@"):  # abstract namespace
            self.address = "\0" + self.address[1:]
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ok_pid = not pid or pid == str(os.getpid())
        # systemd asks for a ping at least every WATCHDOG_USEC; ping four times as often, so a
        # loop late by up to 3/4 of it (a starved host: see kvxfer.sidecar.loop_lag) is not
        # killed, where pinging twice as often (what sd_notify(3) suggests) left half.
        self.watchdog_s = int(usec) / 4e6 if usec.isdigit() and int(usec) > 0 and ok_pid else 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, *lines: str) -> None:
        if not self.address:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s, contextlib.suppress(OSError):
            # Never block the event loop: a notify socket nobody reads (a stalled PID 1, a
            # test harness that stopped listening) filled up and froze every transfer.
            s.setblocking(False)
            s.sendto("\n".join(lines).encode(), self.address)  # OSError: systemd gone or full

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def stopping(self, status: str = "draining") -> None:
        self.notify("STOPPING=1", f"STATUS={status}")
