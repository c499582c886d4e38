"""Two decode engines behind one decode sidecar (vLLM DP ranks: one agent name) reading the
same prefill request (a router's retry on another DP rank). The prefill named a reader by its
sidecar and rank only, so the two were one reader (a review): one engine's final notice freed
the other's staging slot while it was read (the next request's gather landed there: wrong KV,
delivered, since a staged landing has no lease word), and ended the lease under the other's
read; and the decode put both engines' rank 0 into one ``StageRequest`` (refused: readers
must be distinct). A reader is now (agent, decode engine, pp, tp): ``ReadNotice.reader_engine``,
and a slot's readers "pp/tp@engine" at a prefill whose ``Welcome`` says ``reader_engines``."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types
from typing import Any

import msgspec
import pytest

from kvxfer.protocol import ReadNotice, Recv, Staged, encode
from kvxfer.testing.engine import SyntheticEngine
from kvxfer.testing.procs import SidecarFactory, free_port
from tests.test_cancel_staged import _stage_server
from tests.test_faults import remote_of
from tests.test_push import LAYOUT, STAGED
from tests.test_security import _holds
from tests.test_sidecar import wait_for


def _notice(engine: str, *, started: bool = False) -> bytes:
    return encode(ReadNotice(req_id="r", tp_rank=0, ok=True, readers=1, engine_id="e", token="tok",
                             reading_s=5.0 if started else 0.0, reader_engine=engine))


def test_one_decode_engine_finishing_does_not_end_the_lease_under_the_others_read() -> None:
    h, sent, _ = _holds()
    h.on_notice("d", _notice("dec_dp1", started=True))  # dec_dp1 reads
    h.on_notice("d", _notice("dec_dp0"))  # dec_dp0's read settled
    assert ("e", "r") in h.table, "the lease ended under dec_dp1's read"
    h.on_notice("d", _notice("dec_dp1"))
    assert ("e", "r") not in h.table
    assert sent, "the engine was not told"


def test_one_decode_engines_final_notice_frees_its_own_slot_only() -> None:
    async def gather(ranks: Any, blocks: Any, offset: int, nbytes: int, device: int) -> None:
        return None

    async def run() -> tuple[Staged, Staged, Staged, int]:
        server, req = _stage_server(gather)
        first = await server.answer(msgspec.structs.replace(req, readers=["0/0@dec_dp0"]))
        second = await server.answer(msgspec.structs.replace(req, seq=2, readers=["0/0@dec_dp1"]))
        server.on_notice("d", encode(ReadNotice(req_id="x", tp_rank=0, ok=True, readers=1, engine_id="p",
                                                reader_engine="dec_dp0")))  # dec_dp0's read settled
        slots = server.slots
        third = await server.answer(msgspec.structs.replace(req, seq=3, req_id="y"))  # another request
        return first, second, third, slots

    first, second, third, slots = asyncio.run(run())
    assert first.held == second.held == third.held == "held"
    assert first.addr != second.addr, "dec_dp1's request took dec_dp0's slot"
    assert slots == 1, "dec_dp1's slot was freed by dec_dp0's notice"
    assert third.addr != second.addr, "another request was gathered into the slot dec_dp1 reads"


@pytest.mark.parametrize("apart", [True, False], ids=["reader-engines", "older-prefill"])
def test_the_ranks_of_two_local_engines_never_ask_in_one_stage_request(apart: bool) -> None:
    """At a prefill that tells readers apart by engine, each engine's rank asks apart; at an
    older one they ask as one (refused there: readers must be distinct), as before: apart,
    both named "0/0", each would free the other's slot there (a review)."""
    from kvxfer.config import Config
    from kvxfer.sidecar.staged_reads import Prepared, Staging

    sent: list[Any] = []

    async def call_peer(host: str, port: int, req: Any, wait_s: float) -> Staged:
        sent.append(req)
        return Staged(seq=0, held="held", addr=0, nbytes=req.nbytes, ttl_s=5.0)

    async def run() -> list[Any]:
        st = Staging(Config(), types.SimpleNamespace(call_peer=call_peer), types.SimpleNamespace(),  # type: ignore[arg-type]
                     types.SimpleNamespace(spans={}), "d")
        peer = types.SimpleNamespace(reader_engines=apart, outdated_by=lambda generation: False)
        asks = []
        for engine in ("dec_dp0", "dec_dp1"):
            prepared = Prepared(plan=types.SimpleNamespace(nbytes=4096), offset=0, ranks=[], expected=2,  # type: ignore[arg-type]
                                reader_engine=engine)
            msg = Recv(req_id="r", block_ids=[1], remote_engine_id="p", remote_host="h", remote_port=1,
                       remote_block_ids=[1], tp_rank=0, engine_id=engine, remote_token="t")
            asks.append(asyncio.ensure_future(st.ask(msg, "p", prepared, 5.0, peer, lambda _h: None)))  # type: ignore[arg-type]
        return list(await asyncio.gather(*asks, return_exceptions=True))

    got = asyncio.run(run())
    assert not any(isinstance(g, Exception) for g in got), got
    want = [["0/0@dec_dp0"], ["0/0@dec_dp1"]] if apart else [["0/0", "0/0"]]
    assert sorted(r.readers for r in sent) == want


