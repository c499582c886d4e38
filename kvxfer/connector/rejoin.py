"""When a worker sends its registration to a restarted sidecar again (pure; the clock is passed in).

After a sidecar restart the worker re-registers without waiting in the engine step; the answer
comes back through ``poll``. Until it is ``Registered`` the sidecar refuses the rank's loads
(``not_registered``) and its holds, so vLLM recomputes every prompt: P/D is off for that rank.
A registration that could not be sent (the new sidecar's queue full, its memory channel not
answering yet) or that the sidecar refused (its memory not mapped yet, a layout it cannot
take) is therefore sent again, after 0.5 s, then twice as long each time up to 30 s, until
one is answered ``Registered`` or the sidecar restarts once more (which starts over).

One attempt is outstanding at a time, and only its failure schedules the next: a registration
sent again while one is still in the sidecar's hands (or after it took) would register the
rank a second time, which ends the engine's leases and fails the rank's reads in flight. So
an attempt with no answer is never resent (a restart, seen by the heartbeat, starts over),
and a refusal counts once per attempt (``refused`` is a no-op unless one is outstanding).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec

log = logging.getLogger(__name__)

ABANDONED_MAX = 16384  # request ids a re-registration names (RegisterKV.abandoned)


@dataclass
class Rejoin:
    first_s: float = 0.5  # the wait before the first retry
    max_s: float = 30.0  # the longest wait between two attempts
    attempts: int = 0  # registrations sent since the restart
    _due: float | None = None  # when to send (None: nothing to send)
    _outstanding: bool = False  # sent, its answer not in yet
    _backoff: float = 0.0

    @property
    def active(self) -> bool:
        """A registration is to be sent or its answer is awaited."""
        return self._due is not None or self._outstanding

    @property
    def outstanding(self) -> bool:
        """A registration was sent and is not answered yet (an error now may be its refusal)."""
        return self._outstanding

    def restarted(self, now: float) -> None:
        """A (new) restarted sidecar answers: register with it now, backoff reset."""
        self._due, self._outstanding, self._backoff, self.attempts = now, False, self.first_s, 0

    def due(self, now: float) -> bool:
        """Time to send: the first attempt, or a retry whose wait is over."""
        return self._due is not None and now >= self._due

    def sent(self) -> None:
        self._due, self._outstanding = None, True
        self.attempts += 1

    def not_sent(self, now: float) -> float:
        """The attempt due could not be sent: again later; returns the wait."""
        return self._again(now) if self._due is not None else 0.0

    def refused(self, now: float) -> float:
        """The outstanding attempt was refused: again later; returns the wait (0.0: none was
        outstanding, an error that was not its answer)."""
        return self._again(now) if self._outstanding else 0.0

    def _again(self, now: float) -> float:
        wait = self._backoff
        self._due, self._outstanding = now + wait, False
        self._backoff = min(self._backoff * 2, self.max_s)
        return wait

    def answered(self) -> None:
        self._due, self._outstanding = None, False


def naming_abandoned(registration: Any, abandoned: dict[str, float], now: float) -> Any:
    """A worker's ``RegisterKV`` naming what it gave up on while its sidecar was away
    (``abandoned``: request id -> its deadline), for as long as they could still arrive."""
    if not abandoned:
        return registration
    ids = list(abandoned)
    if len(ids) > ABANDONED_MAX:
        log.warning("%d requests given up on at a sidecar restart; naming the newest %d", len(ids),
                    ABANDONED_MAX)
        ids = ids[-ABANDONED_MAX:]
    last = max(abandoned[r] for r in ids)
    return msgspec.structs.replace(registration, abandoned=ids, abandoned_s=max(0.0, last - now) + 5.0)
