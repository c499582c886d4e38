"""A worker's overdue holds (``kvxfer.connector.holds_check``): when they are asked after,
which ``Released`` are applied, and what a silent sidecar's holds become. The wire, with a
real sidecar: ``tests/test_leases.py::test_a_worker_frees_a_hold_on_its_own_only_when_its_
sidecar_is_silent_or_does_not_hold_it``."""

from __future__ import annotations

from typing import Any

from kvxfer.connector.holds_check import MAX_ASKED, OverdueHolds
from kvxfer.errors import SidecarUnavailable
from kvxfer.protocol import HoldsCheck, Released


class Sent:
    endpoint = "ipc:///x"

    def __init__(self, fail: bool = False) -> None:
        self.msgs: list[Any] = []
        self.fail = fail

    def send(self, msg: Any) -> None:
        if self.fail:
            raise SidecarUnavailable("queue full")
        self.msgs.append(msg)


def test_overdue_holds_are_asked_after_only_of_a_sidecar_that_answers_and_at_most_every_few_seconds() -> None:
    o = OverdueHolds(stale_s=60, every_s=5)
    holds = {"a": 10.0, "b": 20.0}
    assert o.due(holds, 11.0) == []  # (its Pong has not said it answers HoldsCheck)
    o.supported = True
    assert o.due(holds, 11.0) == ["a"]  # only what is past its deadline
    assert o.due(holds, 12.0) == []  # asked 1 s ago
    assert o.due(holds, 15.9) == []
    assert o.due(holds, 16.1) == ["a"]
    assert o.due(holds, 21.2) == ["a", "b"]
    o2 = OverdueHolds(stale_s=60, every_s=5)
    o2.supported = True
    assert o2.due(holds, 5.0) == []  # nothing overdue yet: the first is asked as soon as it is
    assert o2.due(holds, 10.5) == ["a"]
    many = {f"r{i}": 0.0 for i in range(MAX_ASKED + 10)}
    assert len(o2.due(many, 100.0)) == MAX_ASKED


def test_a_live_sidecar_is_asked_a_silent_ones_overdue_holds_are_freed() -> None:
    o = OverdueHolds(stale_s=60, every_s=5)
    o.supported = True
    client = Sent()
    holds = {"a": 10.0, "b": 20.0}
    assert o.expire(holds, silent=False, now=11.0, client=client, engine_id="E") == []  # type: ignore[arg-type]
    assert client.msgs == [HoldsCheck(engine_id="E", req_ids=["a"])]
    assert o.expire(holds, silent=True, now=21.0, client=client, engine_id="E") == ["a", "b"]  # type: ignore[arg-type]
    assert o.expire(holds, silent=False, now=30.0, client=None, engine_id="E") == []
    # a send that fails never raises into the engine's step
    assert o.expire(holds, silent=False, now=40.0, client=Sent(fail=True), engine_id="E") == []  # type: ignore[arg-type]


def test_an_unknown_frees_a_bound_hold_and_makes_a_late_released_of_its_name_stale() -> None:
    o = OverdueHolds(stale_s=60)
    unknown = Released(req_id="a", reason="unknown")
    assert not o.admit(unknown, held=False, now=1.0)  # stale: matches no hold, never kept for a later one
    assert o.admit(Released(req_id="a", reason="read"), held=True, now=1.0)  # nothing freed it yet
    assert o.admit(unknown, held=True, now=2.0)  # frees the hold
    # the real Released, on its way apart from the answer, must not end a later hold of that name
    assert not o.admit(Released(req_id="a", reason="expired"), held=True, now=30.0)
    assert not o.admit(Released(req_id="a", reason="read"), held=False, now=61.0)
    assert o.admit(Released(req_id="a", reason="read"), held=True, now=62.5)  # its window is over
    assert o.admit(Released(req_id="b", reason="read"), held=True, now=30.0)  # other names untouched
