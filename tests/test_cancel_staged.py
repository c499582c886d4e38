"""A staged receive cancelled while its StageRequest is out (#36's Cancel, #35's staged
reads): the prefill's answer that comes back while the cancel is with the NIXL port must not
post the read. The cancel found nothing posted, so the engine is told `cancelled` and frees
the blocks; a read posted after that would land (and scatter) into blocks vLLM reuses. Found
by a review; the port is a recording one (the order of its commands is the point here: the
real port runs them first-in first-out on its thread, one hop after the loop asks)."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest import mock

import pytest

from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Observer
from kvxfer.protocol import Recv
from kvxfer.sidecar import receiver as receiver_mod
from kvxfer.sidecar.receive import Receive
from kvxfer.sidecar.receiver import Receiver
from kvxfer.sidecar.recv_state import RecvState
from kvxfer.sidecar.registry import RankKey


class RecordingPort:
    """What the loop asked of NIXL, in order; a cancel is answered once the test lets it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.cancel_may_answer = asyncio.Event()
        self.spans: dict[int, tuple[int, int]] = {}  # (no staging arenas)
        self.notes: list[tuple[str, bytes]] = []  # notifications sent (read notices)

    async def cancel(self, key: str, code: str, reason: str) -> bool:
        self.calls.append("cancel")
        found = "read" in self.calls  # (it runs before whatever the loop asks after it)
        await self.cancel_may_answer.wait()
        return found

    def read(self, spec: Any) -> None:
        self.calls.append("read")

    def notify_soon(self, agent: str, payload: bytes) -> None:
        self.notes.append((agent, payload))


def staged_receive(port: RecordingPort, sent: list[Any], peer_agent: str = "") -> tuple[Receiver, RecvState]:
    """A receiver with stand-ins for its parts, and its receive ``k`` of request r1, staged:
    its StageRequest is out, nothing posted (READING)."""
    rx = Receiver(config=Config(), registry=mock.MagicMock(), peers=mock.MagicMock(),
                  book=mock.MagicMock(), nixl=port, observer=Observer(),  # type: ignore[arg-type]
                  send=lambda owner, msg: sent.append(msg), spawn=asyncio.ensure_future, agent_name="d")
    rx.registry.get.return_value = None  # type: ignore[attr-defined]  # (the rank's layout: not needed)
    rx.staging = mock.MagicMock()
    rx.staging.settle = mock.AsyncMock()  # (no window read in flight)
    msg = Recv(req_id="r1", block_ids=[3, 4], remote_engine_id="p", remote_host="h", remote_port=9,
               remote_block_ids=[5, 6])
    machine = Receive("r1")
    machine.start(False, 10.0)
    state = RecvState(owner=b"e", msg=msg, nbytes=1, started=0.0, deadline=1e12, local=RankKey("d", 0, 0, 0),
                      machine=machine, peer_agent=peer_agent)
    rx.recvs["k"] = state
    return rx, state


def answered() -> asyncio.Future[Any]:
    """A StageRequest's task, done (what ``read_after`` makes of it is the test's stand-in)."""
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


@pytest.mark.parametrize("room", [True, False], ids=["slot", "no-room-direct"])
def test_a_staged_answer_that_comes_back_during_the_cancel_posts_nothing(room: bool) -> None:
    """Either answer: a slot to read, or no room there (read directly, and claim)."""

    async def run() -> tuple[list[str], list[Any], Any]:
        port, sent = RecordingPort(), []
        rx, state = staged_receive(port, sent)
        rx.feed.settle = mock.AsyncMock()  # type: ignore[method-assign]
        if not room:  # (its answer: a slot to read, whatever it holds, or none)
            rx.staging.read_after.return_value = None
        rx.claims = mock.MagicMock()
        err = RequestError(ErrorCode.CANCELLED, "dropped", "r1")
        cancelling = asyncio.ensure_future(rx._cancel("k", err))
        await asyncio.sleep(0)  # (the cancel is with the port)
        with mock.patch.object(receiver_mod, "read_spec", return_value="spec"):
            rx._staged("k", state, mock.MagicMock(), [], mock.MagicMock(), mock.MagicMock(), answered())
        port.cancel_may_answer.set()
        await cancelling
        return port.calls, sent, rx.claims

    calls, sent, claims = asyncio.run(run())
    assert [type(m).__name__ for m in sent] == ["Failed"], sent
    assert sent[0].code == ErrorCode.CANCELLED, sent
    assert "read" not in calls, f"a read was posted after its cancel found none: {calls}"
    assert not claims.start.called, "a claim (it extends the prefill's lease) for a cancelled receive"


