"""Fences: a 16-byte READ from a peer right after each NIXL notification sent to it, so that
the next read from that peer lands inside its post instead of a poll later.

Measured on this host (UCX peer mode: copies over CMA, control over TCP), NIXL 1.5.1: NIXL
flushes the endpoint at the end of every transfer it posts, and once a notification went
out on that endpoint the flush completes only after the peer's agent made progress (the
peer's NIXL thread polls every ``active_poll_s``, 0.5 ms, while it serves). A read posted
after a notification returns PROC and is seen to land only after the peer's next poll and
then this sidecar's next one, where it would otherwise copy and complete inside
``transfer()``. A reader notifies its prefill once per read (the final ``ReadNotice``), so
every read from the same prefill paid for the one before it: in a loop of 2 MiB reads
between two processes, one notification after each read made every other read return PROC
(median 420 µs against 270 µs with none), and a 16-byte READ posted right after the
notification made every read after it complete inside its post again. That READ is the
fence: it takes the wait on itself, off any request's path, polled here like a read.

Only with host memory and UCX peer mode (in "none" mode transfers need no progress of their
target; only CMA on one host was measured). A fence reads 16 bytes of the peer's lease words
(``kvxfer.sidecar.lease_words``: registered for the peer sidecar's whole life, unlike its
engines' memory, which an unregistration unmaps) into 16 bytes of this sidecar's own
registered memory, shared by every fence and never read: a READ changes nothing on the peer,
and a late landing writes only there. So nothing waits for a fence: a peer unloaded while
one is in flight has it released (cancelled) at once, and one still in flight after
``GIVE_UP_S`` is let go the same way.

Used on the NIXL port's thread only (or by the loop under the port's lock).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import numpy as np

from kvxfer.sidecar.nixl_agent import release_or_park, release_parked, xfer_state

log = logging.getLogger("kvxfer.transfer")
GIVE_UP_S = 5.0  # a fence in flight this long (its peer frozen?) is released and forgotten
FENCE_BYTES = 16


class Fences:
    def __init__(self, agent: Any, enabled: bool) -> None:
        self._agent = agent
        self._targets: dict[str, int] = {}  # peer -> the address its fences read (its lease words)
        self._inflight: dict[str, tuple[Any, float]] = {}  # peer -> (handle, posted at)
        self._again: set[str] = set()  # notified since its fence in flight was posted
        self._parked: list[Any] = []  # handles NIXL would not release yet (never touched again)
        self.posted = 0  # fences posted, ever (a metric)
        self._local: np.ndarray | None = None
        self._reg: Any = None
        if enabled:
            mem = np.zeros(FENCE_BYTES // 8, dtype=np.uint64)
            try:
                self._reg = agent.register_memory([(int(mem.ctypes.data), FENCE_BYTES, 0, "")], "DRAM")
                self._mem = mem  # (kept alive: a late landing writes here)
                self._local = np.array([[int(mem.ctypes.data), FENCE_BYTES, 0]], dtype=np.int64)
            except Exception as e:
                log.warning("no fences after notifications (%s): reads after one wait for the peer's poll", e)

    def __len__(self) -> int:
        return len(self._inflight)

    def target(self, peer: str, words_addr: int) -> None:
        """A peer was loaded: its fences read its lease words (0: it has none, no fences)."""
        self.forget(peer)
        if self._local is not None and words_addr:
            self._targets[peer] = words_addr

    def forget(self, peer: str) -> None:
        """A peer is unloaded: no more fences to it, and the one in flight is let go now."""
        self._targets.pop(peer, None)
        self._again.discard(peer)
        fence = self._inflight.pop(peer, None)
        if fence is not None:
            release_or_park(self._agent, fence[0], self._parked)

    def notify(self, peer: str, payload: bytes, what: str = "notification") -> None:
        """A notification to ``peer`` on this agent, and the fence after it (a send that fails is
        only logged: a dead peer reports itself through its reads)."""
        try:
            self._agent.send_notif(peer, payload)
        except Exception as e:
            log.warning("%s to %s not sent: %s", what, peer, e)
        self.after_notice(peer)

    def after_notice(self, peer: str) -> None:
        """A notification was just sent to ``peer`` on this agent."""
        if peer not in self._targets:
            return
        if peer in self._inflight:
            self._again.add(peer)  # (its flush may predate this notification: one more after it)
            return
        self._post(peer)

    def poll(self) -> bool:
        """Let go of the fences that settled or lag; whether any is still in flight."""
        now = time.monotonic()
        for peer, (handle, posted) in list(self._inflight.items()):
            if xfer_state(self._agent, handle) not in ("DONE", "ERR"):
                if now - posted < GIVE_UP_S:
                    continue
                log.warning("fence to %s still in flight after %.1fs: let go", peer, now - posted)
            del self._inflight[peer]
            release_or_park(self._agent, handle, self._parked)
            if peer in self._again:
                self._again.discard(peer)
                self._post(peer)
        if self._parked:
            self._parked = release_parked(self._agent, self._parked)
        return bool(self._inflight)

    def close(self) -> None:
        for peer in list(self._inflight):
            self.forget(peer)
        if self._reg is not None:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(self._reg)
            self._reg = None

    def _post(self, peer: str) -> None:
        agent = self._agent
        remote = np.array([[self._targets[peer], FENCE_BYTES, 0]], dtype=np.int64)
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(self._local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), peer)
        except Exception as e:
            log.debug("fence to %s not prepared: %s", peer, e)
            return
        try:
            state = str(agent.transfer(handle))
        except Exception as e:  # (a dead peer: its reads report it)
            log.debug("fence to %s not posted: %s", peer, e)
            state = "ERR"
        if state == "ERR":
            release_or_park(agent, handle, self._parked)
            return
        self.posted += 1
        if state == "DONE":
            release_or_park(agent, handle, self._parked)
        else:
            self._inflight[peer] = (handle, time.monotonic())
