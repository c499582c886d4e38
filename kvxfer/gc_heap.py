"""The garbage collector's pauses: a process's heap frozen once it has settled, and every
collection timed.

CPython's cyclic collector stops the thread that triggers it, and with the GIL every other
Python thread, while it walks a generation. The oldest generation holds what a sidecar
imported and built at start (torch alone, which the staging copies import, is ~140,000
tracked objects) and is walked whenever a quarter more objects have survived into it since
the last time: 95-170 ms with the event loop stopped, measured on 2 cores in a ``kvxfer
demo`` 8 -> 8 run (the sidecar's own ``gc.callbacks``), where a warm one-block read costs
~1 ms. ``settle`` collects once and moves every object alive into the permanent generation
(``gc.freeze``; vLLM's engine does the same after it starts, ``freeze_gc_heap``), so later
collections walk only what was made since: none of that run's collections after the first
second took more than 4 ms. Objects frozen are still freed when their last reference goes;
only a reference cycle among them would never be collected, which is why ``settle`` runs
only where little transient is alive: at start, before the engine and peer listeners serve,
and once a start-up import has finished, on the event loop when no receive is in flight and
no lease held.

``GcPauses`` times every collection through ``gc.callbacks``, in plain numbers and no
locks: a callback runs inside whatever allocation triggered the collection, on whatever
thread, and a lock taken there could be one the interrupted code holds. Metrics read them
(``kvxfer_gc_*``).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvxfer.gc")


@dataclass
class GcPauses:
    """Every collection's count and time by generation, and the longest, since install."""

    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    worst_s: float = 0.0
    _started: dict[int, float] = field(default_factory=dict)  # thread id -> perf_counter at start

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        tid = threading.get_ident()
        if phase == "start":
            self._started[tid] = now
            return
        t0 = self._started.pop(tid, None)
        gen = int(info.get("generation", 2))
        if t0 is None or not 0 <= gen <= 2:
            return
        took = now - t0
        self.collections[gen] += 1
        self.seconds[gen] += took
        self.worst_s = max(self.worst_s, took)

    def forget_worst(self) -> None:
        """The worst is counted from here: from the heap's last settle (the collections of
        start-up and of the settles themselves are in the totals and the settle's log line)."""
        self.worst_s = 0.0


PAUSES = GcPauses()
_installed = threading.Lock()


def install() -> GcPauses:
    """Time every collection of this process from now on (once per process)."""
    with _installed:
        if PAUSES.callback not in gc.callbacks:
            gc.callbacks.append(PAUSES.callback)
    return PAUSES


def settle(why: str, pauses: GcPauses) -> None:
    """Collect everything unreachable now, then freeze every object alive (see the module's
    docstring for where this may run); ``pauses``' worst counts from here."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    took_ms = (time.perf_counter() - t0) * 1e3
    log.info("heap settled (%s): %d objects frozen, in %.0f ms", why, gc.get_freeze_count(), took_ms)
    pauses.forget_worst()


class GcCollector:
    """``kvxfer_gc_*`` at each scrape, from ``pauses`` and the collector's own counts."""

    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        n = CounterMetricFamily("kvxfer_gc_collections", "Garbage collections of this process, by "
                                "generation (2: the oldest).", labels=["generation"])
        s = CounterMetricFamily("kvxfer_gc_pause_seconds", "Seconds every thread of this process "
                                "stood still for the garbage collector, by generation.",
                                labels=["generation"])
        for gen in range(3):
            n.add_metric([str(gen)], self.pauses.collections[gen])
            s.add_metric([str(gen)], self.pauses.seconds[gen])
        yield n
        yield s
        yield GaugeMetricFamily("kvxfer_gc_pause_worst_seconds", "The longest garbage collection of this "
                                "process since its heap last settled (at start, and once idle after "
                                "the staging copies' import).", value=self.pauses.worst_s)
        yield GaugeMetricFamily("kvxfer_gc_frozen_objects", "Objects frozen out of the collector's walks "
                                "when the heap settled (at start, and after the staging copies' "
                                "import).", value=gc.get_freeze_count())
        yield GaugeMetricFamily("kvxfer_gc_old_objects", "Objects in the oldest generation, which a full "
                                "collection walks (grows with what the sidecar keeps: a leak shows here).",
                                value=len(gc.get_objects(generation=2)))
