"""Sidecar events that came before their request was bound (pure; the clock is passed in).

With async scheduling (vLLM's default on GPUs) the scheduler posts a ``Recv`` while a worker
still executes the previous step, so its ``Done`` (or a hold's ``Released``) can reach the
worker before the step whose metadata names the request. Such events are kept by kind and
request id (at most ``limit``, the oldest dropped first, each for ``ttl_s``) and applied once
the request is bound; dropping them would leave the load waiting for its deadline and the
prefill blocks pinned until their lease ran out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvxfer.protocol import Done, Failed, Released

log = logging.getLogger(__name__)

EARLY_MAX = 4096  # events kept for requests not bound yet (async scheduling)

Event = Done | Failed | Released


class EarlyEvents:
    def __init__(self, ttl_s: float, limit: int = EARLY_MAX) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._kept: dict[str, tuple[Event, float]] = {}  # "kind:req id" -> (event, arrival)

    def keep(self, event: Event, now: float) -> None:
        if len(self._kept) >= self.limit:
            oldest = next(iter(self._kept))
            log.warning("dropping an unclaimed sidecar event for request %s (%d kept)", oldest, self.limit)
            del self._kept[oldest]
        self._kept[f"{type(event).__name__}:{event.req_id}"] = (event, now)

    def apply(self, bound: Callable[[Event], bool], now: float) -> None:
        """Apply what is bound by now (``bound`` applies one event, False if its request is not
        bound yet); drop what was applied or waited longer than ``ttl_s``."""
        for key, (event, arrived) in list(self._kept.items()):
            if bound(event) or now - arrived > self.ttl_s:
                del self._kept[key]

    def clear(self) -> None:
        self._kept.clear()
