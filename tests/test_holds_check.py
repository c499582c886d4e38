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


def test_a_name_no_sidecar_takes_is_freed_here_and_never_poisons_the_check() -> None:
    o = OverdueHolds(stale_s=60, every_s=5)
    o.supported = True
    client = Sent()
    long = "x" * 513  # (its Hold was refused malformed, naming nothing: no Released, no "unheld")
    holds = {long: 10.0, "lost": 10.0}
    assert o.expire(holds, silent=False, now=11.0, client=client, engine_id="E") == [long]  # type: ignore[arg-type]
    assert client.msgs == [HoldsCheck(engine_id="E", req_ids=["lost"])]


def test_more_overdue_holds_than_one_check_names_are_asked_after_in_turns() -> None:
    o = OverdueHolds(stale_s=60, every_s=1)
    o.supported = True
    holds = {f"r{i}": 0.0 for i in range(MAX_ASKED + 100)}
    first = o.due(holds, 10.0)
    second = o.due(holds, 11.5)
    assert len(first) == len(second) == MAX_ASKED
    assert set(first) | set(second) == set(holds)  # (the first 4,096, extended for long, hide none)


class Polled(Sent):
    """A sidecar client whose events are given (WorkerSide's side only)."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: list[list[Released]] = []

    def heartbeat(self) -> None:
        pass

    def poll(self) -> Any:
        from kvxfer.client import Drained

        d = Drained()
        if self.queue:
            d.released = self.queue.pop(0)
        return d


def test_a_released_and_its_unknown_in_one_poll_free_the_hold_once_and_no_later_one() -> None:
    import time

    from kvxfer.connector.settings import ConnectorSettings
    from kvxfer.connector.worker import WorkerSide

    ws = WorkerSide(ConnectorSettings(sidecar="ipc:///x", heartbeat_s=1000.0), 0, 1, "cpu")
    client = Polled()
    ws.client = client  # type: ignore[assignment]
    ws.bind({}, {"X": time.monotonic() + 60})
    # its lease ended (read) and the answer to a HoldsCheck asked meanwhile come in one poll
    client.queue.append([Released(req_id="X", reason="read"), Released(req_id="X", reason="unknown")])
    assert ws.get_transfer_results().finished_sending == {"X"}
    ws.bind({}, {"X": time.monotonic() + 60})  # a later hold under the name (a push router's retry)
    for _ in range(3):
        assert "X" not in ws.get_transfer_results().finished_sending, \
            "a stale unknown, kept for a later hold, freed it while the sidecar may hold it"


def test_a_sidecar_answers_unknown_for_what_it_does_not_hold_and_nothing_for_what_it_holds(
    factory: Any,
) -> None:
    import time

    from kvxfer.testing.engine import SyntheticEngine, make_layout
    from kvxfer.testing.procs import free_port

    sc = factory.start("hc", "--lease-s", "60", metrics_port=free_port())
    e = SyntheticEngine(make_layout(layers=2, num_blocks=32, heads=2, head_dim=32), sc.endpoint, seed=1)
    e.start()
    try:
        e.client.hold("held", e.allocate(2), lease_s=60)
        assert e.client.ping().holds_check
        e.client.send(HoldsCheck(engine_id="", req_ids=["held", "lost", "lost"]))
        got = e.client.wait_until(lambda a: bool(a.released or a.errors), 5.0)
        time.sleep(0.3)
        got.merge(e.client.poll())
        assert [(r.req_id, r.reason) for r in got.released] == [("lost", "unknown")]
        assert got.errors == []  # (the handler returned a list, awaited: Error internal each time)
        assert sc.scrape().get('kvxfer_leases_released_total{reason="unknown"}') == 1
        e.client.hold("lost", e.allocate(2), lease_s=60)  # its Hold, late: refused, never held now
        err = e.client.wait_until(lambda a: bool(a.errors), 5.0).errors
        assert [x.req_id for x in err] == ["lost"]
    finally:
        e.close()
