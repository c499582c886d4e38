"""A sidecar restart, push retries and a corrupt ring, from a review of sidecar death and
restart (each shown failing without its fix): a pidfd ask that timed out closed the memory
channel holding the pools (the sidecar dropped a live engine's ranks for good); a push retry
under the transfer id of a finished request still held took its only Released (the first's
blocks leaked); a corrupt ring raised into vLLM's scheduler hooks."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvxfer.client import SidecarClient
from kvxfer.connector.settings import ConnectorSettings
from kvxfer.testing.procs import SidecarFactory
from tests.test_connector_lifecycle import push_rig
from tests.test_rejoin import SHAPE, Answer, _worker, registered, stand_in_sidecar


def _hold_refused(endpoint: str, lease: str) -> list[Any]:
    """What a scheduler is told when it holds block 0 of the engine now (errors; none: held)."""
    sched = SidecarClient(endpoint, ring=False)
    try:
        sched.ping(5.0)
        sched.hold(lease, [0], lease_s=0.5, expires_unix=time.time() + 5.0)
        return sched.wait_until(lambda d: bool(d.errors), 2.0).errors
    finally:
        sched.close()


@pytest.mark.parametrize("channel", ["prompt", "late"])
def test_a_pidfd_ask_that_times_out_after_a_re_registration_keeps_the_rank_registered(
        sidecars: SidecarFactory, monkeypatch: pytest.MonkeyPatch, channel: str) -> None:
    """A real sidecar restarts; the worker hands its pools back, sends its registration, then
    asks the memory channel for the sidecar's pidfd within STEP_CALL_S (0.25 s). ``late``: the
    channel does not answer in time (the sidecar stopped for that moment, as a starved or
    GIL-bound one is). ``sidecar_pidfd`` closed the connection that holds the pools the
    registration names: the sidecar took that for the engine's death (pools_closed -> gone)
    and dropped the rank, while the worker believed it registered and never registered again
    (same instance: no restart to notice); every later load and hold of the rank was refused.
    The ask now has a connection of its own."""
    sc, ws, kv = _worker(sidecars, f"restart-who-{channel}")
    real_watch = ws.death.watch
    state: dict[str, Any] = {"sidecar": None, "done": False}

    def watch(pools: Any, timeout_s: float = 0.0) -> bool:
        second = state["sidecar"]
        if channel == "late" and second is not None and timeout_s and not state["done"]:
            state["done"] = True
            got: list[Any] = []  # (the registration sent just before is taken meanwhile)
            end = time.monotonic() + 10.0
            while time.monotonic() < end:
                d = ws.client.wait(0.1)
                got += [*d.done, *d.failed, *d.released, *d.errors, *d.pongs, *d.registered]
                if d.registered:
                    break
            ws.client._pending.extend(got)  # (handed to the worker's next poll, as they came)
            os.kill(second.proc.pid, signal.SIGSTOP)  # its memory channel misses STEP_CALL_S
            try:
                return real_watch(pools, timeout_s)
            finally:
                os.kill(second.proc.pid, signal.SIGCONT)
        return real_watch(pools, timeout_s)

    try:
        first = ws.register_kv_caches(kv, SHAPE)
        assert not _hold_refused(sc.endpoint, "before")
        monkeypatch.setattr(ws.death, "watch", watch)
        os.kill(sc.proc.pid, signal.SIGKILL)
        sc.proc.wait()
        state["sidecar"] = second = sidecars.start(f"restart-who-{channel}")
        deadline = time.monotonic() + 30
        while ws.registered is None or ws.registered.agent_name == first.agent_name:
            assert time.monotonic() < deadline, "never re-registered"
            ws.get_transfer_results()
            time.sleep(0.02)
        end = time.monotonic() + 3.0  # (heartbeats go on; a worker that knew would register again)
        while time.monotonic() < end:
            ws.get_transfer_results()
            time.sleep(0.05)
        errors = _hold_refused(second.endpoint, "after")
        assert not errors, (f"the rank is no longer registered with the sidecar that answers its "
                            f"heartbeats: {[(e.code, e.message) for e in errors]}; worker: registered="
                            f"{ws.registered.agent_name}, rejoin active={ws._rejoin.active}")
    finally:
        ws.shutdown()


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "held-at-finish"])
def test_a_retry_under_the_transfer_id_of_a_finished_request_still_held_leaks_nothing(
        sidecars: SidecarFactory, streamed: bool) -> None:
    """Push mode: r1 is held under transfer id T (``streamed``: held streamed, as its blocks were
    allocated; else held as it finished: its streamed Hold not sent, or a chunked prompt at a
    sidecar without chunk streams) and finishes (vLLM keeps its blocks until T's Released),
    and a router retry r2 reusing T is scheduled while r1's lease still lives. r2 was held
    under T too (only running streamed requests' ids counted as taken): the sidecar refused it
    (duplicate_request, not a HOLD_REFUSED code: nothing is unheld), the worker's name for T
    became r2, and T's one Released was reported as r2's. r1 was never reported: its blocks
    stayed held for ever (two reviews). A finished request's transfer id is taken until its
    Released comes."""
    with push_rig(sidecars.start(f"restart-dup-{streamed}").endpoint) as rig:
        sched = rig.sched
        r1, r2 = rig.request("r1"), rig.request("r2")
        if streamed:
            sched.push.allocated(r1, [1, 2], 16)
            sched.push.scheduled({"r1": 32}, None, sched.plan)
            rig.step()
        delayed, _ = sched.request_finished(rig.finished(r1), [1, 2])
        assert delayed  # vLLM keeps blocks 1, 2 until r1 is reported sent
        rig.step()
        sched.push.allocated(r2, [3, 4], 16)  # the retry, while T (r1's lease) lives
        sched.push.scheduled({"r2": 32}, None, sched.plan)
        rig.step()
        rig.step_until_freed("r1")  # (r1's lease expires after 1 s)
        assert "r1" in rig.freed, f"r1 was kept by vLLM and never reported: its blocks leak ({rig.freed})"


def test_a_corrupt_ring_head_never_raises_into_a_scheduler_hook(sidecars: SidecarFactory) -> None:
    """The scheduler's hooks catch ``SEND_ERRORS`` only ("no exception from the sidecar client
    reaches a scheduler or worker hook"), but ``Ring.write`` raises ``RingCorrupt`` (not one of
    them) when the sidecar's head counter is impossible; the read side catches it, the write
    side did not: ``request_finished`` raised into vLLM's scheduler (the engine core died). Now
    the message is not sent (the hold's blocks are freed) and the client goes on over ZMQ."""

    from kvxfer.connector.scheduler import SchedulerSide

    sc = sidecars.start("restart-ring")
    sched = SchedulerSide(ConnectorSettings(sidecar=sc.endpoint, heartbeat_s=0.1), tp_size=1)
    try:
        ring = sched.client.ring
        assert ring is not None, sched.client.ring_error
        out = ring._out
        out._words[out._head_i] = out._tail + 10 * out.capacity  # (the sidecar's counter, scribbled)
        req = SimpleNamespace(request_id="r1", kv_transfer_params={"do_remote_decode": True},
                              status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"), num_computed_tokens=32)
        sched.request_finished(req, [1, 2])  # must not raise (a hold not sent frees the blocks)
    finally:
        sched.shutdown()


def test_a_registration_answered_not_registered_is_sent_again(tmp_path: os.PathLike[str]) -> None:
    """A registration whose memory channel closed while the sidecar processed it is answered
    (``engines.CHANNEL_CLOSED``) so that the worker registers again rather than wait for ever.
    It was answered ``not_registered``, which the worker ignores as a registration's refusal
    (it is another message's), so no second registration was ever sent (a review)."""
    from kvxfer.protocol import Error, encode
    from kvxfer.sidecar.engines import CHANNEL_CLOSED

    closed = encode(Error(code=CHANNEL_CLOSED, message="engine process exited while it registered "
                          "(its memory channel closed)"))  # (what engines.register answers then)

    def answer(n: int) -> Answer:  # "one"; then its restart refuses as a closed channel, then "two"
        return (0.0, registered("one") if n == 1 else closed if n == 2 else registered("two"))

    with stand_in_sidecar(tmp_path, answer, engine_channel="zmq") as (ws, registrations, _):
        end = time.monotonic() + 4.0
        while time.monotonic() < end and not (ws.registered and ws.registered.agent_name == "two"):
            ws.get_transfer_results()
            time.sleep(0.01)
        assert len(registrations) >= 3, (f"{len(registrations)} registrations; rejoin outstanding="
                                         f"{ws._rejoin.outstanding}: the answer was ignored, none again")
