"""The connector's block lifecycle against vLLM's scheduler contract: blocks neither pinned
for ever nor handed back while a transfer may still touch them, and no load left waiting.
Each case was found by a review (a helper reading vLLM 0.33's scheduler beside ours) and
shown failing before its fix: a Hold the sidecar refuses (draining) pinned the prefill's
blocks for ever; a streamed request vLLM preempted had its given-up lease reported as a
finished send, which vLLM's scheduler asserts on (the engine core dies); a deferred load
(vLLM 0.33's defer_async_loads) whose prefill lease expired while it waited was neither
posted nor failed."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvxfer.connector.settings import ConnectorSettings
from kvxfer.connector.step import StepPlan
from kvxfer.testing.procs import SidecarFactory


@pytest.fixture
def factory():
    with SidecarFactory() as f:
        yield f


def engine(settings: ConnectorSettings) -> tuple[Any, Any]:
    """A worker with a small KV cache registered with the sidecar, and its scheduler side."""
    import torch

    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.connector.worker import CacheShape, WorkerSide

    ws = WorkerSide(settings, 0, 1, "cpu")
    ctx = ws.mem_pool_context()
    assert ctx is not None
    with ctx:
        kv = {"l0": torch.zeros(2, 8, 16, 8, 64, dtype=torch.float16)}
    ws.register_kv_caches(kv, CacheShape(8, 16, 8, 8, 64, False))
    return ws, SchedulerSide(settings, tp_size=1)


def test_a_hold_the_sidecar_refuses_is_freed(factory: SidecarFactory) -> None:
    """A Hold refused by a live sidecar (here: draining) makes no lease, so no Released ever
    comes; the worker frees holds only for a silent sidecar: vLLM keeps the blocks forever."""
    import grpc

    from kvxfer.control.v1 import control_pb2 as pb
    from kvxfer.control.v1 import control_pb2_grpc as pb_grpc

    sc = factory.start("hr")
    ws, sched = engine(ConnectorSettings(sidecar=sc.endpoint, heartbeat_s=0.1, lease_s=1.0, grace_s=0.5,
                                         settle_s=0.5))
    try:
        res = pb_grpc.ControlStub(grpc.insecure_channel(sc.control)).Drain(pb.DrainRequest(timeout_s=0.2),
                                                                            timeout=10)
        assert res is not None
        req = SimpleNamespace(request_id="r1", kv_transfer_params={"do_remote_decode": True},
                              status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"), num_computed_tokens=32)
        delay, params = sched.request_finished(req, [1, 2])
        assert delay  # vLLM keeps blocks 1, 2 until every worker reports r1 sent
        assert params
        sent: set[str] = set()
        end = time.monotonic() + 6.0  # 4x lease_s + grace_s
        while time.monotonic() < end and "r1" not in sent:
            p = sched.take_plan()
            ws.bind(p.recvs, p.holds, p.failed, p.refused, p.names, p.unheld)  # (as the connector binds)
            sent |= ws.get_transfer_results().finished_sending
            time.sleep(0.05)
        assert "r1" in sent, "the refused hold's blocks were never freed"
    finally:
        ws.shutdown()
        sched.shutdown()


@dataclass
class PushRig:
    """A push-mode worker and scheduler on a real sidecar (leases of 1 s), stepped as vLLM steps
    them; ``freed``: the requests reported sent (vLLM frees their blocks then)."""

    ws: Any
    sched: Any
    freed: set[str] = field(default_factory=set)

    def step(self) -> None:
        p = self.sched.take_plan()
        self.ws.bind(p.recvs, p.holds, p.failed, p.refused, p.names, p.unheld, p.extended)
        self.freed.update(self.sched.push.hold_back(self.ws.get_transfer_results().finished_sending) or ())

    def step_until_freed(self, req_id: str, timeout_s: float = 6.0) -> None:
        """Steps until ``req_id`` is reported sent or ``timeout_s`` passed (its lease: 1 s)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and req_id not in self.freed:
            self.step()
            time.sleep(0.05)

    @staticmethod
    def request(rid: str, tid: str = "T") -> SimpleNamespace:
        """A prefill request of 32 tokens, its decode dispatched at once under transfer id ``tid``."""
        return SimpleNamespace(request_id=rid, num_prompt_tokens=32, num_computed_tokens=0,
                               kv_transfer_params={"do_remote_decode": True, "transfer_id": tid},
                               status=SimpleNamespace(name="RUNNING"), prompt_token_ids=list(range(32)))

    @staticmethod
    def finished(req: SimpleNamespace) -> SimpleNamespace:
        req.status, req.num_computed_tokens = SimpleNamespace(name="FINISHED_LENGTH_CAPPED"), 32
        return req


