"""Events for an engine that does not read for a while (a long step, a compile, a stop the
world) are kept and delivered in order once it reads again, over the ZMQ socket and over an
engine ring; they used to be dropped past ZMQ's high-water marks (~2,000 queued) or a full
ring (found by a review: 1,998 of 6,000 Released arrived, and a dropped Released pins its hold
until the engine restarts). Real sidecar processes, real sockets and rings."""

from __future__ import annotations

import time

import pytest

from kvxfer.client import SidecarClient
from kvxfer.engine_ring import EngineRing
from kvxfer.ringchannel import MIN_CAPACITY
from kvxfer.sidecar.outbox import Outbox
from kvxfer.testing.procs import SidecarFactory, free_port
from tests.test_ring import settles_and_serves


def _flood_without_reading(c: SidecarClient, n: int) -> None:
    """n Pings, each answered by a Pong the client does not read yet; paced so that the
    sidecar takes every Ping (the client's own queue is 1,000 deep)."""
    for i in range(n):
        c.heartbeat()
        if i % 200 == 199:
            time.sleep(0.01)


def _pongs(c: SidecarClient, n: int, timeout: float) -> int:
    got, deadline = 0, time.monotonic() + timeout
    while got < n and time.monotonic() < deadline:
        got += len(c.poll().pongs)
        time.sleep(0.005)
    return got


@pytest.mark.parametrize("ring", [False, True], ids=["zmq", "ring"])
def test_events_for_an_engine_that_does_not_read_are_delivered_once_it_does(
        sidecars: SidecarFactory, ring: bool) -> None:
    sc = sidecars.start(f"outbox-{'ring' if ring else 'zmq'}", metrics_port=free_port())
    c = SidecarClient(sc.endpoint)
    try:
        c.ping(20)
        if ring:  # (the smallest ring: 64 KiB each way, ~650 Pongs)
            c.ring = EngineRing.open(sc.endpoint, capacity=MIN_CAPACITY)
        n = 6_000  # (past ZMQ's two queues of 1,000, and a small ring's room)
        _flood_without_reading(c, n)
        time.sleep(1.0)  # (the engine is "in a long step": the sidecar has answered all it can)
        assert sc.scrape()["kvxfer_engine_events_waiting"] > 0  # (some could not go yet)
        assert _pongs(c, n, 30.0) == n
        deadline = time.monotonic() + 5
        while sc.scrape()["kvxfer_engine_events_waiting"] and time.monotonic() < deadline:
            time.sleep(0.05)
        metrics = sc.scrape()
        assert metrics["kvxfer_engine_events_waiting"] == 0
        assert metrics.get("kvxfer_engine_events_dropped_total", 0) == 0
        assert c.ping(5).seq  # (in order: the newest answer comes after all the kept ones)
    finally:
        c.close()


def test_an_engine_gone_takes_its_waiting_events_with_it(sidecars: SidecarFactory) -> None:
    sc = sidecars.start("outbox-gone", metrics_port=free_port())
    c = SidecarClient(sc.endpoint)
    c.ping(20)
    _flood_without_reading(c, 4_000)
    time.sleep(0.5)
    assert sc.scrape()["kvxfer_engine_events_waiting"] > 0
    c.close()
    settles_and_serves(sc, "kvxfer_engine_events_waiting")


# ---------------------------------------------------------------------- the outbox alone


class _Conn:
    """A connection that takes ``room`` frames, then refuses until given more; or is gone."""

    def __init__(self, room: int) -> None:
        self.room, self.got, self.gone = room, [], False

    def __call__(self, frame: bytes) -> bool | None:
        if self.gone:
            return None
        if self.room <= 0:
            return False
        self.room -= 1
        self.got.append(frame)
        return True


def test_the_outbox_keeps_order_and_bounds_what_it_keeps() -> None:
    conn = _Conn(room=2)
    box = Outbox(max_bytes=10)
    frames = [b"%d" % i for i in range(8)]
    for f in frames:
        box.send(b"e", f, conn)
    assert conn.got == frames[:2]
    assert (box.waiting, box.dropped) == (6, 0)
    conn.room = 3
    assert box.flush(b"e", conn) is False  # (3 went; 3 still wait)
    assert conn.got == frames[:5]
    box.send(b"e", b"x" * 6, conn)  # (the connection has room, but older frames wait: kept behind them)
    assert conn.got == frames[:5]
    box.send(b"e", b"y" * 9, conn)  # (would keep 6 + 9 > 10 bytes: dropped, counted)
    assert (box.dropped, box.waiting) == (1, 4)
    other = _Conn(room=0)
    box.send(b"f", b"z" * 9, other)  # (the cap is each connection's: f's first frame is kept)
    assert (box.dropped, box.waiting) == (1, 5)
    other.room = 1
    assert box.flush(b"f", other) is True
    assert other.got == [b"z" * 9]
    conn.room = 100
    assert box.flush(b"e", conn) is True
    assert conn.got == [*frames, b"x" * 6]
    assert box.waiting == 0
    conn.gone = True
    box.send(b"e", b"z", conn)  # (gone: nothing kept for it)
    assert box.waiting == 0
    conn.gone, conn.room = False, 0
    box.send(b"e", b"w", conn)
    assert box.waiting == 1
    conn.gone = True
    assert box.flush(b"e", conn) is True  # (gone: what waited for it is let go, counted)
    assert (box.waiting, box.idents(), box.lost) == (0, [], 1)


