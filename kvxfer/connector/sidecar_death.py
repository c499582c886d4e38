"""Proof that the sidecar process is gone: a pidfd of it, from its memory channel (#37).

A frozen sidecar (SIGSTOP, a frozen cgroup, a wedged loop) may still write into blocks it
was reading for this engine once it resumes, so its loads are not failed while it might
live; its supervisor kills it instead (systemd ``WatchdogSec``, a Kubernetes liveness
probe: ``deploy/``). The moment it has exited, nothing of it can write any more (its
mappings and NIXL endpoints die with it), and a pidfd says so: it polls readable once the
process exited, whichever PID namespace each end runs in. The worker then fails its loads
and frees its holds at once, without waiting for their deadlines or for the restarted
sidecar's first answer. Where the sidecar gives no pidfd (no memory channel: a ``tcp://``
sidecar, CUDA IPC without pools; an older sidecar) nothing changes: the deadlines decide.
Freeing a dead prefill sidecar's holds at once is safe over any transport: whatever a peer
may still read of those blocks, it delivers nothing without its claim's answer, which a
dead sidecar cannot give.
"""

from __future__ import annotations

import contextlib
import os
import select

from kvxfer.pool import PoolClient


class SidecarDeath:
    def __init__(self) -> None:
        self._fd = -1

    def watch(self, pools: PoolClient | None, timeout_s: float = 0.0) -> bool:
        """Ask the sidecar now behind ``pools`` for its pidfd (after each registration);
        whether one came (``timeout_s``: an engine step's bound; 0: the client's)."""
        self.close()
        fd = pools.sidecar_pidfd(timeout_s) if pools is not None else None
        self._fd = -1 if fd is None else fd
        return self._fd >= 0

    @property
    def watching(self) -> bool:
        return self._fd >= 0

    def proven(self) -> bool:
        """Whether the watched sidecar process has exited (a poll of its pidfd; no wait)."""
        if self._fd < 0:
            return False
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        return bool(p.poll(0))

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