@contextlib.contextmanager
def push_rig(endpoint: str) -> Iterator[PushRig]:
    ws, sched = engine(ConnectorSettings(sidecar=endpoint, heartbeat_s=0.1, lease_s=1.0, grace_s=0.5,
                                         settle_s=0.5, mode="push"))
    try:
        yield PushRig(ws, sched)
    finally:
        ws.shutdown()
        sched.shutdown()


def test_a_retry_under_a_transfer_id_still_held_is_freed_and_the_first_still_is_later(
        factory: SidecarFactory) -> None:
    """Push mode: a router's retry r2 reuses the transfer id T under which r1 is held streamed.
    r2 is not streamed (T is live), so it was held under T on the pull path: the sidecar
    refused the second lease (``duplicate_request``), vLLM kept r2's blocks, the worker's name
    for T became r2, and T's one Released freed r2: r1's blocks leaked (found by a review).
    Now r2 is freed at once and r1 when its lease ends."""
    sc = factory.start("dup")
    with push_rig(sc.endpoint) as rig:
        sched = rig.sched
        r1, r2 = rig.request("r1"), rig.request("r2")
        sched.push.allocated(r1, [1, 2], 16)
        sched.push.scheduled({"r1": 32}, None, sched.plan)
        rig.step()
        sched.push.allocated(r2, [3, 4], 16)
        sched.push.scheduled({"r2": 32}, None, sched.plan)
        rig.step()
        got = sched.request_finished(rig.finished(r2), [3, 4])
        assert got == (False, None), "a second lease under a live name"
        delayed, _ = sched.request_finished(rig.finished(r1), [1, 2])
        rig.step_until_freed("r1")  # (its lease expires: 1 s)
        assert not delayed or "r1" in rig.freed, "r1 was kept by vLLM and never reported: its blocks leak"
        assert "r2" not in rig.freed  # (freed by vLLM at once: never reported as a send)


def test_a_preempted_streamed_requests_release_is_not_handed_to_vllm() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from kvxfer.client import Drained
    from kvxfer.connector.push import StreamedHolds
    from kvxfer.connector.worker import WorkerSide
    from kvxfer.protocol import Released

    class Client:
        def __init__(self) -> None:
            self.holds: list[str] = []
            self.releases: list[str] = []
            self.pending = Drained()

        def hold(self, req_id: str, *a: object, **kw: object) -> None:
            self.holds.append(req_id)

        def release(self, req_id: str, **kw: object) -> None:
            self.releases.append(req_id)  # the sidecar ends the lease: Released(aborted) to every rank
            self.pending.released.append(Released(req_id=req_id, reason="aborted"))

        def heartbeat(self) -> None:
            pass

        def poll(self) -> Drained:
            out, self.pending = self.pending, Drained()
            return out

    settings = ConnectorSettings(sidecar="ipc:///nowhere", mode="push")
    client = Client()
    push = StreamedHolds(settings, client, 1, "P")  # type: ignore[arg-type]
    r = SimpleNamespace(request_id="r1", num_prompt_tokens=20, num_computed_tokens=0,
                        kv_transfer_params={"do_remote_decode": True, "transfer_id": "t1"},
                        status=SimpleNamespace(name="RUNNING"))
    push.allocated(r, [1, 2], 16)
    plan = StepPlan()
    push.scheduled({"r1": 20}, None, plan)  # held, streamed
    ws = WorkerSide(settings, 0, 1, "cpu")
    ws.client = client  # type: ignore[assignment]
    ws.bind(plan.recvs, plan.holds, names=plan.names)
    push.scheduled({}, {"r1"}, StepPlan())  # vLLM preempted it (its blocks freed, request kept)
    out = ws.get_transfer_results()
    finished_sending = push.hold_back(out.finished_sending)
    vreq = SimpleNamespace(request_id="r1", status=RequestStatus.PREEMPTED,
                           is_finished=lambda: RequestStatus.is_finished(RequestStatus.PREEMPTED))
    fake = SimpleNamespace(connector=None, requests={"r1": vreq})
    fake._free_blocks = lambda rq: Scheduler._free_blocks(fake, rq)  # type: ignore[attr-defined]
    try:
        Scheduler._update_from_kv_xfer_finished(fake, KVConnectorOutput(finished_sending=finished_sending))
    except AssertionError:
        pytest.fail("vLLM's scheduler asserts (engine core dies): finished_sending names a preempted request")


