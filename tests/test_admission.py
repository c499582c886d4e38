"""kvxfer.sidecar.admission: every refusal of a Hold, a Recv and a DigestRequest, in memory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import DigestItem, DigestRank, DigestRequest, Hold, KVLayout, Recv
from kvxfer.sidecar.admission import (
    admit_digest,
    admit_hold,
    admit_recv,
    check_blocks,
    recv_bytes,
    recv_deadline_s,
)

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=16, num_kv_heads=2, local_kv_heads=2, head_dim=8,
                  dtype="float16")
STATE = KVLayout(num_layers=2, num_blocks=16, block_size=16, num_kv_heads=2, local_kv_heads=2, head_dim=8,
                 dtype="float16", state_regions=3, state_bytes=100)
NOW = 1_000_000.0


def hold(**kw: object) -> Hold:
    return Hold(**{"req_id": "r", "block_ids": [1, 2], **kw})  # type: ignore[arg-type]


def recv(**kw: object) -> Recv:
    return Recv(**{"req_id": "r", "block_ids": [1, 2], "remote_engine_id": "p", "remote_host": "h",  # type: ignore[arg-type]
                   "remote_port": 1, "remote_block_ids": [3, 4], **kw})


def refused(fn: object, *args: object, **kw: object) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args, **kw)  # type: ignore[operator]
    return e.value


OK_HOLD = {"draining": False, "abandoned": False, "now_unix": NOW, "registered": lambda: ["e"]}
OK_RECV = {"draining": False, "abandoned": False, "now_unix": NOW, "registered": lambda: "e/tp0"}


def test_a_hold_that_fits_is_admitted() -> None:
    admit_hold(hold(expires_unix=NOW + 1), "e", 16, **OK_HOLD)


@pytest.mark.parametrize(("msg", "num_blocks", "changes", "code"), [
    (hold(), 16, {"draining": True}, ErrorCode.DRAINING),
    (hold(), None, {}, ErrorCode.NOT_REGISTERED),
    (hold(block_ids=[15, 16]), 16, {}, ErrorCode.BLOCK_OUT_OF_RANGE),
    (hold(expires_unix=NOW - 0.5), 16, {}, ErrorCode.EXPIRED),
    (hold(), 16, {"abandoned": True}, ErrorCode.EXPIRED),
    # a rank of the engine not registered (yet, after a restart): it would never get the
    # lease's Released, and its worker would keep the blocks for ever (found by a review)
    (hold(), 16, {"missing": 1}, ErrorCode.NOT_REGISTERED),
])
def test_a_hold_is_refused(msg: Hold, num_blocks: int | None, changes: dict[str, object], code: str) -> None:
    err = refused(admit_hold, msg, "e", num_blocks, **{**OK_HOLD, **changes})
    assert err.code == code
    assert err.req_id == "r"


def test_a_recv_that_fits_is_admitted() -> None:
    admit_recv(recv(), "e", LAYOUT, **OK_RECV)
    admit_recv(recv(state_block_ids=[5], remote_state_block_ids=[6]), "e", STATE, **OK_RECV)


@pytest.mark.parametrize(("msg", "layout", "changes", "code"), [
    (recv(), LAYOUT, {"draining": True}, ErrorCode.DRAINING),
    (recv(), None, {}, ErrorCode.NOT_REGISTERED),
    (recv(block_ids=[16]), LAYOUT, {}, ErrorCode.BLOCK_OUT_OF_RANGE),
    (recv(state_block_ids=[99], remote_state_block_ids=[1]), STATE, {}, ErrorCode.BLOCK_OUT_OF_RANGE),
    (recv(state_block_ids=[1, 2], remote_state_block_ids=[1]), STATE, {}, ErrorCode.MALFORMED),
    (recv(state_block_ids=[1], remote_state_block_ids=[1]), LAYOUT, {}, ErrorCode.INVALID_LAYOUT),
    (recv(expires_unix=NOW - 1), LAYOUT, {}, ErrorCode.EXPIRED),
    (recv(), LAYOUT, {"abandoned": True}, ErrorCode.EXPIRED),
])
def test_a_recv_is_refused(msg: Recv, layout: KVLayout | None, changes: dict[str, object], code: str) -> None:
    assert refused(admit_recv, msg, "e", layout, **{**OK_RECV, **changes}).code == code


def test_a_recv_deadline_never_passes_the_engine_giving_up() -> None:
    assert recv_deadline_s(recv(), NOW, 30.0) == 30.0
    assert recv_deadline_s(recv(deadline_s=5.0), NOW, 30.0) == 5.0
    assert recv_deadline_s(recv(deadline_s=5.0, expires_unix=NOW + 2), NOW, 30.0) == pytest.approx(2.0)
    # (the engine's own limit wins over the sidecar's default: it is what the engine waits for)
    assert recv_deadline_s(recv(expires_unix=NOW + 40), NOW, 30.0) == pytest.approx(40.0)
    assert recv_deadline_s(recv(expires_unix=NOW - 3), NOW, 30.0) == 0.001


def test_recv_bytes_counts_attention_and_state_blocks() -> None:
    assert recv_bytes(LAYOUT, 1000, recv()) == 2000
    msg = recv(state_block_ids=[5], remote_state_block_ids=[6])
    assert recv_bytes(STATE, 1000, msg) == 2000 + 3 * 100


@given(st.lists(st.integers(0, 40), max_size=20), st.integers(1, 32))
def test_check_blocks_refuses_exactly_the_ids_outside(ids: list[int], n: int) -> None:
    if all(b < n for b in ids):
        check_blocks("r", ids, n, "local")
    else:
        err = refused(check_blocks, "r", ids, n, "local")
        assert err.code == ErrorCode.BLOCK_OUT_OF_RANGE
        assert str([b for b in ids if b >= n][:8]) in err.reason


def digest_req(*ranks: DigestRank) -> DigestRequest:
    return DigestRequest(req_id="r", ranks=list(ranks))


def lengths(pp: int, tp: int, region0: int) -> int | None:
    return None if tp > 1 else (64 if region0 < 4 else 0)


def test_a_digest_of_held_blocks_is_admitted() -> None:
    admit_digest(digest_req(DigestRank(rank=0, items=[DigestItem(blocks=[1, 2], runs=[[0, 32], [32, 32]])])),
                 {1, 2}, 1, lengths)


@pytest.mark.parametrize(("req", "code"), [
    (digest_req(DigestRank(rank=0, items=[]), DigestRank(rank=0, items=[])), ErrorCode.MALFORMED),
    (digest_req(*(DigestRank(rank=0, items=[], region0=i) for i in range(3))), ErrorCode.MALFORMED),
    (digest_req(DigestRank(rank=0, items=[DigestItem(blocks=[7], runs=[[0, 8]])])),
     ErrorCode.BLOCK_OUT_OF_RANGE),
    (digest_req(DigestRank(rank=0, items=[DigestItem(blocks=[1], runs=[[0]])])), ErrorCode.MALFORMED),
    (digest_req(DigestRank(rank=0, items=[DigestItem(blocks=[1], runs=[[0, 0]])])), ErrorCode.MALFORMED),
    (digest_req(DigestRank(rank=2, items=[DigestItem(blocks=[1], runs=[[0, 8]])])), ErrorCode.NOT_REGISTERED),
    (digest_req(DigestRank(rank=0, items=[DigestItem(blocks=[1] * 33, runs=[[0, 8]])])), ErrorCode.MALFORMED),
    (digest_req(DigestRank(rank=0, items=[DigestItem(blocks=[1], runs=[[0, 40], [0, 40]])])),
     ErrorCode.MALFORMED),
    (digest_req(DigestRank(rank=0, items=[DigestItem(blocks=[1], runs=[[60, 8]])])), ErrorCode.MALFORMED),
    (digest_req(DigestRank(rank=0, region0=5, items=[DigestItem(blocks=[1], runs=[[0, 8]])])),
     ErrorCode.MALFORMED),
])
def test_a_digest_is_refused(req: DigestRequest, code: str) -> None:
    assert refused(admit_digest, req, {1, 2}, 1, lengths).code == code
