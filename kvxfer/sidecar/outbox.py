"""Events for engine connections that cannot take them yet, kept in order and sent as soon as
they can (pure: the connection is a function the caller passes).

An engine that does not read for a while (a long step, a compile, a stopped process) fills
its connection's queues: ZMQ's high-water marks (~1,000 messages each way) or its engine
ring. What the sidecar has to tell it then (a load's ``Done`` or ``Failed``, a lease's
``Released``) must still arrive: a lost ``Released`` pinned its hold until the engine
restarted, a lost ``Done`` left a load to its deadline. So what a connection refuses is kept
here, per connection, in order (a frame never overtakes one kept before it), and flushed when
the caller tries again; a connection that is gone (its engine closed it or died) takes what
waited for it along (counted: ``lost``). What is kept is bounded in bytes per connection:
past ``MAX_BYTES`` a frame is dropped and counted (``dropped``: the engine has stopped
reading for good, or for a very long time), so one engine that never reads again cannot
crowd out the others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

# One frame to one connection: True, it took it; False, no room now (try later); None, the
# connection is gone (nothing will ever reach it).
Conn = Callable[[bytes], "bool | None"]

MAX_BYTES = 16 << 20  # kept for one connection (~120,000 events of ~130 bytes)


class Outbox:
    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._waiting: dict[bytes, deque[bytes]] = {}
        self._bytes: dict[bytes, int] = {}
        self.dropped = 0  # frames dropped because MAX_BYTES waited for their connection, ever
        self.lost = 0  # frames that waited for a connection that went, ever
        self.delivered_late = 0  # frames that waited here and were taken, ever

    @property
    def waiting(self) -> int:
        """Frames kept, all connections together."""
        return sum(len(q) for q in self._waiting.values())

    def idents(self) -> list[bytes]:
        """The connections something waits for."""
        return list(self._waiting)

    def send(self, ident: bytes, frame: bytes, conn: Conn) -> bool:
        """Send ``frame`` to ``ident`` through ``conn``, or keep it behind what waits for that
        connection already; True: something waits now (the caller flushes later)."""
        kept = self._waiting.get(ident)
        if kept is None:
            if conn(frame) is not False:
                return False  # (taken, or its connection is gone: nothing to keep)
            kept = self._waiting[ident] = deque()
            self._bytes[ident] = 0
        if self._bytes[ident] + len(frame) > self.max_bytes:
            self.dropped += 1
            return True
        kept.append(frame)
        self._bytes[ident] += len(frame)
        return True

    def flush(self, ident: bytes, conn: Conn) -> bool:
        """Send what waits for ``ident``, oldest first, while its connection takes it; True:
        nothing waits for it any more (all taken, or the connection is gone)."""
        kept = self._waiting.get(ident)
        while kept:
            took = conn(kept[0])
            if took is False:
                return False
            self._bytes[ident] -= len(kept.popleft())
            if took is None:  # (gone: the rest goes with it)
                self.lost += 1 + len(kept)
                kept.clear()
            else:
                self.delivered_late += 1
        self._waiting.pop(ident, None)
        self._bytes.pop(ident, None)
        return True