def test_a_cancel_waits_for_the_window_read_in_flight_and_posts_no_other() -> None:
    """A read in windows (``staged_windows.Windows``): a cancel while window 2 is being read
    cancels that read and returns only once it settled (its scatter can no longer land in
    blocks the engine got back); no window is posted after it."""
    from kvxfer.sidecar.nixl_types import ReadFinished
    from kvxfer.sidecar.staged_windows import Windows

    async def run() -> list[str]:
        calls: list[str] = []
        windows: Windows

        class Port:
            def read(self, spec: Any) -> None:
                calls.append(f"read {spec}")

            async def cancel(self, rid: str, code: str, reason: str) -> bool:
                calls.append(f"cancel {rid}")
                await asyncio.sleep(0.01)  # (the NIXL thread settles it a little later)
                asyncio.get_running_loop().call_later(0.01, lambda: windows.landed(
                    ReadFinished(rid, "p", False, 0, 0.0, code=code, reason=reason)))
                return True

        windows = Windows("k", lambda st, rid: rid, Port())  # type: ignore[arg-type]
        first = asyncio.ensure_future(windows.read(0, mock.MagicMock()))
        await asyncio.sleep(0)
        rid0 = calls[-1].removeprefix("read ")
        assert rid0.startswith("k#w0#")  # (the receive's key, the window, a number of its own)
        assert windows.landed(ReadFinished(rid0, "p", True, 10, 0.0, descriptors=1))
        await first
        second = asyncio.ensure_future(windows.read(1, mock.MagicMock()))
        await asyncio.sleep(0)
        await windows.settle(RequestError(ErrorCode.CANCELLED, "dropped"))
        calls.append("settled")
        assert second.done()
        with pytest.raises(RequestError, match="dropped"):
            second.result()
        with pytest.raises(RequestError, match="cancelled"):
            await windows.read(2, mock.MagicMock())
        assert windows.moved == (10, 1)
        assert not windows.landed(ReadFinished(rid0, "p", True, 1, 0.0))  # (not its read now)
        return [c.rsplit("#", 1)[0] for c in calls]

    assert asyncio.run(run()) == ["read k#w0", "read k#w1", "cancel k#w1", "settled"]


def test_a_window_that_fails_once_posted_fails_the_receives_read_and_tells_the_prefill() -> None:
    """A read in windows whose second window failed (a dead peer, an expired slot): the
    receive ends as a failed read, not as one that never started: the engine gets ``Failed``
    with the read's code, and the prefill a ``ReadNotice(ok=False)`` (it frees its slot and
    ends its lease as aborted, where 'not started' told it nothing and left both to expire)."""
    from kvxfer.protocol import ReadNotice, read_notice_decoder
    from kvxfer.sidecar.nixl_types import ReadFinished
    from kvxfer.sidecar.staged_windows import WindowFailed

    async def run() -> tuple[list[Any], list[tuple[str, bytes]]]:
        port, sent = RecordingPort(), []
        rx, state = staged_receive(port, sent, peer_agent="p-agent")
        event = ReadFinished("k", "p-agent", False, 0, 0.5, code=ErrorCode.TRANSFER_ERROR,
                             reason="window 2: remote access error")
        rx.staging.read_after.side_effect = WindowFailed(event)
        rx._staged("k", state, mock.MagicMock(), [], mock.MagicMock(), mock.MagicMock(), answered())
        return sent, port.notes

    sent, notes = asyncio.run(run())
    assert [type(m).__name__ for m in sent] == ["Failed"], sent
    assert sent[0].code == ErrorCode.TRANSFER_ERROR, sent
    assert "window 2" in sent[0].reason
    assert len(notes) == 1, notes
    notice = read_notice_decoder.decode(notes[0][1])
    assert isinstance(notice, ReadNotice)
    assert notes[0][0] == "p-agent"
    assert notice.ok is False


