"""Host gathers off the NIXL thread (#35, ``nixl_staging.Gathers``). In UCX peer mode a READ
completes only once its target makes progress, and a prefill that gathered on its NIXL
thread (5-13 ms for 16 MiB of head slices) held every READ from it until the gather ended.
A host gather is now checked on the NIXL thread and copied on a thread of its own; what
must still hold: the memory it copies from is not let go under the copy (an unregister of
its rank waits for it), and VRAM gathers stay where they were. The bytes themselves are
checked end to end by tests/test_tp_staged.py (real sidecars, every byte)."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest

from kvxfer.sidecar import nixl_staging as ns
from kvxfer.sidecar.nixl_memory import Cleanup


class _Arena:
    def __init__(self, vram: bool = False) -> None:
        self.tensor: Any = object() if vram else None


@pytest.fixture
def blocked(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """GatherJob.copy replaced by one that waits for ``go`` (and notes which thread ran it)."""
    state: dict[str, Any] = {"started": threading.Event(), "go": threading.Event(), "threads": []}

    def copy(job: ns.GatherJob) -> None:
        state["threads"].append(threading.current_thread().name)
        state["started"].set()
        assert state["go"].wait(10)

    monkeypatch.setattr(ns.GatherJob, "copy", copy)
    return state


def test_a_rank_unregistered_during_its_gather_keeps_its_memory_until_the_copy_ended(
        blocked: dict[str, Any]) -> None:
    nixl_thread: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (what the copier hands back to it)
    cleanup = Cleanup()
    gathers = ns.Gathers(cleanup, nixl_thread.put)
    job = ns.GatherJob(_Arena(), 0, [], ["rank-a", "rank-b"])  # type: ignore[arg-type]
    running = gathers.start(job)
    assert running is not None
    assert blocked["started"].wait(10)
    released: list[str] = []
    # what NixlPort._unregister does: its memory goes once its reads and its gathers settled
    cleanup.after(gathers.pinned("rank-a"), lambda: released.append("rank-a"))
    assert released == [], "the rank's memory was let go while a gather copied from it"
    blocked["go"].set()
    running.result(10)
    assert released == []  # (unpinned on the NIXL thread, not the copier's)
    nixl_thread.get(timeout=10)()
    assert released == ["rank-a"]
    assert gathers.pinned("rank-a") == gathers.pinned("rank-b") == set()
    assert blocked["threads"] == ["kvxfer-gather_0"]
    gathers.close()


def test_an_unregister_with_no_gather_running_lets_go_at_once() -> None:
    cleanup = Cleanup()
    gathers = ns.Gathers(cleanup, lambda fn: fn())
    released: list[str] = []
    cleanup.after(gathers.pinned("rank-a"), lambda: released.append("rank-a"))
    assert released == ["rank-a"]


def test_vram_gathers_stay_on_the_nixl_thread(blocked: dict[str, Any]) -> None:
    blocked["go"].set()
    gathers = ns.Gathers(Cleanup(), lambda fn: pytest.fail("nothing to hand back"))
    assert gathers.start(ns.GatherJob(_Arena(vram=True), 0, [], ["rank-a"])) is None  # type: ignore[arg-type]
    assert blocked["threads"] == [threading.current_thread().name]
    assert gathers.pinned("rank-a") == set()


def test_shutdown_waits_for_the_copy_then_lets_its_ranks_go(blocked: dict[str, Any]) -> None:
    cleanup = Cleanup()
    gathers = ns.Gathers(cleanup, lambda fn: None)  # (the NIXL thread is stopping: never runs them)
    gathers.start(ns.GatherJob(_Arena(), 0, [], ["rank-a"]))  # type: ignore[arg-type]
    assert blocked["started"].wait(10)
    released: list[str] = []
    cleanup.after(gathers.pinned("rank-a"), lambda: released.append("rank-a"))
    closing = threading.Thread(target=gathers.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()  # (waits for the copy)
    assert released == []
    blocked["go"].set()
    closing.join(10)
    assert released == ["rank-a"]


def test_a_gather_given_up_before_it_started_is_unpinned(blocked: dict[str, Any]) -> None:
    """A gather queued behind another and cancelled by its caller never copies; its ranks
    must not stay pinned (an unregister would keep their memory until shutdown)."""
    nixl_thread: queue.SimpleQueue[Any] = queue.SimpleQueue()
    gathers = ns.Gathers(Cleanup(), nixl_thread.put)
    first = gathers.start(ns.GatherJob(_Arena(), 0, [], ["rank-a"]))  # type: ignore[arg-type]
    assert blocked["started"].wait(10)
    second = gathers.start(ns.GatherJob(_Arena(), 0, [], ["rank-b"]))  # type: ignore[arg-type]
    assert second is not None
    assert first is not None
    assert second.cancel()
    nixl_thread.get(timeout=10)()  # (the cancelled one's unpin)
    assert gathers.pinned("rank-b") == set()
    assert gathers.pinned("rank-a") != set()
    blocked["go"].set()
    first.result(10)
    nixl_thread.get(timeout=10)()
    assert gathers.pinned("rank-a") == set()
    gathers.close()


def test_the_port_keeps_a_rank_unregistered_mid_gather_until_its_copy_ended(blocked: dict[str, Any]) -> None:
    """``NixlPort._unregister`` hands its registrations the rank's running gathers with its
    failed reads: the memory is released only once both settled."""
    from kvxfer.sidecar.nixl_port import NixlPort
    from kvxfer.sidecar.nixl_types import TransferOptions

    class Regs:
        local = {"rank-a": object()}
        settling: set[str] | None = None

        def unregister(self, key: Any, settling: set[str]) -> None:
            self.settling = settling

    class Reads:
        def fail_where(self, match: Any, code: str, reason: str) -> set[str]:
            return {"decode/0/0:req-1"}

    port = NixlPort("test-agent", TransferOptions())
    regs, nixl_thread = Regs(), queue.SimpleQueue()  # type: ignore[var-annotated]
    port._regs, port._reads = regs, Reads()  # type: ignore[assignment]
    port._gathers = ns.Gathers(Cleanup(), nixl_thread.put)
    running = port._gathers.start(ns.GatherJob(_Arena(), 0, [], ["rank-a"]))  # type: ignore[arg-type]
    assert blocked["started"].wait(10)
    assert port._unregister("rank-a")
    assert regs.settling is not None
    assert "decode/0/0:req-1" in regs.settling
    assert any(t.startswith("gather#") for t in regs.settling), regs.settling
    blocked["go"].set()
    assert running is not None
    running.result(10)
    port._gathers.close()