def test_events_wait_for_a_stopped_engine_whose_connection_zmq_closed() -> None:
    """ZMQ closes the connection of an engine that missed its heartbeats for 30 s (a stopped
    process); it reconnects with the same identity when it resumes. Its events wait for it
    while its process is stopped (up to GONE_AFTER_S), and go with it otherwise."""
    import signal
    import subprocess
    import sys

    from kvxfer.observe import Observer
    from kvxfer.sidecar.engine_server import GONE_AFTER_S, RESUME_GRACE_S, Kept
    from kvxfer.sidecar.ownership import Creds
    from kvxfer.sidecar.procfs import start_time, stopped

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        who = Creds(child.pid, 0, start_time(child.pid))
        assert not stopped(who)
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not stopped(who) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopped(who)
        assert not stopped(Creds(child.pid, 0, "1"))  # (another process that had the same pid)
    finally:
        child.kill()
        child.wait()
    assert not stopped(who)  # (gone)
    kept = Kept(lambda ident, frame: None, Observer())
    assert kept.unreachable(b"x", stopped=False) is None  # (never seen stopped: gone with its process)
    assert kept.unreachable(b"e", stopped=True) is False  # (kept)
    assert kept.unreachable(b"e", stopped=False) is False  # (resumed: it reconnects in ~0.1-0.2 s)
    kept._stopped_seen[b"e"] -= RESUME_GRACE_S
    assert kept.unreachable(b"e", stopped=False) is None  # (running, and not back: gone)
    kept._behind[b"e"] = time.monotonic() - GONE_AFTER_S - 1
    assert kept.unreachable(b"e", stopped=True) is None  # (stopped for too long)


CHILD = r'''
import sys, time, zmq
from kvxfer.protocol import Ping, encode
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.IDENTITY, b"stopped-engine")
s.connect(sys.argv[1])
s.send(encode(Ping(seq=1)))
assert s.poll(10000)
s.recv()
print("ready", flush=True)
sys.stdin.readline()  # (stopped here; resumed, it reads what was kept for it)
got, end = 0, time.monotonic() + 10
while got < 5 and time.monotonic() < end:
    if s.poll(100):
        s.recv()
        got += 1
print(got, flush=True)
'''


def test_a_stopped_engine_gets_what_was_kept_for_it_once_it_runs_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real engine socket whose heartbeats are cut to 0.2 / 0.6 s (30 s in the product), a
    child engine process stopped until ZMQ closed its connection: five events for it are kept
    while it is stopped, and arrive once it runs again and reconnects (found by a review: they
    were dropped the moment it ran again, before its reconnection ~0.1-0.2 s later)."""
    import asyncio
    import signal
    import subprocess
    import sys
    import threading

    import zmq
    import zmq.asyncio

    from kvxfer.observe import Observer
    from kvxfer.protocol import Ping, Pong
    from kvxfer.sidecar.engine_server import EngineServer

    endpoint = f"ipc://{tmp_path}/engine.sock"
    loop = asyncio.new_event_loop()
    ctx = zmq.asyncio.Context()
    server = EngineServer(ctx, endpoint, Observer())
    server.sock.setsockopt(zmq.HEARTBEAT_IVL, 200)
    server.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 600)
    pong = Pong(seq=1, engine_id="e", version=1, handshake_host="h", handshake_port=1)
    server.on(Ping, lambda ident, msg: server.send(ident, pong))
    server.bind()
    tasks: list[asyncio.Task[None]] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        tasks.append(loop.create_task(server.serve()))
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        with subprocess.Popen([sys.executable, "-c", CHILD, endpoint], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) as child:
            try:
                assert child.stdout is not None
                assert child.stdin is not None
                assert child.stdout.readline().strip() == "ready"
                child.send_signal(signal.SIGSTOP)
                time.sleep(1.5)  # (its connection closed by the heartbeats)
                for _ in range(5):
                    loop.call_soon_threadsafe(server.send, b"stopped-engine", pong)
                time.sleep(0.3)
                assert server.kept.box.waiting == 5  # (kept while it is stopped)
                child.send_signal(signal.SIGCONT)
                child.stdin.write("go\n")
                child.stdin.flush()
                assert child.stdout.readline().strip() == "5"
                assert server.kept.box.lost == 0
            finally:
                child.kill()
    finally:
        for t in tasks:
            loop.call_soon_threadsafe(t.cancel)
        time.sleep(0.1)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        server.close()
        ctx.term()
        loop.close()


def test_an_event_too_large_for_a_ring_does_not_hold_up_the_rest(sidecars: SidecarFactory) -> None:
    """A worker registered over a small ring (64 KiB each way); a Recv too large for it goes
    over ZMQ with ``reply_to_rank``, and its Failed (naming 10,000 block ids) goes to the
    ring, where it can never fit: it is dropped with a WARNING, and what follows arrives (found
    by a review: the outbox kept it at the head of the ring's queue for ever, every later
    event behind it)."""
    from kvxfer.client import RemoteBlocks
    from kvxfer.testing.engine import SyntheticEngine, make_layout

    sc = sidecars.start("outbox-big", metrics_port=free_port())
    e = SyntheticEngine(make_layout(layers=2, num_blocks=16, heads=2, head_dim=16), sc.endpoint,
                        engine_channel="zmq")
    try:
        e.client.ring = EngineRing.open(sc.endpoint, capacity=MIN_CAPACITY)  # (before it registers)
        e.start()
        e.client.recv("big", list(range(100_000, 110_000)), RemoteBlocks("p", "127.0.0.1", 1, [0] * 10_000),
                      reply_to_rank=True)
        time.sleep(0.5)
        assert e.client.ping(10).seq  # (its answer came after the Failed that could not)
        assert "over its largest frame" in sc.log()
        assert sc.scrape()["kvxfer_engine_events_waiting"] == 0
    finally:
        e.close()
