"""When a worker sends its registration to a restarted sidecar again (pure; the clock is passed in).

After a sidecar restart the worker re-registers without waiting in the engine step; the answer
comes back through ``poll``. Until it is ``Registered`` the sidecar refuses the rank's loads
(``not_registered``) and its holds, so vLLM recomputes every prompt: P/D is off for that rank.
A registration that could not be sent (the new sidecar's queue full, its memory channel not
answering yet), that the sidecar refused (its memory not mapped yet, a layout it cannot take)
or that no answer came for is therefore sent again, after 0.5 s, then twice as long each time
up to 30 s, until one is answered ``Registered`` or the sidecar restarts once more (which starts
over). Each attempt is logged by the worker with what ended the one before.
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
    answer_s: float = 60.0  # an attempt with no answer for this long is sent again
    attempts: int = 0  # registrations sent since the restart
    _due: float | None = None  # when to send (None: nothing to send)
    _waiting_until: float | None = None  # sent, answer expected before this
    _backoff: float = 0.0

    @property
    def active(self) -> bool:
        """A registration is to be sent or its answer is awaited."""
        return self._due is not None or self._waiting_until is not None

    def restarted(self, now: float) -> None:
        """A (new) restarted sidecar answers: register with it now, backoff reset."""
        self._due, self._waiting_until, self._backoff, self.attempts = now, None, self.first_s, 0

    def due(self, now: float) -> bool:
        """Time to send: first attempt, a retry's wait is over, or no answer came in time."""
        if self._due is not None:
            return now >= self._due
        return self._waiting_until is not None and now >= self._waiting_until

    def sent(self, now: float) -> None:
        self._due, self._waiting_until = None, now + self.answer_s
        self.attempts += 1

    def failed(self, now: float) -> float:
        """The attempt was not sent or was refused: send again later; returns the wait."""
        if not self.active:
            return 0.0  # (an error that came after the answer: nothing to retry)
        wait = self._backoff
        self._due, self._waiting_until = now + wait, None
        self._backoff = min(self._backoff * 2, self.max_s)
        return wait

    def answered(self) -> None:
        self._due = self._waiting_until = None


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
