"""A stand-in sidecar for worker tests: a ZMQ ROUTER on an engine socket, answered on a thread
by the test's own handler, with the real memory channel beside it (the worker allocates its
KV cache there). For a test of the worker's side of an exchange the real sidecar cannot be
made to hold still for (an answer that comes late, a restart that answers pings only)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import zmq

Handler = Callable[[zmq.Socket, bytes, Any], None]  # (router, sender identity, decoded message)
Tick = Callable[[zmq.Socket], None]  # called between messages (a late answer's moment)


@contextlib.contextmanager
def stand_in_sidecar(tmp_path: os.PathLike[str], handle: Handler,
                     tick: Tick | None = None) -> Iterator[tuple[str, Any]]:
    """Yields (engine socket endpoint, its PoolServer); every message the worker sends is
    decoded and handed to ``handle`` on the stand-in's thread until the block ends."""
    from kvxfer.memchannel import mem_socket_path
    from kvxfer.protocol import engine_request_decoder
    from kvxfer.sidecar.pool_server import PoolServer

    endpoint = f"ipc://{tmp_path}/fake.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            if tick is not None:
                tick(router)
            if router.poll(10):
                ident, body = router.recv_multipart()
                handle(router, ident, engine_request_decoder.decode(body))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    pools = PoolServer(mem_socket_path(endpoint))
    pools.start()
    try:
        yield endpoint, pools
    finally:
        stop.set()
        thread.join(2)
        pools.close()
        router.close(0)
        ctx.term()