def test_two_decode_engines_of_one_sidecar_read_one_request_staged(sidecars: SidecarFactory) -> None:
    """Real sidecars: DP engines dec_dp0 and dec_dp1 of one decode sidecar read the same
    prefill request at once, staged: both land the prefill's bytes, and each slot is freed by
    its own reader's final notice (the names agree end to end), long before its time to live."""
    ds = sidecars.start("readers-d", *STAGED, "--verify-sample", "0", metrics_port=free_port())
    ps = sidecars.start("readers-p", *STAGED, metrics_port=free_port())
    p = SyntheticEngine(LAYOUT, ps.endpoint, seed=1)
    ds_eng = [SyntheticEngine(LAYOUT, ds.endpoint, seed=2 + k, engine_id=f"dec_dp{k}", dp_rank=k)
              for k in (0, 1)]
    try:
        p.start()
        for d in ds_eng:
            d.start()
        delivered = 0
        for attempt in range(3):
            name, tok = f"both-{attempt}", f"tok-{attempt}"
            pb = p.allocate(4)
            p.fill(name, pb)
            p.client.hold(name, pb, token=tok, reads=1, expires_unix=time.time() + 60)
            dbs = [d.allocate(4) for d in ds_eng]
            for d, db in zip(ds_eng, dbs, strict=True):
                d.client.recv(name, db, dataclasses.replace(remote_of(p, pb), token=tok), deadline_s=30,
                              engine_id=d.engine_id)
            for d, db in zip(ds_eng, dbs, strict=True):
                got = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=30)
                if got.done:  # (or the lease ended when the other engine's read settled first)
                    assert d.verify(name, db), "a decode engine delivered other bytes"
                    delivered += 1
                d.free(db)
            end = time.monotonic() + 5
            while ps.scrape()["kvxfer_staging_slots"] and time.monotonic() < end:
                time.sleep(0.05)
            assert ps.scrape()["kvxfer_staging_slots"] == 0, "a slot outlived its reader's final notice"
            p.client.release(name)
            p.free(pb)
        assert delivered >= 3, "fewer reads delivered than requests"
        assert ds.scrape()['kvxfer_staged_receives{how="slot"}'] >= 3  # (they were staged)
    finally:
        for d in ds_eng:
            d.close()
        p.close()


def test_an_unregistered_ranks_receives_and_leases_end_with_it() -> None:
    """``Unregister`` removed the rank and left its receives (handshaking, waiting for a Hold or
    a staged copy, following a push) and its engine's leases: a new registration of the key
    found no entry to cancel them for, and they planned against, and wrote into, the new
    memory (a review)."""
    from unittest import mock

    from kvxfer.errors import ErrorCode
    from kvxfer.protocol import RankInfo, RegisterKV, Unregister
    from kvxfer.sidecar.engines import Engines
    from kvxfer.sidecar.ownership import UNKNOWN
    from kvxfer.sidecar.registry import RankKey, RankRegistry
    from kvxfer.testing.engine import make_layout

    class Memory:
        async def register(self, key: object, msg: RegisterKV, holder: object) -> RankInfo:
            return RankInfo(layout=msg.layout, regions=[])

        async def unregister(self, key: object) -> bool:
            return True

    async def run() -> tuple[Any, Any]:
        reg = RankRegistry("e", Memory())  # type: ignore[arg-type]
        receiver, holds = mock.MagicMock(), mock.MagicMock()
        receiver.cancel = mock.AsyncMock(return_value=0)
        holds.end_engine.return_value = 0
        engines = Engines(config=mock.MagicMock(engine_ownership="process"), registry=reg, receiver=receiver,
                          holds=holds, pools=None, abandoned=mock.MagicMock(), server=mock.MagicMock(),
                          observer=mock.MagicMock(), advertised=mock.MagicMock())
        lay = make_layout(layers=1, num_blocks=4, heads=1, head_dim=8)
        await reg.register(RegisterKV(layout=lay, memory=[], regions=[], engine_id="x"), b"a", None)
        await engines.unregister(b"a", Unregister(tp_rank=0, engine_id="x"), UNKNOWN)
        return receiver.cancel.await_args_list, holds.end_engine.call_args_list

    cancels, ends = asyncio.run(run())
    key = RankKey("x", 0, 0, 0)
    assert [(c.args[1], c.kwargs.get("rank")) for c in cancels] == [(ErrorCode.NOT_REGISTERED, key)]
    assert [c.args for c in ends] == [("x",)]