def test_a_deferred_load_whose_lease_expired_meanwhile_is_posted_or_failed() -> None:
    """vLLM 0.33 defers update_state_after_alloc (HiSparse: defer_async_loads) to a later
    update_from_output; the request waits in WAITING_FOR_REMOTE_KVS meanwhile. An EXPIRED for
    it drained by take_plan in between marks it errored; the deferred update_state_after_alloc
    then posts no Recv and fails nothing: vLLM waits for a load nobody will report."""
    from kvxfer.client import Drained
    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.errors import ErrorCode
    from kvxfer.protocol import Error, Pong

    class Client:
        def __init__(self) -> None:
            self.pending = Drained()
            self.recvs: list[str] = []

        def ping(self, _t: float) -> Pong:
            return Pong(seq=0, engine_id="D", version=6, handshake_host="127.0.0.1", handshake_port=1)

        def heartbeat(self) -> None:
            pass

        def keepalive(self, *a: object, **kw: object) -> None:
            pass

        def recv(self, req_id: str, *a: object, **kw: object) -> None:
            self.recvs.append(req_id)

        def poll(self) -> Drained:
            out, self.pending = self.pending, Drained()
            return out

    client = Client()
    sched = SchedulerSide(ConnectorSettings(sidecar="ipc:///nowhere"), tp_size=1, client=client)  # type: ignore[arg-type]
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h", "remote_port": 1,
              "remote_block_ids": [7, 8], "remote_request_id": "p1", "remote_num_tokens": 32,
              "remote_lease_token": "t"}
    req = SimpleNamespace(request_id="d1", kv_transfer_params=params, prompt_token_ids=list(range(32)))
    assert sched.get_num_new_matched_tokens(req, 0) == (32, True)  # vLLM: WAITING_FOR_REMOTE_KVS
    sched.take_plan()  # (this step's metadata; the load is deferred)
    client.pending.errors.append(Error(code=ErrorCode.EXPIRED, message="lease ran out", req_id="d1"))
    sched.take_plan()  # next step: the prefill gave the blocks up while it waited
    sched.update_state_after_alloc(req, [3, 4], 32)  # the deferred load starts now
    plan = sched.take_plan()
    assert client.recvs or "d1" in plan.failed, "no load posted and none failed: vLLM waits forever"


def test_a_hold_refused_as_unauthorized_is_freed_as_well() -> None:
    """A sidecar that does not take the sender for its engine (Ray workers, whose processes the
    sidecar cannot tie to the engine, without ``engine_ownership`` uid) refuses every Hold
    ``unauthorized``: no lease, no Released; the code was not taken for a refused hold, and
    every prefill's blocks stayed pinned (found by a review)."""
    from kvxfer.connector.scheduler import SentHolds
    from kvxfer.errors import ErrorCode

    sent, plan = SentHolds(), StepPlan(holds={"r1": time.monotonic() + 60, "r2": time.monotonic() + 60})
    refused = SimpleNamespace(req_id="r1", code=ErrorCode.UNAUTHORIZED, message="not this engine's")
    other = SimpleNamespace(req_id="r2", code=ErrorCode.UNKNOWN_REQUEST, message="an ended lease")
    assert sent.refused([refused, other], plan, time.monotonic()) == [other]
    assert plan.unheld == ["r1"]