def test_a_vram_read_the_prefill_has_no_room_for_asks_again_then_reads_directly() -> None:
    """A VRAM receive whose StageRequest finds the prefill's arena full asks again (read
    directly it would crawl over tcp, ~100x slower: README "GPU paths"), for VRAM_WAIT_S at
    most, then reads directly; a host one reads directly at once, as before."""
    import types

    import numpy as np

    from kvxfer.protocol import Staged
    from kvxfer.sidecar import staged_reads
    from kvxfer.sidecar.staged_reads import Prepared, Staging
    from kvxfer.sidecar.staging import StagedPlan

    held = Staged(seq=1, held="held", addr=4096, nbytes=10, ttl_s=5.0)
    msg = Recv(req_id="r1", block_ids=[3], remote_engine_id="p", remote_host="h", remote_port=9,
               remote_block_ids=[5])

    def ask(device: int, answers: list[Any]) -> tuple[Any, int, Staging]:
        port = types.SimpleNamespace(spans={})
        st = Staging(Config(), mock.MagicMock(), mock.MagicMock(), port, "d")  # type: ignore[arg-type]
        st._ask = mock.AsyncMock(side_effect=answers)  # type: ignore[method-assign]
        plan = StagedPlan(10, [], np.empty((0, 3), np.int64), 0)
        prepared = Prepared(plan, 0, [], expected=1, device=device)
        got = asyncio.run(st.ask(msg, "p", prepared, 30.0, mock.MagicMock(), lambda m: None))
        return got, st._ask.call_count, st

    got, calls, st = ask(0, [(None, 0.0), (None, 0.0), (held, 1.0)])
    assert (got, calls, st.fell_back, st.staged) == ((held, 1.0), 3, 0, 1)
    with mock.patch.object(staged_reads, "VRAM_WAIT_S", 0.05):
        got, calls, st = ask(0, [(None, 0.0)] * 100)
    assert got == (None, 0.0)
    assert 2 <= calls < 20, calls  # (asked again for 50 ms, backing off from 2 ms)
    assert st.fell_back == 1
    got, calls, st = ask(-1, [(None, 0.0)] * 3)  # host memory: the batch path, no second ask
    assert (got, calls, st.fell_back) == ((None, 0.0), 1, 1)


def _stage_server(gather: Any) -> tuple[Any, Any]:
    """A prefill's StageServer over a host arena whose copies are ``gather``, a lease that
    holds, one registered rank; and a reader's StageRequest of 4 KiB of it."""
    import types

    import numpy as np

    from kvxfer.protocol import KVLayout, RankInfo, RemoteRegion, StageRank, StageRequest
    from kvxfer.sidecar.stage_server import StageServer

    nixl = types.SimpleNamespace(spans={-1: (1 << 30, 1 << 20)}, gather=gather, expect_reads=lambda: None)
    holds = mock.MagicMock()
    holds.renew.return_value = types.SimpleNamespace(held=["held"])
    holds.lease_for.return_value = types.SimpleNamespace(engine="p", block_ids=[1, 2])
    info = RankInfo(layout=mock.MagicMock(spec=KVLayout), regions=[RemoteRegion(addr=0, block_len=8,
                                                                                block_stride=8)])
    registry = mock.MagicMock()
    registry.find.return_value = types.SimpleNamespace(key="rank0", info=info)
    server = StageServer(holds=holds, registry=registry, nixl=nixl,  # type: ignore[arg-type]
                         generation=lambda: "g")
    runs = np.array([[0, 4096]], dtype="<i8").tobytes()
    req = StageRequest(seq=1, engine_id="p", req_id="x", ranks=[StageRank(rank=0, runs=runs)],
                       nbytes=4096, readers=["0/0"], extend_s=5.0, agent_name="d", token="t")
    return server, req


def test_a_reader_asking_again_while_its_slot_is_being_filled_is_told_busy() -> None:
    """The prefill's half: a reader's repeat StageRequest gives its slot up for the new one
    (a read in windows), but never while that slot is being filled: the copy would run into a
    slot freed under it, and the first request's failure path could free the second's."""

    async def run() -> list[str]:
        copying = asyncio.Event()
        release = asyncio.Event()
        held = []

        async def gather(ranks: Any, blocks: Any, offset: int, nbytes: int, device: int) -> None:
            held.append(f"gather at {offset}")
            copying.set()
            await release.wait()

        server, req = _stage_server(gather)
        first = asyncio.ensure_future(server.answer(req))
        await copying.wait()
        again = await asyncio.wait_for(server.answer(req), 2.0)  # (not a second copy into that slot)
        held.append(f"again {again.held}")
        release.set()
        got = await first
        held.append(f"first {got.held}, {server.slots} slot")
        third = await server.answer(req)  # (its read of the first is done: it asks for the next)
        release.set()
        held.append(f"third {third.held}, {server.slots} slot")
        return held

    assert asyncio.run(run()) == ["gather at 0", "again busy", "first held, 1 slot", "gather at 0",
                                  "third held, 1 slot"]


