"""The prefill side of push mode: held requests whose KV is still being computed, and the
decodes watching them (``kvxfer.sidecar.layer_stream`` has the pure book and the protocol).

An engine's streamed ``Hold`` (sent as soon as its blocks are allocated) starts a request's
book; its workers' ``LayersDone`` advance it; a decode sidecar's ``LayerWatch`` (on the
handshake listener, authenticated and bound to the lease's token like every peer request) is
answered ``LayersAt`` at once when more layers are ready than it has seen, else when they are,
when the lease ends, or after its ``wait_s``. Watches wait here, not in a listener slot: a
thousand decodes watching cost no handshake its turn. A watch renews the lease like a claim.
A watch for a lease not held yet (the decode was dispatched first; a prompt computed in
chunks is held only once its first chunk is scheduled) waits for its ``Hold`` the same way (``EARLY_MAX`` at
once), so the decode learns of it when it comes, not at its next ask (it used to ask again
every 2 ms, backing off to 100 ms: up to 100 ms lost per request after a chunked prefill).

Direction: this shell calls ``Holds`` (same layer) and is called by the app (engine messages)
and the peer server (watches, with a function that sends the answer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvxfer.auth import same_token
from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.leases import Lease
from kvxfer.observe import Observer
from kvxfer.protocol import ChunkWatch, Hold, LayersAt, LayersDone, LayerWatch
from kvxfer.sidecar.holds import Holds, is_push_hold
from kvxfer.sidecar.layer_stream import LayerBook, LayerKey, RefusedHold, RefusedHolds, stages_of
from kvxfer.sidecar.ownership import Creds, authorize
from kvxfer.sidecar.registry import RankRegistry

log = logging.getLogger("kvxfer.streams")
EARLY_MAX = 1024  # watches waiting, in all, for leases not held yet; more: answered "unknown" at once
EARLY_PER_AGENT = 256  # ... of them from one decode sidecar (one peer cannot take every place)
EARLY_WAIT_MAX_S = 5.0  # the longest a watch waits for its Hold, and then for layers, in all


@dataclass(eq=False)
class Watch:
    """A decode's watch, waiting for more layers."""

    msg: LayerWatch
    reply: Callable[[LayersAt], None]
    timer: asyncio.TimerHandle | None = None
    parked_until: float = 0.0  # (a watch that came before its Hold: its wait ends then, in all)


