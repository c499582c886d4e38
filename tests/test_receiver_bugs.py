"""A bug in the awaited end of a landed receive (its lease word read again, its integrity
check) fails that receive at once, with ``internal``: it never waits forever. Those run in
tasks whose exceptions nobody sees (found by a review: ``Verifier.verify`` had a line outside
its ``try``, and a raise there left the receive, its staging slot and its engine waiting).
The receiver alone, with stand-ins for the ports: the end-to-end paths are tested elsewhere."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from unittest import mock

from kvxfer.config import Config
from kvxfer.errors import ErrorCode
from kvxfer.protocol import Failed, Recv
from kvxfer.sidecar.receive import Receive
from kvxfer.sidecar.receiver import Receiver
from kvxfer.sidecar.recv_state import RecvState
from kvxfer.sidecar.registry import RankKey


def _receiver() -> tuple[Receiver, list[tuple[bytes, Any]], list[Any]]:
    sent: list[tuple[bytes, Any]] = []
    tasks: list[Any] = []
    r = Receiver(config=Config(), registry=mock.Mock(), peers=mock.Mock(), book=mock.Mock(), nixl=mock.Mock(),
                 observer=mock.Mock(), send=lambda ident, m: sent.append((ident, m)), spawn=tasks.append,
                 agent_name="decode")
    r.staging = mock.Mock()
    return r, sent, tasks


def _state() -> RecvState:
    msg = Recv(req_id="r1", block_ids=[1, 2], remote_engine_id="p", remote_host="127.0.0.1", remote_port=5000,
               remote_block_ids=[3, 4])
    now = time.monotonic()
    return RecvState(owner=b"engine", msg=msg, nbytes=1, started=now, deadline=now + 30.0,
                     local=mock.Mock(spec=RankKey), machine=Receive("r1"))


async def _raises() -> None:
    raise StopIteration  # (what next() on an empty iterator raises: a RuntimeError inside a coroutine)


def test_a_bug_in_an_awaited_end_fails_the_receive_and_frees_its_slot() -> None:
    r, sent, _ = _receiver()
    state = _state()
    r.recvs["k"] = state
    asyncio.run(r._then("k", state, _raises(), lambda got: None))  # type: ignore[arg-type,return-value]
    assert "k" not in r.recvs, "the receive waits on after a bug in its end"
    assert len(sent) == 1
    ident, msg = sent[0]
    assert ident == b"engine"
    assert isinstance(msg, Failed)
    assert msg.code == ErrorCode.INTERNAL
    r.staging.release.assert_called_once_with("k")


def test_an_awaited_end_that_returns_takes_the_machines_step() -> None:
    r, sent, _ = _receiver()
    state = _state()
    r.recvs["k"] = state
    steps: list[Any] = []

    async def returns() -> str:
        return "proof"

    r._step = lambda key, st, step: steps.append((key, step))  # type: ignore[method-assign]
    asyncio.run(r._then("k", state, returns(), lambda got: f"step after {got}"))  # type: ignore[arg-type,return-value]
    assert steps == [("k", "step after proof")]
    assert not sent