def test_a_load_posted_to_some_ranks_only_fails_at_once_on_the_others() -> None:
    """A Recv that could not be sent to one rank (the sidecar's queue full) left that rank's
    worker waiting for the load's deadline and ``settle_s`` (~60 s) while the others read;
    it fails now (found by a review). None sent: the load fails as a whole."""
    from kvxfer.client import RemoteBlocks
    from kvxfer.connector.scheduler import post_loads
    from kvxfer.errors import SidecarUnavailable
    from kvxfer.pairing import Pairs

    class Client:
        def __init__(self, refuse: set[int]) -> None:
            self.refuse, self.sent = refuse, []

        def recv(self, req_id: str, *a: object, tp_rank: int = 0, **kw: object) -> None:
            if tp_rank in self.refuse:
                raise SidecarUnavailable("queue full")
            self.sent.append(tp_rank)

    remote = RemoteBlocks("p", "127.0.0.1", 5000, [1, 2])
    pairs = Pairs([3, 4], [1, 2], [], [])
    ranks = [(0, 0), (0, 1), (0, 2), (0, 3)]
    def post(client: Client, plan: StepPlan) -> bool:
        return post_loads(client, ConnectorSettings(), ranks, "r", pairs, remote, None, "d", 0.0,  # type: ignore[arg-type]
                          plan)

    plan, client = StepPlan(), Client({1, 3})
    assert post(client, plan)
    assert client.sent == [0, 2]
    assert plan.refused == {"r": [(0, 1), (0, 3)]}  # (those workers fail it now)
    plan = StepPlan()
    assert not post(Client({0, 1, 2, 3}), plan)
    assert plan.refused == {}  # (the whole load fails: plan.failed, by the caller)


def test_a_prefill_that_computed_more_than_is_loaded_is_paired_from_its_first_block() -> None:
    """The prefill ran for more than one token (or without the back-off): 33 tokens computed,
    3 blocks of 16 held, while this engine loads 32 (2 blocks). Lists lined up at the tail
    paired decode [7, 8] with prefill [102, 103]: every block one off, no error (found by a
    review). The prefill's list is cut to the loaded tokens' blocks first."""
    from kvxfer.connector.scheduler import SchedulerSide

    class Client:
        sent: list[tuple[list[int], list[int]]] = []

        def ping(self, timeout: float) -> SimpleNamespace:
            return SimpleNamespace(engine_id="D", handshake_host="h", handshake_port=1, generation="g",
                                   grouped_streams=False, chunk_streams=False, grouped_chunks=False,
                                   instance="i")

        def recv(self, req_id: str, blocks: list[int], remote: object, **kw: object) -> None:
            self.sent.append((list(blocks), list(remote.block_ids)))  # type: ignore[attr-defined]

    sched = SchedulerSide(ConnectorSettings(sidecar="ipc:///nowhere"), 1, client=Client())  # type: ignore[arg-type]
    sched.block_size = 16
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h", "remote_port": 1,
              "remote_block_ids": [101, 102, 103], "remote_num_tokens": 33, "tp_size": 1}
    r = SimpleNamespace(request_id="d1", kv_transfer_params=params, prompt_token_ids=list(range(32)),
                        status=SimpleNamespace(name="WAITING"))
    assert sched.get_num_new_matched_tokens(r, 0) == (32, True)
    sched.update_state_after_alloc(r, [7, 8], 32)
    assert Client.sent == [([7, 8], [101, 102])]


@pytest.mark.parametrize("hit", [0, 1, 2])
def test_the_cut_keeps_each_decode_block_on_the_prefill_block_of_its_tokens(hit: int) -> None:
    from kvxfer.pairing import cut_to_load, pair_groups

    prefill = [100 + k for k in range(6)]  # 6 blocks of 4 tokens held: 21-24 tokens computed
    for tokens in range(hit * 4 + 1, 21):  # this engine loads fewer, its first ``hit`` blocks cached
        blocks = -(-tokens // 4)
        mine = [50 + k for k in range(hit, blocks)]  # its new blocks (id 50 + position, for the check)
        pairs = pair_groups([mine], cut_to_load([prefill], False, tokens, 4))
        got = [(a - 50, b - 100) for a, b in zip(pairs.local, pairs.remote, strict=True)]
        assert got == [(k, k) for k in range(hit, blocks)], tokens


def test_a_memory_channel_call_in_an_engine_step_waits_a_quarter_second_at_most(tmp_path: object) -> None:
    """After a sidecar restart the worker asks the new one for its pidfd and hands its pools back
    inside an engine step; a sidecar that accepts and then says nothing (frozen right after its
    restart) held the step for the client's 30 s per call (found by a review)."""
    import os
    import socket
    import threading

    from kvxfer.connector.worker import STEP_CALL_S
    from kvxfer.pool import PoolClient

    path = os.path.join(str(tmp_path), "mem.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    try:
        client = PoolClient(path)  # (the worker's: 30 s for calls outside a step)
        t0 = time.monotonic()
        assert client.sidecar_pidfd(STEP_CALL_S) is None
        assert time.monotonic() - t0 < STEP_CALL_S + 1.0
    finally:
        listener.close()
        for s in accepted:
            s.close()
