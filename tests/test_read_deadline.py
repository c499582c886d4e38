"""A read keeps its receive's deadline however long it waited for the NIXL thread.

A read larger than ``--inline-read-kib`` is planned and posted by the NIXL thread when that
thread takes it from its queue, which may be long after the receive asked for it: the thread
is inside a synchronous CMA copy (~150 ms per GiB), a registration or a digest, or the whole
process was frozen. The connector frees the request's blocks at its deadline, so a read
posted after it could write into blocks vLLM has given to another request. Its deadline was
once relative (``deadline_s``) and counted from when the thread took it up (found by a
review); it is now the receive's own ``time.monotonic()`` deadline.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvxfer.errors import ErrorCode
from kvxfer.sidecar.nixl_fences import Fences
from kvxfer.sidecar.nixl_memory import Cleanup, Leg, PairLists
from kvxfer.sidecar.nixl_reads import Reads
from kvxfer.sidecar.nixl_staging import new_read
from kvxfer.sidecar.nixl_types import ReadFinished, TransferOptions
from kvxfer.sidecar.plan import LegPlan, PairRows, ReadSpec
from kvxfer.topology import BlockPairing


class Agent:
    """Stands in for a NIXL agent: every transfer lands in its post."""

    def __init__(self) -> None:
        self.posted = 0

    def make_prepped_xfer(self, *_args: Any) -> object:
        return object()

    def transfer(self, _handle: object) -> str:
        self.posted += 1
        return "DONE"

    def check_xfer_state(self, _handle: object) -> str:
        return "DONE"

    def release_xfer_handle(self, _handle: object) -> None:
        pass


class Regs:
    """Stands in for the registrations: one leg of one 4 KiB descriptor."""

    def legs(self, _spec: ReadSpec, _chunk: int, _merge: bool) -> tuple[list[Leg], int]:
        idx = np.zeros(1, np.int32)
        rows = PairRows([], [], [], np.zeros((0, 4), np.int64), np.zeros((0, 4), np.int64))
        return [Leg(PairLists(None, None, rows, "DRAM", "DRAM"), LegPlan(idx, idx, 4096))], 4096

    def first_byte(self, _spec: ReadSpec) -> int:
        return 0


def _taken_up(spec: ReadSpec) -> tuple[Agent, list[Any]]:
    """What the NIXL thread does with a read it takes from its queue (``NixlPort._start_read``,
    then its pump): plan it, queue it, post what it may."""
    agent, events = Agent(), []
    options = TransferOptions()
    reads = Reads(agent, options, events.append, Cleanup(), None, Fences(agent, False))
    reads.add(new_read(Regs(), None, spec, options, None, False))  # type: ignore[arg-type]
    reads.post_now(spec.req_id)
    return agent, events


def _spec(deadline: float) -> ReadSpec:
    return ReadSpec(req_id="r", peer="p", local_rank=(0, 0), local_blocks=[0], remote_blocks=[0], plans=[],
                    pairing=BlockPairing(1, False), deadline=deadline)


def test_a_read_taken_up_after_its_deadline_is_not_posted() -> None:
    spec = _spec(time.monotonic() + 0.05)  # asked for on the loop: 50 ms left
    time.sleep(0.12)  # the NIXL thread busy (a long copy, a registration) or the process frozen
    agent, events = _taken_up(spec)
    assert agent.posted == 0, "posted after the receive's deadline: it could land in reused blocks"
    assert len(events) == 1
    assert isinstance(events[0], ReadFinished)
    assert not events[0].ok
    assert events[0].code == ErrorCode.DEADLINE


def test_a_read_taken_up_in_time_is_posted_and_lands() -> None:
    spec = _spec(time.monotonic() + 5.0)
    agent, events = _taken_up(spec)
    assert agent.posted == 1
    assert len(events) == 1
    assert events[0].ok
