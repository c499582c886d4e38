"""The engine-side client: what a worker (or the vLLM connector) calls. vLLM-free.

Hot-path calls (``hold``, ``recv``, ``release``, ``poll``) never wait for the sidecar:
they send with NOBLOCK or drain what already arrived. Only ``register`` and ``ping``
wait for an answer (registration and start-up may block); events that arrive while
waiting are kept for the next ``poll``.

One client per thread: ZMQ sockets are not thread-safe.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvxfer.engine_ring import Asking, EngineRing, RingUnavailable
from kvxfer.errors import ErrorCode, KvxferError, ProtocolError, RequestError, SidecarUnavailable
from kvxfer.protocol import (
    DECODE_ERRORS,
    Cancel,
    Done,
    EngineRequest,
    Error,
    Failed,
    Hold,
    KeepAlive,
    LayersDone,
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
from kvxfer.ringchannel import RingCorrupt

log = logging.getLogger("kvxfer.client")


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
    # the prefill's tokens per block (kv_transfer_params remote_block_size; 0: not said)
    block_size: int = 0

    @property
    def streamed(self) -> bool:
        """Push mode (``parse_push``): the transfer id, no blocks: the prefill is still computing."""
        return not self.block_ids and bool(self.req_id)


@dataclass(frozen=True)
class GroupedLoad:
    """Push mode, a model of several KV cache groups: what a decode's sidecar pairs with the
    prefill's lists once it names them (``Recv.groups``)."""

    groups: list[list[int]]  # this engine's blocks per group (0: vLLM's null block)
    state: list[bool]  # per group: a state group (Mamba/GDN)
    num_tokens: int  # the prompt tokens it loads (the prefill must have computed exactly these)

    def fields(self) -> dict[str, Any]:
        return {"groups": self.groups, "state_groups": self.state, "num_tokens": self.num_tokens}


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


# What sending to the sidecar may raise (it is not taking messages, or the socket failed):
# an engine catches these, never lets them into vLLM's step
SEND_ERRORS = (KvxferError, zmq.ZMQError)
RING_RETRY_S = 5.0  # how often a client without the ring it wants asks again (heartbeats)