class StreamServer:
    def __init__(self, *, config: Config, registry: RankRegistry, holds: Holds, observer: Observer,
                 generation: Callable[[], str]) -> None:
        self.config = config
        self.registry = registry
        self.holds = holds
        self.observer = observer
        self._generation = generation
        self.book = LayerBook()
        self._early: dict[str, list[Watch]] = {}  # by request id: watches for leases not held yet
        self._early_by_agent: dict[str, int] = {}  # how many of them each decode sidecar sent
        self.refused = RefusedHolds()
        holds.changed.subscribe(self._leases_changed)

    def __len__(self) -> int:
        return len(self.book)

    # ------------------------------------------------------------------ the engine

    def hold(self, ident: bytes, msg: Hold, draining: bool, sender: Creds) -> None:
        """Any Hold: held (``Holds``); a streamed one also starts its book; watches that came
        before it are watched now. A chunk's (``extends``) grows a streamed hold."""
        if msg.extends:
            prog = self.book.get((self.registry.engine_of(msg.engine_id), msg.req_id))
            lease = self.holds.grow(msg, sender, growing=prog is not None and prog.partial)
            if lease.key in self.book:
                for watch in self.book.extend(lease.key, msg.partial):
                    self._answer(lease.key, watch)
            return
        engine = self.registry.engine_of(msg.engine_id)
        try:
            self.holds.hold(ident, msg, draining, sender)
        except RequestError as e:
            if msg.streamed:  # (refused)
                self.book.not_held((engine, msg.req_id))
            if is_push_hold(msg):  # (its decode is told when it watches: ``_refused``)
                self.refused.add(msg.req_id, RefusedHold(engine, msg.token, e.code, e.reason,
                                                         time.monotonic() + self.config.lease_s))
                if msg.req_id in self._early:
                    self._hold_came(msg.req_id)
            raise
        self.refused.drop(msg.req_id)
        if msg.streamed and (engine, msg.req_id) in self.holds.table:  # (not released at once: its
            # decode cancelled before it came, ``Holds._keep_until_held``)
            stages, tp_size = stages_of([r.layout for r in self.registry.of_engine(engine)])
            self.book.start((engine, msg.req_id), stages, tp_size, partial=msg.partial)
            log.debug("streamed hold %s of engine %s: %d blocks, layers %s by %d ranks", msg.req_id, engine,
                      len(msg.block_ids), stages, tp_size)
        elif msg.streamed:  # (released at once)
            self.book.not_held((engine, msg.req_id))
        if msg.req_id in self._early:
            self._hold_came(msg.req_id)

    def on_layers(self, msg: LayersDone, sender: Creds) -> None:
        """A worker computed more layers of these requests (RequestError: it does not speak
        for the engine)."""
        engine = self.registry.engine_of(msg.engine_id)
        authorize(sender, self.registry.holders(engine), self.config.engine_ownership, "report layers",
                  engine, msg.req_ids[0] if msg.req_ids else "")
        if self.registry.find(engine, msg.pp_rank, msg.tp_rank) is None:
            raise RequestError(ErrorCode.NOT_REGISTERED, f"rank pp{msg.pp_rank}/tp{msg.tp_rank} of engine "
                               f"{engine!r} is not registered")
        log.debug("layers %d of %s computed by pp%d/tp%d", msg.layers, msg.req_ids, msg.pp_rank, msg.tp_rank)
        for req_id in msg.req_ids:
            key = (engine, req_id)
            if key not in self.book and self.holds.table.ended(engine, req_id):
                continue  # (its lease ended: kept as early, they would count for a new hold of the id)
            for watch in self.book.report(key, msg.pp_rank, msg.tp_rank, msg.layers, msg.blocks):
                self._answer(key, watch)

    # ------------------------------------------------------------------ decodes

    def watch(self, msg: LayerWatch, reply: Callable[[LayersAt], None]) -> None:
        """A decode's watch: answered now, or once more layers are ready (``reply`` sends)."""
        self._watch(msg, reply, first=True)

    def _watch(self, msg: LayerWatch, reply: Callable[[LayersAt], None], first: bool) -> None:
        """``first``: as it came (else woken by a Hold: never parked twice, never counted twice)."""
        lease = self.holds.lease_for(msg.agent_name, msg.engine_id, msg.req_id, msg.token, "layer_watch")
        if first:
            self.observer.layer_watch(lease is not None)
        if lease is None:
            if (refused := self._refused(msg)) is not None:
                reply(refused)
            elif not (first and self._park_early(msg, reply)):
                reply(self._not_held(msg))
            return
        key = lease.key
        if key not in self.book:  # (held, but not streamed: every layer is ready)
            reply(self._held(msg, lease, None))
            return
        self._extend(lease, msg)
        watch = Watch(msg, reply)
        if self.book.watch(key, msg.have, watch, msg.seen if isinstance(msg, ChunkWatch) else None):
            self._answer(key, watch)
            return
        watch.timer = asyncio.get_running_loop().call_later(msg.wait_s, self._timed_out, key, watch)

    def _park_early(self, msg: LayerWatch, reply: Callable[[LayersAt], None]) -> bool:
        """Keep a watch for a lease not held here at all yet (not refused to it, not ended) until
        its Hold comes (``_hold_came``: then it is watched again, token and all, for what is
        left of its wait) or its wait ends (``EARLY_WAIT_MAX_S`` at most)."""
        agent = msg.agent_name
        if msg.wait_s <= 0 or sum(self._early_by_agent.values()) >= EARLY_MAX:
            return False
        if self._early_by_agent.get(agent, 0) >= EARLY_PER_AGENT:
            return False
        table = self.holds.table
        if table.resolve(msg.engine_id, msg.req_id) is not None or table.ended(msg.engine_id, msg.req_id):
            return False  # (held, and refused to this peer; or ended here: answered as before)
        wait = min(msg.wait_s, EARLY_WAIT_MAX_S)
        watch = Watch(msg, reply, parked_until=time.monotonic() + wait)
        watch.timer = asyncio.get_running_loop().call_later(wait, self._early_timed_out, watch)
        self._early.setdefault(msg.req_id, []).append(watch)
        self._early_by_agent[agent] = self._early_by_agent.get(agent, 0) + 1
        return True

    def _unpark(self, watch: Watch) -> None:
        agent = watch.msg.agent_name
        self._early_by_agent[agent] -= 1
        if not self._early_by_agent[agent]:
            del self._early_by_agent[agent]

    def _early_timed_out(self, watch: Watch) -> None:
        waiting = self._early.get(watch.msg.req_id, [])
        if watch in waiting:
            waiting.remove(watch)
            self._unpark(watch)
            if not waiting:
                del self._early[watch.msg.req_id]
            try:
                watch.reply(self._not_held(watch.msg))
            except Exception:
                log.exception("answering a layer watch failed")

    def _hold_came(self, req_id: str) -> None:
        now = time.monotonic()
        for watch in self._early.pop(req_id, []):
            self._unpark(watch)
            if watch.timer is not None:
                watch.timer.cancel()
            left = msgspec.structs.replace(watch.msg, wait_s=max(0.0, watch.parked_until - now))
            try:
                self._watch(left, watch.reply, first=False)
            except Exception:
                log.exception("answering a layer watch failed")

    def _timed_out(self, key: LayerKey, watch: Watch) -> None:
        if self.book.unwatch(key, watch):
            self._answer(key, watch)

    def _answer(self, key: LayerKey, watch: Watch) -> None:
        if watch.timer is not None:
            watch.timer.cancel()
        lease = self.holds.table.get(key)
        msg = watch.msg
        if lease is None:
            answer = self._not_held(msg)
        else:
            self._extend(lease, msg)
            answer = self._held(msg, lease, key)
        try:
            watch.reply(answer)
        except Exception:
            log.exception("answering a layer watch failed")

    def _held(self, msg: LayerWatch, lease: Lease, key: LayerKey | None) -> LayersAt:
        prog = self.book.get(key) if key is not None else None
        ranks = self.registry.of_engine(lease.engine)
        stages, tp_size = stages_of([r.layout for r in ranks])
        total = sum(n for _, n in stages.values())
        ready = prog.ready if prog is not None else total
        if prog is not None and prog.partial and not isinstance(msg, ChunkWatch):
            return LayersAt(seq=msg.seq, held="unknown", generation=self._generation())  # (an older
            # reader never sees a list that is not the last: it asks again)
        chunks = ({"partial": prog.partial, "complete": min(prog.complete, len(lease.block_ids)),
                   "version": prog.version} if prog else {})
        return LayersAt(seq=msg.seq, held="held", ready=ready, total=total, block_ids=list(lease.block_ids),
                        generation=self._generation(), tp_size=tp_size, engine_id=lease.engine,
                        groups=lease.groups, num_tokens=lease.num_tokens, token=lease.read_token, **chunks)

    def _refused(self, msg: LayerWatch) -> LayersAt | None:
        """The answer to a watch of a push hold refused here (to an authenticated peer that
        presents its token), or None."""
        got = self.refused.find(msg.req_id, msg.engine_id, time.monotonic())
        if got is None or not self.holds.is_authenticated(msg.agent_name) or (
                got.token and not same_token(got.token, msg.token)):
            return None
        return LayersAt(seq=msg.seq, held="refused", code=got.code, reason=f"the prefill's hold was refused: "
                        f"{got.reason}", generation=self._generation())

    def _not_held(self, msg: LayerWatch) -> LayersAt:
        return LayersAt(seq=msg.seq, held=self.holds.absent(msg.engine_id, msg.req_id),
                        generation=self._generation())

    def _extend(self, lease: Lease, msg: LayerWatch) -> None:
        self.holds.extend(lease, msg.extend_s or lease.duration or self.config.lease_s, msg.agent_name,
                          "layer_watch", self.config.max_read_s)

    # ------------------------------------------------------------------ endings

    def _leases_changed(self) -> None:
        """Leases ended: their books too, and their watchers are told "gone"."""
        for key in [k for k in self.book.held() if k not in self.holds.table]:
            for watch in self.book.end(key):
                self._answer(key, watch)
