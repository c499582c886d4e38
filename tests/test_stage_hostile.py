"""A decode that lies in its ``StageRequest`` (#35): the prefill sidecar copies only bytes of
blocks it holds for that very request and that reader (runs outside them, other requests'
blocks, unknown ranks, a wrong token: refused or looks like nothing), and what it does copy
is exactly the held bytes (read back through NIXL from the slot it names)."""

from __future__ import annotations

import time

import numpy as np

from kvxfer.auth import new_token, sign_request
from kvxfer.errors import ErrorCode
from kvxfer.protocol import Refused, Staged, StageRank, StageRequest
from kvxfer.testing.procs import SidecarFactory
from tests.test_hostile_peer import SECRET, LyingDecode, _engine, _wait_metric
from tests.test_hostile_peer import secret_file as secret_file  # (a fixture)


def _runs(*pairs: tuple[int, int]) -> bytes:
    return np.array(pairs, dtype="<i8").reshape(-1, 2).tobytes()


def _read(agent: object, remote: str, addr: int, n: int) -> bytes:
    """READ n bytes at the peer's ``addr`` through NIXL into a fresh local buffer."""
    buf = np.zeros(n, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, n, 0, "")], "DRAM")  # type: ignore[attr-defined]
    try:
        h = agent.initialize_xfer(  # type: ignore[attr-defined]
            "READ", agent.get_xfer_descs(np.array([[buf.ctypes.data, n, 0]]), "DRAM"),  # type: ignore[attr-defined]
            agent.get_xfer_descs(np.array([[addr, n, 0]]), "DRAM"), remote)  # type: ignore[attr-defined]
        state, end = agent.transfer(h), time.monotonic() + 10  # type: ignore[attr-defined]
        while state == "PROC" and time.monotonic() < end:
            time.sleep(0.001)
            state = agent.check_xfer_state(h)  # type: ignore[attr-defined]
        assert state == "DONE", state
        agent.release_xfer_handle(h)  # type: ignore[attr-defined]
        return buf.tobytes()
    finally:
        agent.deregister_memory(reg)  # type: ignore[attr-defined]


def test_a_lying_stage_request_copies_nothing_it_was_not_given(factory: SidecarFactory,
                                                               secret_file: str) -> None:
    ps, p = _engine(factory, "sp", secret_file, 1, "--staging-mib", "16")
    liar = None
    try:
        liar = LyingDecode(p.registered.handshake_port, "stage-liar")  # type: ignore[union-attr]
        welcome = liar.handshake()
        assert welcome.staging_bytes > 0  # the Welcome offers its arena
        region = welcome.ranks[0].regions[0]
        token = new_token()
        x, other = p.allocate(2), p.allocate(1)
        p.fill("x", x)
        p.fill("other", other)
        p.client.hold("x", x, lease_s=60, token=token)
        p.client.hold("other", other, lease_s=60, token=new_token())
        _wait_metric(ps, "kvxfer_held_leases", 2, "the holds")

        def block(b: int, off: int = 0) -> int:
            return region.addr + b * region.block_stride + off

        seq = iter(range(1, 100))

        def stage(runs: bytes, nbytes: int, rank: int = 0, tok: str = token, **kw: object) -> object:
            ranks = [StageRank(rank=rank, runs=runs)]
            req = StageRequest(seq=next(seq), engine_id="", req_id="x", ranks=ranks,
                               nbytes=nbytes, readers=["0/0"], extend_s=5.0, agent_name=liar.agent_name,
                               token=tok)
            req = sign_request(SECRET, req) if kw.get("sign", True) else req
            return liar.ask(req)

        n = region.block_len
        edge = next(b for b in x if b + 1 not in x)  # (the block after it is not held)
        refusals = [
            (_runs((block(other[0]), n)), n, 0, ErrorCode.BLOCK_OUT_OF_RANGE),  # another request's block
            (_runs((block(edge, n - 8), 16)), 16, 0, ErrorCode.BLOCK_OUT_OF_RANGE),  # past the block's end
            (_runs((region.addr - 4096, 64)), 64, 0, ErrorCode.BLOCK_OUT_OF_RANGE),  # before the region
            (_runs((block(x[0]), n)), n, 5, ErrorCode.NOT_REGISTERED),  # a rank that does not exist
            (_runs((block(x[0]), n)), n + 1, 0, ErrorCode.MALFORMED),  # a slot size that does not add up
            (b"\x00" * 7, 8, 0, ErrorCode.MALFORMED),  # not [address, length] pairs
        ]
        for runs, nbytes, rank, code in refusals:
            got = stage(runs, nbytes, rank)
            assert isinstance(got, Staged), got
            assert (got.held, got.code) == ("refused", code), got
        got = stage(_runs((block(x[0]), n)), n, tok="guess")
        assert isinstance(got, Staged), got
        assert got.held == "unknown", got  # looks like nothing
        got = stage(_runs((block(x[0]), n)), n, sign=False)
        assert isinstance(got, Refused), got
        assert got.code == ErrorCode.UNAUTHORIZED

        # Honest: both held blocks, the second first; the slot holds exactly their bytes.
        runs = _runs((block(x[1]), n), (block(x[0]), n))
        got = stage(runs, 2 * n)
        assert isinstance(got, Staged), got
        assert got.held == "held", got
        assert got.nbytes == 2 * n
        assert got.ttl_s >= 5.0
        slot = _read(liar.agent, liar.remote, got.addr, 2 * n)
        direct = b"".join(_read(liar.agent, liar.remote, block(b), n) for b in (x[1], x[0]))
        assert slot == direct
        assert len(set(slot)) > 1  # (filled, not zeros)
        # the same reader asking again (a read in windows does, once it read its last window):
        # its slot is given up for the new one, never a second one held
        again = stage(runs, 2 * n)
        assert isinstance(again, Staged), again
        assert again.held == "held", again
        assert ps.scrape()["kvxfer_staging_slots"] == 1
        liar.notice(req_id="x", token=token, readers=2)  # its read settled: the slot is free again
        end = time.monotonic() + 10
        while ps.scrape()["kvxfer_staging_slots"] != 0:
            liar.agent.get_new_notifs()
            assert time.monotonic() < end, "the reader's final notice did not free its slot"
            time.sleep(0.05)
    finally:
        if liar is not None:
            liar.close()
        p.close()