def test_a_final_notice_during_the_copy_frees_the_slot_after_it_not_under_it() -> None:
    """The reader's final ReadNotice (it gave the request up: its StageRequest timed out)
    arrives while its slot is being filled: the slot used to be freed under the copy (another
    request could be handed it and gathered into at once); it is now freed once the copy
    ended, and the answer says busy."""
    import msgspec

    from kvxfer.protocol import ReadNotice

    async def run() -> list[str]:
        copying, release = asyncio.Event(), asyncio.Event()
        seen = []

        async def gather(ranks: Any, blocks: Any, offset: int, nbytes: int, device: int) -> None:
            copying.set()
            await release.wait()

        server, req = _stage_server(gather)
        first = asyncio.ensure_future(server.answer(req))
        await copying.wait()
        notice = ReadNotice(engine_id="p", req_id="x", pp_rank=0, tp_rank=0, ok=False)
        server.on_notice("d", msgspec.msgpack.encode(notice))
        seen.append(f"during the copy: {server.slots} slot")
        release.set()
        got = await first
        seen.append(f"after: {got.held}, {server.slots} slot")
        return seen

    assert asyncio.run(run()) == ["during the copy: 1 slot", "after: busy, 0 slot"]


def test_a_window_read_is_routed_to_its_receive_whatever_the_request_id_holds() -> None:
    """Window read ids are ``<receive key>#w<i>#<n>``; a request id is the engine's and may
    itself hold "#w": the landing still goes to that receive's windows (it went nowhere, and
    the receive waited for its window until its deadline)."""
    import types

    from kvxfer.sidecar.nixl_types import ReadFinished
    from kvxfer.sidecar.staged_reads import Prepared, Staging

    async def run() -> bool:
        port = types.SimpleNamespace(spans={}, read=lambda spec: None)
        st = Staging(Config(), mock.MagicMock(), mock.MagicMock(), port, "d")  # type: ignore[arg-type]
        key = "e/0/0:chat#w3"
        prepared = Prepared(mock.MagicMock(), 0, [], expected=1, windows=((mock.MagicMock(), []),))
        windows = st.windows_for(key, prepared, lambda staged, rid: rid)
        assert windows is not None
        reading = asyncio.ensure_future(windows.read(0, mock.MagicMock()))
        await asyncio.sleep(0)
        assert windows._in_flight is not None
        rid = windows._in_flight[0]
        assert rid.startswith(key + "#w0#")
        routed = st.landed(ReadFinished(rid, "p", True, 8, 0.0, descriptors=1))
        await asyncio.wait_for(reading, 1.0)
        return routed

    assert asyncio.run(run())


def test_a_cancel_whose_caller_gives_up_still_ends_the_receive() -> None:
    """An operator's CancelTransfer (or a Drain's cancel step) is cancelled while the receive's
    cancel waits for the port (the client's deadline, Ctrl-C): the receive had been marked
    stopping, so its staged answer was then ignored, and nothing ever ended it: no Done or
    Failed for its engine, its slot held, the sidecar never idle (found by a review)."""

    async def run() -> tuple[bool, list[Any]]:
        port, sent = RecordingPort(), []
        rx, state = staged_receive(port, sent, peer_agent="p-agent")
        rpc = asyncio.ensure_future(rx.cancel("r1"))  # (the gRPC handler's await)
        await asyncio.sleep(0)
        rpc.cancel()  # the caller gave up
        await asyncio.sleep(0.01)
        port.cancel_may_answer.set()
        rx._staged("k", state, mock.MagicMock(), [], mock.MagicMock(), mock.MagicMock(), answered())
        await asyncio.sleep(0.05)
        return "k" in rx.recvs, sent

    stuck, sent = asyncio.run(run())
    assert not stuck, "the receive is still in flight, and nothing will end it"
    assert [type(m).__name__ for m in sent] == ["Failed"]


def test_a_staged_receive_that_fails_after_asking_tells_the_prefill() -> None:
    """A staged receive whose StageRequest was sent and then failed (no answer in time, a
    window refused or gone, the post refused) ended as "not started", which tells the prefill
    nothing: its slot, possibly reserved, and its lease waited for their time to run out, a
    VRAM arena's half for ~36 s (found by a review). It is told this reader will not read."""

    async def run() -> tuple[list[Any], list[Any]]:
        port, sent = RecordingPort(), []
        rx, state = staged_receive(port, sent, peer_agent="p-agent")
        rx.staging.read_after.side_effect = RequestError(ErrorCode.HANDSHAKE_FAILED, "no answer in 30s")
        rx._staged("k", state, mock.MagicMock(), [], mock.MagicMock(), mock.MagicMock(), answered())
        return sent, port.notes

    sent, notes = asyncio.run(run())
    assert [type(m).__name__ for m in sent] == ["Failed"]
    assert len(notes) == 1, "the prefill was not told: its slot and lease wait for their time to run out"
