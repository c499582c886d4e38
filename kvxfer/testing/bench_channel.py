"""The engine channel, measured (#38's third target): a ``Ping``'s round trip from an engine's
client through a real sidecar and its asyncio loop, over an engine ring (``kvxfer``: shared
memory and eventfd doorbells, the connector's default) and over the engine socket
(``kvxfer_zmq``: ZMQ over ``ipc://``), beside a bare pyzmq DEALER/ROUTER echo over ``ipc://``
in another process, of the same bytes, measured in the same run, batch by batch interleaved.
One way is reported as half the round trip (both directions cross the same kind of channel)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvxfer.client import SidecarClient
from kvxfer.protocol import Ping, encode

BATCH = 100


def _echo(address: str, ready: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == b"stop":
            break
        sock.send_multipart(frames)
    sock.close(0)
    ctx.term()


def _timed(call: Callable[[], object], n: int, out: list[float]) -> None:
    for _ in range(n):
        t = time.perf_counter_ns()
        call()
        out.append((time.perf_counter_ns() - t) / 1000)


def _stats(rtts: list[float]) -> dict[str, float]:
    q = statistics.quantiles(rtts, n=100)
    return {"rtt_p50_us": round(statistics.median(rtts), 1), "rtt_p99_us": round(q[98], 1),
            "one_way_p50_us": round(statistics.median(rtts) / 2, 1)}


def engine_channel(endpoint: str, n: int) -> dict[str, Any]:
    """``n`` round trips each (after ``BATCH`` to warm up): ``kvxfer`` (``SidecarClient.ping``
    against the sidecar at ``endpoint``) and ``bare_pyzmq`` (the encoded ``Ping`` echoed)."""
    folder = tempfile.mkdtemp(prefix="kvxfer-chan-")
    address = f"ipc://{os.path.join(folder, 'echo.sock')}"
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_echo, args=(address, ready), daemon=True)
    proc.start()
    zctx = zmq.Context()
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    client = SidecarClient(endpoint, ring=True)
    over_zmq = SidecarClient(endpoint)
    payload = encode(Ping(seq=1))
    try:
        if not ready.wait(10):
            raise RuntimeError("the echo process did not start")
        dealer.connect(address)

        def bare() -> None:
            dealer.send(payload)
            dealer.recv()

        kv: list[float] = []
        zq: list[float] = []
        raw: list[float] = []
        _timed(bare, BATCH, [])
        _timed(client.ping, BATCH, [])  # (the first ping asks for the ring)
        _timed(over_zmq.ping, BATCH, [])
        if client.ring is None:
            raise RuntimeError(f"no engine ring from {endpoint}: {client.ring_error}")
        for _ in range(max(1, n // BATCH)):
            _timed(bare, BATCH, raw)
            _timed(client.ping, BATCH, kv)
            _timed(over_zmq.ping, BATCH, zq)
        dealer.send(b"stop")
    finally:
        client.close()
        over_zmq.close()
        dealer.close(0)
        zctx.term()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(folder, ignore_errors=True)
    return {"n": len(kv), "message_bytes": len(payload), "kvxfer": _stats(kv), "kvxfer_zmq": _stats(zq),
            "bare_pyzmq": _stats(raw)}