class SidecarClient:
    def __init__(self, endpoint: str, *, context: zmq.Context | None = None, send_queue: int = 1000,
                 ring: bool = False) -> None:
        """``send_queue``: messages queued for a sidecar that does not read (frozen, dead)
        before sends fail with ``SidecarUnavailable`` instead of piling up. ``ring``: talk
        over an engine ring (``kvxfer.engine_ring``: one wake-up per message) where the
        sidecar grants one, else, and whenever the ring is lost, over the ZMQ socket."""
        self.endpoint = endpoint
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, send_queue)
        self._sock.setsockopt(zmq.IDENTITY, f"w{os.getpid()}-{id(self):x}".encode())
        self._sock.connect(endpoint)
        self._pending: list[SidecarEvent] = []
        self._early: list[SidecarEvent] = []  # read off the ring by a blocking wait, not yet handed out
        self.undecodable = 0  # messages from the sidecar that could not be decoded (skipped), ever
        self.ring: EngineRing | None = None
        self.ring_error = ""  # why there is no ring ("": there is one, or none was asked for)
        self._want_ring = ring
        self._asking: Asking | None = None  # a ring asked for, not granted yet
        self._asked_at = -RING_RETRY_S

    def _ask_ring(self, wait_s: float = 0.0) -> None:
        """Ask the sidecar for an engine ring (at most every RING_RETRY_S) and take it once
        granted; waits up to ``wait_s`` for the answer (0: never blocks)."""
        now = time.monotonic()
        try:
            if self._asking is None and now - self._asked_at >= RING_RETRY_S:
                self._asked_at = now
                self._asking = Asking(self.endpoint)
            if self._asking is not None:
                self.ring = self._asking.answer(wait_s)
                if self.ring is not None:
                    self._asking, self.ring_error = None, ""
                elif now - self._asked_at > RING_RETRY_S:
                    self._asking.close()
                    self._asking, self.ring_error = None, "the sidecar did not answer a ring request"
        except RingUnavailable as e:
            self._asking, self.ring_error = None, str(e)

    # ------------------------------------------------------------------ blocking (start-up)

    def ping(self, timeout: float = 5.0) -> Pong:
        """Wait until the sidecar answers (it may still be starting)."""
        deadline = time.monotonic() + timeout
        seq = int(time.monotonic_ns() & 0xFFFFFFFF)
        self._send(Ping(seq=seq))  # (a restarted sidecar's dead ring: over ZMQ, see _send)
        while True:
            ev = self._wait_one(deadline, what="ping")
            if isinstance(ev, Pong) and ev.seq == seq:
                if self._want_ring and self.ring is None:
                    self._ask_ring(wait_s=1.0)  # (it answers: a ring now, before the hot path)
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
        if not self._pending and not self._early and not self._ready():
            self._poller().poll(int(timeout * 1000))
        return self.poll()

    def _ready(self) -> bool:
        """Something to take now (never blocks; arms the ring's doorbell when not)."""
        return bool(self._sock.get(zmq.EVENTS) & zmq.POLLIN) or (self.ring is not None and self.ring.arm())

    def _poller(self, poller: zmq.Poller | None = None) -> zmq.Poller:
        poller = poller or zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self.ring is not None:
            poller.register(self.ring.wake, zmq.POLLIN)
        return poller

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
        if not any(c._pending or c._early for c in clients) and not any([c._ready() for c in clients]):
            poller = zmq.Poller()
            for c in clients:
                c._poller(poller)
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
        streamed: bool = False,
        groups: list[list[int]] | None = None,
        num_tokens: int = 0,
        partial: bool = False,
        extends: bool = False,
    ) -> None:
        """``token``: the request's capability (``kvxfer.auth.new_token``), which the decode must
        present (``RemoteBlocks.token``); "" any authenticated peer. ``streamed``: push mode
        (``groups``/``num_tokens``: ``Hold.groups``)."""
        self._send(Hold(req_id=req_id, block_ids=list(block_ids), lease_s=lease_s, reads=reads,
                        notify_ranks=notify_ranks, expires_unix=expires_unix, engine_id=engine_id,
                        token=token, streamed=streamed, groups=groups, num_tokens=num_tokens,
                        partial=partial, extends=extends))

    def send(self, msg: LayersDone | Cancel) -> None:
        """A message with no answer: push mode's ``LayersDone`` (this rank computed ``msg.layers``
        layers of these streamed holds), a decode's ``Cancel`` (the engine dropped the request)."""
        self._send(msg)

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
        streamed: bool = False,
        groups: GroupedLoad | None = None,
    ) -> None:
        """``state``: (local, remote) blocks of state groups (Mamba/GDN), paired one to one.
        ``trace``: the ``Done`` carries the sidecar's per-hop times (``Done.trace``).
        ``streamed`` (push mode): ``remote.req_id`` is the transfer id, no block ids (several KV
        cache groups: ``groups``)."""
        self._send(
            Recv(req_id=req_id, block_ids=list(block_ids), remote_engine_id=remote.engine_id,
                 remote_host=remote.host, remote_port=remote.port, remote_block_ids=list(remote.block_ids),
                 remote_tp_size=remote.tp_size, tp_rank=tp_rank, remote_req_id=remote.req_id,
                 deadline_s=deadline_s, reply_to_rank=reply_to_rank, expires_unix=expires_unix,
                 remote_generation=remote.generation, engine_id=engine_id, pp_rank=pp_rank,
                 remote_token=remote.token, state_block_ids=list(state[0]) or None,
                 remote_state_block_ids=list(state[1]) or None, trace=trace, streamed=streamed,
                 remote_block_size=remote.block_size, **(groups.fields() if groups else {}))
        )

    def keepalive(self, remote: RemoteBlocks, remote_req_ids: list[str], req_ids: list[str],
                  remote_tokens: list[str] | None = None) -> None:
        """Keep the prefill leases of requests still waiting here alive (``KeepAlive``)."""
        self._send(KeepAlive(remote.engine_id, remote.host, remote.port, remote_req_ids, req_ids,
                             remote_tokens or []))

    def heartbeat(self) -> None:
        """Ask for a Pong without waiting; ``poll`` hands it back in ``Drained.pongs``. A ring
        whose sidecar let go of it (it exited) is dropped first: ZMQ reconnects by itself."""
        if not self._ring_alive() and self._want_ring:
            self._ask_ring()
        self._send(Ping(seq=0))

    def _ring_alive(self) -> bool:
        """Whether a ring is open, dropping one whose sidecar let go of it (it exited)."""
        if self.ring is not None and not self.ring.alive():
            self.ring.close()
            self.ring, self.ring_error = None, "the sidecar closed the ring (it exited or restarted)"
        return self.ring is not None

    def poll(self) -> Drained:
        """Drain every event that already arrived; never blocks."""
        events, self._pending = self._pending + self._early, []
        self._early = []
        bodies = []
        while True:
            try:
                bodies.append(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        events += self._skipping(bodies)
        if self.ring is not None:
            events += self._skipping(self._ring_read())
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
        """Send arbitrary frames (for tests of the sidecar's input validation): one frame
        over the ring when one is open (it then comes from the connection that registered),
        else over the ZMQ socket."""
        if self.ring is not None and len(frames) == 1 and len(frames[0]) <= self.ring.max_frame:
            if not self.ring.write(frames[0]):
                raise SidecarUnavailable(f"sidecar at {self.endpoint}: its ring is full")
            return
        self._sock.send_multipart(list(frames))

    def close(self) -> None:
        self._sock.close(0)
        if self.ring is not None:
            self.ring.close()
        if self._asking is not None:
            self._asking.close()

    # ------------------------------------------------------------------ internals

    def _send(self, msg: EngineRequest) -> None:
        body = encode(msg)
        ring = self.ring if self._ring_alive() else None  # (a dead sidecar's ring: ZMQ queues for the next)
        if ring is not None and len(body) <= ring.max_frame:  # (larger ones: a registration, over ZMQ)
            try:
                written = ring.write(body)
            except RingCorrupt as e:  # (not sent; ZMQ from now on: it raised into vLLM's hooks, a review)
                ring.close()
                self.ring, self.ring_error = None, f"the ring is corrupt: {e}"
                raise SidecarUnavailable(f"sidecar at {self.endpoint}: its ring is corrupt ({e})") from e
            if not written:
                raise SidecarUnavailable(f"sidecar at {self.endpoint} is not taking messages (its ring "
                                         "is full)")
            return
        try:
            self._sock.send(body, zmq.NOBLOCK)
        except zmq.Again as e:
            raise SidecarUnavailable(f"sidecar at {self.endpoint} is not accepting messages") from e

    def _ring_read(self) -> list[bytes]:
        assert self.ring is not None
        try:
            return self.ring.read()
        except RingCorrupt as e:  # (the sidecar's writes cannot be trusted: ZMQ from now on)
            self.ring.close()
            self.ring, self.ring_error = None, f"the ring is corrupt: {e}"
            return []

    def _skipping(self, bodies: Iterable[bytes]) -> list[SidecarEvent]:
        events, skipped = decode_each(bodies)
        self.undecodable += skipped
        return events

    def _wait_one(self, deadline: float, what: str) -> SidecarEvent:
        while True:
            if not self._early and self.ring is not None:
                self._early = self._skipping(self._ring_read())
            if self._early:
                return self._early.pop(0)
            try:
                self._early = self._skipping([self._sock.recv(zmq.NOBLOCK)])
                continue
            except zmq.Again:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SidecarUnavailable(f"no {what} answer from {self.endpoint}{_no_socket(self.endpoint)}")
            if not self._ready():
                self._poller().poll(int(remaining * 1000))


__all__ = ["Drained", "ErrorCode", "RemoteBlocks", "SidecarClient"]


def _no_socket(endpoint: str) -> str:
    """Why an ipc:// sidecar cannot answer, when it is plain: nothing listens at that path."""
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else ""
    if path and not os.path.exists(path):
        return (f" (no socket at {path}: is a sidecar running with --engine-socket {endpoint}? the "
                f"connector's kv_connector_extra_config 'sidecar' names it)")
    return ""


def decode_event(body: bytes) -> SidecarEvent:
    try:
        return sidecar_event_decoder.decode(body)
    except DECODE_ERRORS as e:
        raise ProtocolError(f"undecodable message from sidecar: {e}") from e


def decode_each(bodies: Iterable[bytes]) -> tuple[list[SidecarEvent], int]:
    """Each message on its own, and how many could not be decoded: one that cannot (a newer
    sidecar's event, a corrupt frame) is logged and skipped, never taking the others with it
    (it raised away every event drained beside it: a lost Released pinned its hold; found by
    a review)."""
    out, skipped = [], 0
    for body in bodies:
        try:
            out.append(decode_event(body))
        except ProtocolError as e:
            skipped += 1
            log.warning("%s (skipped)", e)
    return out, skipped
