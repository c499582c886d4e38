"""A worker's holds that outlived their deadline while the sidecar still answers: asked after.

A hold's blocks go back to vLLM when its ``Released`` comes. A live sidecar may keep a lease
past the deadline the worker knows (a decode still waiting renews it), so an overdue hold is
not freed on the clock while the sidecar answers heartbeats. But a ``Released`` can be lost
(dropped by the sidecar's outbox: 16 MiB waited for this connection, or it was stopped for
over 300 s; or the ring it was on was dropped), and so can the ``Hold`` itself: such a hold
waited forever, its blocks never free. So the worker asks (``HoldsCheck``, every
``CHECK_EVERY_S`` while any hold is overdue) and the sidecar answers ``Released(reason=
"unknown")`` for each it does not hold; the worker then frees it as for any ``Released``.

An "unknown" that matches no hold is stale (the real ``Released`` came first) and is dropped,
never kept for a later hold of that name. A real ``Released`` that comes after an "unknown"
freed its hold (the two can travel apart: the answer goes to the asking connection, a
``Released`` to the rank's registered one) is dropped too, for ``stale_s``: applied, it
would end a later hold under the same name (a push router's retry) before that hold was
read; dropped, such a hold is freed at most ``CHECK_EVERY_S`` past its own deadline.
The clock is passed in; the only I/O is the HoldsCheck sent (never raising into the step).
"""

from __future__ import annotations

import logging

from kvxfer.client import SEND_ERRORS, SidecarClient
from kvxfer.protocol import Done, Failed, HoldsCheck, Released

log = logging.getLogger(__name__)

CHECK_EVERY_S = 5.0  # while holds are overdue: one HoldsCheck this often, at most
MAX_ASKED = 4096  # lease names per HoldsCheck (HoldsCheck.req_ids' bound)
MAX_NAME = 512  # a lease name's longest (kvxfer.protocol.base.ReqId)


class OverdueHolds:
    def __init__(self, stale_s: float, every_s: float = CHECK_EVERY_S) -> None:
        self.stale_s = stale_s
        self.every_s = every_s
        self.supported = False  # the sidecar's Pong says it answers HoldsCheck
        self._next = 0.0
        self._turn = 0  # where the next HoldsCheck starts, with more than MAX_ASKED overdue
        self._freed: dict[str, float] = {}  # lease name -> until when a Released for it is stale

    def expire(self, holds: dict[str, float], silent: bool, now: float, client: SidecarClient | None,
               engine_id: str) -> list[str]:
        """The overdue holds to free now: every one while the sidecar is silent (dead or
        wedged), else only those whose name no sidecar can decode (their Hold was refused
        ``malformed``, with no name to say so by; asked after, they would make the whole
        HoldsCheck undecodable). A live sidecar may have extended the others' leases (a decode
        still waiting renews them, a read claims them) and sends Released when they end; it is
        asked after them instead (``due``)."""
        overdue = [name for name, deadline in holds.items() if now > deadline]
        if silent:
            return overdue
        unnamable = [name for name in overdue if not _namable(name)]
        if unnamable:
            log.warning("freeing %d overdue holds whose names no sidecar takes (e.g. %d characters)",
                        len(unnamable), len(unnamable[0]))
        ask = self.due(holds, now) if client is not None and overdue else []  # (no second pass per step)
        try:
            if ask:
                client.send(HoldsCheck(engine_id=engine_id, req_ids=ask))  # type: ignore[union-attr]
        except SEND_ERRORS as e:
            log.warning("overdue holds not asked after (sidecar %s): %s", client.endpoint, e)  # type: ignore[union-attr]
        return unnamable

    def due(self, holds: dict[str, float], now: float) -> list[str]:
        """The overdue holds to ask after now ([]: none, not yet, or the sidecar cannot say)."""
        if not self.supported or now < self._next:
            return []
        overdue = [name for name, deadline in holds.items() if now > deadline and _namable(name)]
        if not overdue:
            return []
        self._next = now + self.every_s
        if len(overdue) > MAX_ASKED:  # (in turns: a first 4,096 extended for long never hide the rest)
            at = self._turn % len(overdue)
            self._turn += MAX_ASKED
            overdue = (overdue[at:] + overdue[:at])[:MAX_ASKED]
        return overdue

    def admit(self, event: Done | Failed | Released, held: bool, now: float) -> bool:
        """Whether to apply ``event`` (``held``: a hold of its name is bound now: asked of each
        event as it is applied, never of a poll's all at once). An "unknown" that frees a hold
        makes every Released of that name stale for ``stale_s``; one that finds no hold is
        dropped, never kept for a later hold."""
        if not isinstance(event, Released):
            return True
        if event.reason == "unknown":
            if held:
                self._freed = {n: t for n, t in self._freed.items() if t > now}
                self._freed[event.req_id] = now + self.stale_s
                log.warning("sidecar does not hold request %s past its deadline (its Hold or its Released "
                            "was lost); freeing its blocks", event.req_id)
            return held
        return self._freed.get(event.req_id, 0.0) <= now


def _namable(name: str) -> bool:
    return 0 < len(name) <= MAX_NAME
