"""Whether the sidecar takes work: one object, written in one place per cause.

Before this, readiness was a flag written in four places (start, a lost engine socket,
drain, resume) beside the metric and the gRPC health states, each updated by hand through
callbacks the control server planted on the daemon. Here the causes are methods, the
answers are properties, and whoever shows them (``kvxfer_ready``, gRPC health) subscribes
and is told of every change with a frozen ``LifecycleView``.

Pure: no asyncio, no sockets. Subscribers run synchronously inside the call that changed
the state (an async one schedules its own task); they must not raise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LifecycleView:
    listening: bool  # NIXL up and the engine socket is the one this process bound
    draining: bool  # refusing new holds and receives (drain, SIGTERM)
    engines: bool  # at least one engine rank registered (not orphaned)
    busy: bool  # receives in flight or blocks held

    @property
    def ready(self) -> bool:
        """Takes new work: what readiness probes and ``kvxfer_ready`` say."""
        return self.listening and not self.draining

    @property
    def serving_engines(self) -> bool:
        """gRPC health "engine": an engine is registered and work is taken."""
        return self.engines and self.ready


Subscriber = Callable[[LifecycleView, LifecycleView], None]  # (before, after)


class Lifecycle:
    def __init__(self) -> None:
        self._view = LifecycleView(listening=False, draining=False, engines=False, busy=False)
        self._subscribers: list[Subscriber] = []
        self.resumes = 0  # resumes, ever: a drain that waited across one leaves the work alone
        self.stopping = False  # SIGTERM: draining for good (a resume is refused)

    @property
    def view(self) -> LifecycleView:
        return self._view

    @property
    def ready(self) -> bool:
        return self._view.ready

    @property
    def draining(self) -> bool:
        return self._view.draining

    def subscribe(self, fn: Subscriber) -> None:
        """``fn(before, after)`` on every change from now on."""
        self._subscribers.append(fn)

    def _set(self, **changes: bool) -> bool:
        before = self._view
        after = LifecycleView(**{**before.__dict__, **changes})
        if after == before:
            return False
        self._view = after
        for fn in list(self._subscribers):
            fn(before, after)
        return True

    # ---------------------------------------------------------------- causes

    def started(self) -> None:
        """Every listener bound and NIXL up."""
        self._set(listening=True)

    def socket_lost(self) -> bool:
        """The engine socket file was removed or replaced: engines cannot reach us. Final."""
        return self._set(listening=False)

    def drain(self) -> bool:
        """Refuse new work; False when already draining."""
        return self._set(draining=True)

    def resume(self) -> bool:
        """Take new work again; False when not draining, or stopping."""
        if self.stopping or not self._set(draining=False):
            return False
        self.resumes += 1
        return True

    def stop(self) -> None:
        """SIGTERM: the drain that follows is for good (a resume is refused until the exit)."""
        self.stopping = True

    def engines_registered(self, registered: bool) -> None:
        self._set(engines=registered)

    def work(self, busy: bool) -> None:
        """Receives in flight or blocks held (``busy``), or nothing at all (idle)."""
        self._set(busy=busy)


class Signal:
    """Something changed: every subscriber is called, in the order they subscribed. How a
    part says "look again" without knowing who looks (no callback climbs back up into the
    app: the app subscribes)."""

    def __init__(self) -> None:
        self._subscribers: list[Callable[[], None]] = []

    def subscribe(self, fn: Callable[[], None]) -> None:
        self._subscribers.append(fn)

    def emit(self) -> None:
        for fn in list(self._subscribers):
            fn()
