"""The earlier windows of a staged read read in windows (``kvxfer.sidecar.staged_reads``:
a read too large for one slot, or gathered on several GPUs of the prefill): each posted as
a read of the window's slot under an id of its own, followed until it landed and scattered,
one at a time."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.nixl_types import ReadFinished, ReadRefused
from kvxfer.sidecar.plan import StagedRead

_WINDOW_IDS = itertools.count(1)


class NoArena(Exception):
    """The prefill has no staging arena for the asked ranks' memory (a GPU whose arena could
    not be made): asking again would not help."""


class WindowFailed(RequestError):
    """A window's read failed once posted: the receive's read failed (it did start)."""

    def __init__(self, event: ReadFinished) -> None:
        super().__init__(event.code or ErrorCode.TRANSFER_ERROR, event.reason)
        self.event = event


class Windows:
    """The reads of a receive's earlier windows (``Prepared.windows``), posted as reads of
    their own (``spec(staged, req_id)``: the receive's ReadSpec for that slot) whose
    landings come back here (``landed``/``refused``, from the receiver, before its own);
    ``settle`` ends the one in flight (a cancel), after which none is posted. One per
    receive, made by the receiver."""

    def __init__(self, key: str, spec: Callable[[StagedRead, str], object], nixl: NixlPort) -> None:
        self.key = key
        self._spec = spec
        self._nixl = nixl
        self.stopped = False
        self._in_flight: tuple[str, asyncio.Future[ReadFinished]] | None = None
        self.moved = (0, 0)  # the windows read so far: bytes, descriptors
        self.t0 = 0.0  # when the first was posted (monotonic)

    def check(self) -> None:
        if self.stopped:
            raise RequestError(ErrorCode.CANCELLED, "the receive is being cancelled")

    def before(self) -> tuple[int, int, float]:
        """What the last window's read reports beside its own: the others' bytes and
        descriptors, and the seconds since the first was posted."""
        return (*self.moved, time.monotonic() - self.t0 if self.t0 else 0.0)

    async def read(self, i: int, staged: StagedRead) -> None:
        """Window ``i`` read into the slot and scattered, or RequestError (``WindowFailed``:
        it was posted and failed)."""
        self.check()
        rid = f"{self.key}#w{i}#{next(_WINDOW_IDS)}"  # (an id no receive key or earlier window has)
        fut: asyncio.Future[ReadFinished] = asyncio.get_running_loop().create_future()
        self._in_flight = (rid, fut)
        self.t0 = self.t0 or time.monotonic()
        try:
            self._nixl.read(self._spec(staged, rid))  # type: ignore[arg-type]  (a ReadSpec)
            got = await asyncio.shield(fut)
        finally:
            self._in_flight = None
        if not got.ok:
            why = f"window {i + 1}: {got.reason}"
            raise WindowFailed(dataclasses.replace(got, req_id=self.key, reason=why))
        self.moved = (self.moved[0] + got.nbytes, self.moved[1] + got.descriptors)

    def reading(self, rid: str) -> bool:
        return self._in_flight is not None and self._in_flight[0] == rid

    def landed(self, event: ReadFinished) -> bool:
        if self._in_flight is None or not self.reading(event.req_id):
            return False
        if not self._in_flight[1].done():
            self._in_flight[1].set_result(event)
        return True

    def refused(self, event: ReadRefused) -> bool:
        """(its error reaches the receiver through ``ask``, made a RequestError there: ``read_after``)"""
        if self._in_flight is None or not self.reading(event.req_id):
            return False
        if not self._in_flight[1].done():
            self._in_flight[1].set_exception(event.error)
        return True

    async def settle(self, err: RequestError) -> None:
        """No window is posted after this; the one in flight is cancelled and waited for (its
        scatter never lands in blocks the engine got back)."""
        self.stopped = True
        if self._in_flight is not None:
            rid, fut = self._in_flight
            if not fut.done():
                await self._nixl.cancel(rid, err.code, err.reason)
            with contextlib.suppress(Exception):
                await asyncio.shield(fut)
