"""The engine-side client: what a worker (or the vLLM connector) calls. vLLM-free.

Hot-path calls (``hold``, ``recv``, ``release``, ``poll``) never wait for the sidecar:
they send with NOBLOCK or drain what already arrived. Only ``register`` and ``ping``
wait for an answer (registration and start-up may block); events that arrive while
waiting are kept for the next ``poll``.

One client per thread: ZMQ sockets are not thread-safe.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from kvxfer.errors import ErrorCode, ProtocolError, RequestError, SidecarUnavailable
from kvxfer.protocol import (
    DECODE_ERRORS,
    Done,
    EngineRequest,
    Error,
    Failed,
    Hold,
    KeepAlive,
    Ping,
    Pong,
    Recv,
    Registered,
    RegisterKV,
    Release,
    Released,
    SidecarEvent,
    encode,
    sidecar_event_decoder,
)


@dataclass(frozen=True)
class RemoteBlocks:
    """Where a prefilled request's blocks live: the fields of vLLM's kv_transfer_params."""

    engine_id: str
    host: str
    port: int
    block_ids: Sequence[int]
    tp_size: int = 1
    req_id: str = ""
    generation: str = ""  # the prefill sidecar's registration generation (kv_transfer_params)
    token: str = ""  # the prefill lease's capability (kv_transfer_params remote_lease_token)
    # a hybrid model's blocks, one list per KV cache group (block_ids: their distinct blocks)
    groups: tuple[tuple[int, ...], ...] = ()


@dataclass
class Drained:
    """Everything that finished since the last poll, grouped the way an engine uses it."""

    done: list[Done] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
    released: list[Released] = field(default_factory=list)
    errors: list[Error] = field(default_factory=list)
    pongs: list[Pong] = field(default_factory=list)
    registered: list[Registered] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.done or self.failed or self.released or self.errors)

    def merge(self, other: Drained) -> None:
        self.done += other.done
        self.failed += other.failed
        self.released += other.released
        self.errors += other.errors
        self.pongs += other.pongs
        self.registered += other.registered


class SidecarClient:
    def __init__(self, endpoint: str, *, context: zmq.Context | None = None, send_queue: int = 1000) -> None:
        """``send_queue``: messages queued for a sidecar that does not read (frozen, dead)
        before sends fail with ``SidecarUnavailable`` instead of piling up."""
        self.endpoint = endpoint
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, send_queue)
        self._sock.setsockopt(zmq.IDENTITY, f"w{os.getpid()}-{id(self):x}".encode())
        self._sock.connect(endpoint)
        self._pending: list[SidecarEvent] = []

    # ------------------------------------------------------------------ blocking (start-up)

    def ping(self, timeout: float = 5.0) -> Pong:
        """Wait until the sidecar answers (it may still be starting)."""
        deadline = time.monotonic() + timeout
        seq = int(time.monotonic_ns() & 0xFFFFFFFF)
        self._send(Ping(seq=seq))
        while True:
            ev = self._wait_one(deadline, what="ping")
            if isinstance(ev, Pong) and ev.seq == seq:
                return ev
            self._pending.append(ev)

    def register(self, msg: RegisterKV, timeout: float = 60.0) -> Registered:
        """Register one rank's KV cache; raises RequestError with the sidecar's reason."""
        if not msg.pid:
            msg = msgspec.structs.replace(msg, pid=os.getpid())
        self._send(msg)
        deadline = time.monotonic() + timeout
        while True:
            ev = self._wait_one(deadline, what="registration")
            if (isinstance(ev, Registered) and ev.tp_rank == msg.layout.tp_rank
                    and ev.pp_rank == msg.layout.pp_rank):
                return ev
            if isinstance(ev, Error) and not ev.req_id:
                raise RequestError(ev.code, ev.message)
            self._pending.append(ev)

    def register_nowait(self, msg: RegisterKV) -> None:
        """Send a registration; its ``Registered`` (or ``Error``) comes back through ``poll``."""
        if not msg.pid:
            msg = msgspec.structs.replace(msg, pid=os.getpid())
        self._send(msg)

    def wait(self, timeout: float) -> Drained:
        """Block up to ``timeout`` for at least one event, then drain (tests, tools)."""
        if not self._pending and self._sock.poll(int(timeout * 1000)) == 0:
            return Drained()
        return self.poll()

    def wait_until(self, pred: Callable[[Drained], bool], timeout: float) -> Drained:
        """Collect events until ``pred`` holds for all of them or ``timeout`` passes (tests,
        tools); returns what was collected either way."""
        acc = Drained()
        deadline = time.monotonic() + timeout
        while not pred(acc) and time.monotonic() < deadline:
            acc.merge(self.wait(min(0.2, max(0.0, deadline - time.monotonic()))))
        return acc

    @staticmethod
    def wait_any(clients: Sequence[SidecarClient], timeout: float) -> list[Drained]:
        """Block up to ``timeout`` until any of ``clients`` has an event, then drain every one
        of them, in order (one process driving several ranks: tests, tools). Waiting on one
        client at a time would leave the others' events unseen until that wait ends."""
        if not any(c._pending for c in clients):
            poller = zmq.Poller()
            for c in clients:
                poller.register(c._sock, zmq.POLLIN)
            poller.poll(int(timeout * 1000))
        return [c.poll() for c in clients]

    # ------------------------------------------------------------------ non-blocking (hot path)

    def hold(
        self,
        req_id: str,
        block_ids: Iterable[int],
        lease_s: float = 0.0,
        reads: int = 1,
        *,
        notify_ranks: bool = False,
        expires_unix: float = 0.0,
        engine_id: str = "",
        token: str = "",
    ) -> None:
        """``token``: the request's capability (``kvxfer.auth.new_token``), which the decode
        must present (``RemoteBlocks.token``); "" accepts any authenticated peer."""
        self._send(
            Hold(req_id=req_id, block_ids=list(block_ids), lease_s=lease_s, reads=reads,
                 notify_ranks=notify_ranks, expires_unix=expires_unix, engine_id=engine_id, token=token)
        )

    def release(self, req_id: str, engine_id: str = "") -> None:
        self._send(Release(req_id=req_id, engine_id=engine_id))

    def recv(
        self,
        req_id: str,
        block_ids: Iterable[int],
        remote: RemoteBlocks,
        *,
        tp_rank: int = 0,
        deadline_s: float = 0.0,
        reply_to_rank: bool = False,
        expires_unix: float = 0.0,
        engine_id: str = "",
        pp_rank: int = 0,
        state: tuple[Iterable[int], Iterable[int]] = ((), ()),
        trace: bool = False,
    ) -> None:
        """``state``: (local, remote) blocks of state groups (Mamba/GDN), paired one to one.
        ``trace``: the ``Done`` carries the sidecar's per-hop times (``Done.trace``)."""
        self._send(
            Recv(
                req_id=req_id,
                block_ids=list(block_ids),
                remote_engine_id=remote.engine_id,
                remote_host=remote.host,
                remote_port=remote.port,
                remote_block_ids=list(remote.block_ids),
                remote_tp_size=remote.tp_size,
                tp_rank=tp_rank,
                remote_req_id=remote.req_id,
                deadline_s=deadline_s,
                reply_to_rank=reply_to_rank,
                expires_unix=expires_unix,
                remote_generation=remote.generation,
                engine_id=engine_id,
                pp_rank=pp_rank,
                remote_token=remote.token,
                state_block_ids=list(state[0]) or None,
                remote_state_block_ids=list(state[1]) or None,
                trace=trace,
            )
        )

    def keepalive(self, remote: RemoteBlocks, remote_req_ids: list[str], req_ids: list[str],
                  remote_tokens: list[str] | None = None) -> None:
        """Keep the prefill leases of requests still waiting here alive (``KeepAlive``)."""
        self._send(KeepAlive(remote_engine_id=remote.engine_id, remote_host=remote.host,
                             remote_port=remote.port, remote_req_ids=remote_req_ids, req_ids=req_ids,
                             remote_tokens=remote_tokens or []))

    def heartbeat(self) -> None:
        """Ask for a Pong without waiting; ``poll`` hands it back in ``Drained.pongs``."""
        self._send(Ping(seq=0))

    def poll(self) -> Drained:
        """Drain every event that already arrived; never blocks."""
        events, self._pending = self._pending, []
        while True:
            try:
                body = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            events.append(self._decode(body))
        out = Drained()
        for ev in events:
            match ev:
                case Done():
                    out.done.append(ev)
                case Failed():
                    out.failed.append(ev)
                case Released():
                    out.released.append(ev)
                case Error():
                    out.errors.append(ev)
                case Pong():
                    out.pongs.append(ev)
                case Registered():
                    out.registered.append(ev)
        return out

    def send_raw(self, *frames: bytes) -> None:
        """Send arbitrary frames (for tests of the sidecar's input validation)."""
        self._sock.send_multipart(list(frames))

    def close(self) -> None:
        self._sock.close(0)

    # ------------------------------------------------------------------ internals

    def _send(self, msg: EngineRequest) -> None:
        try:
            self._sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again as e:
            raise SidecarUnavailable(f"sidecar at {self.endpoint} is not accepting messages") from e

    def _decode(self, body: bytes) -> SidecarEvent:
        try:
            return sidecar_event_decoder.decode(body)
        except DECODE_ERRORS as e:
            raise ProtocolError(f"undecodable message from sidecar: {e}") from e

    def _wait_one(self, deadline: float, what: str) -> SidecarEvent:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or self._sock.poll(int(remaining * 1000)) == 0:
            raise SidecarUnavailable(f"no {what} answer from {self.endpoint}")
        return self._decode(self._sock.recv())


__all__ = ["Drained", "ErrorCode", "RemoteBlocks", "SidecarClient"]
