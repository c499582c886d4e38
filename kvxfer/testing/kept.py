"""Sidecar pairs kept across ``kvxfer.testing.demo.run_demo`` runs (the tests' layout and TP
matrices: one pair per set of serve arguments and environment, not two fresh processes a
case). Each run's engines register ranks of their TP size and layout on sidecars that served
other cases before, as an engine restarted with a new configuration does, and name their
requests apart from every earlier run's. After a run its engines' exit must be seen
(``after_run``: no rank registered, no pool, lease, read or staging slot held, both
sidecars alive) or that run fails; a pair found holding something at the next run's start
(a run that failed) is replaced."""

from __future__ import annotations

import os
import time

from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port

ENV_KEYS = ("KVXFER_", "UCX_", "NIXL_")  # (what a sidecar reads from its environment)
BUSY = ("kvxfer_registered_ranks", "kvxfer_orphaned_ranks", "kvxfer_held_leases", "kvxfer_inflight_transfers",
        "kvxfer_pools", "kvxfer_staging_slots")
SETTLE_S = 30.0


class KeptSidecars:
    def __init__(self) -> None:
        self._pairs: dict[tuple[str, ...], tuple[SidecarFactory, list[SidecarProc]]] = {}
        self.runs = 0

    def pair(self, serve_args: tuple[str, ...]) -> list[SidecarProc]:
        """The pair for these arguments and this environment, started if there is none or the
        kept one is dead or still holds something (what its last run reported)."""
        key = (*serve_args, *sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(ENV_KEYS)))
        got = self._pairs.pop(key, None)
        if got is not None and all(sc.proc.poll() is None for sc in got[1]) and not leftovers(got[1], 1.0):
            self._pairs[key] = got
            return got[1]
        if got is not None:
            got[0].close()
        factory = SidecarFactory()
        pair = start_pair(factory, serve_args)
        self._pairs[key] = (factory, pair)
        return pair

    def pairs(self) -> list[list[SidecarProc]]:
        """The pairs kept now (a test that looks at them after its runs)."""
        return [pair for _, pair in self._pairs.values()]

    def after_run(self, pair: list[SidecarProc]) -> list[str]:
        """A run's problems once its engines exited: what the sidecars still hold, or a death."""
        dead = [f"kept {sc.name} sidecar exited with {sc.proc.returncode}"
                for sc in pair if sc.proc.poll() is not None]
        if dead:
            return dead + [f"{sc.name} sidecar log tail: " + sc.log()[-2000:] for sc in pair]
        left = leftovers(pair, SETTLE_S)
        return [f"kept sidecars still hold {left} {SETTLE_S:.0f} s after the run's engines exited"
                ] if left else []

    def close(self) -> None:
        for factory, _ in self._pairs.values():
            factory.close()
        self._pairs.clear()


def start_pair(factory: SidecarFactory, serve_args: tuple[str, ...]) -> list[SidecarProc]:
    """A demo's prefill and decode sidecars, each with its /metrics."""
    return [factory.start(name, *serve_args, metrics_port=free_port()) for name in ("prefill", "decode")]


def leftovers(pair: list[SidecarProc], timeout_s: float) -> dict[str, float]:
    """What the sidecars still hold of a run whose engines exited (waits up to ``timeout_s``
    for it to go; {}: nothing)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            left = {f"{sc.name} {k}": v for sc in pair for k, v in sc.scrape().items() if k in BUSY and v}
        except OSError as e:
            left = {f"metrics: {e}": 1.0}
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.02)
