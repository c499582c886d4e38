"""The prefill side of a sidecar: leases on blocks its engines hold for peers to read.

An engine ``Hold``s blocks under a lease; a reader's ``ReadNotice`` (NIXL notification)
counts its read and releases the lease once every reader read; a reader's ``LeaseRenew``
(on the handshake listener) keeps a lease alive while a decode request waits, or claims it
for a read; the expiry loop ends leases nobody read. Each lease ends exactly once, with a
``Released`` to the engine (the worker that held, or every worker of that engine).

Who may touch a lease: the engine side, only a connection that speaks for the lease's engine
(``kvxfer.sidecar.ownership``: its process registered one of the engine's ranks or is an
ancestor of one) may hold or release; a peer must present the lease's capability token (``Hold.token``,
handed to the decode in kv_transfer_params) and, with a shared secret, be an agent that
completed an authenticated handshake here. Readers are counted per (agent, pp, tp). No
peer can stretch a lease past ``max_read_s`` per read or ``max_lease_s`` in all. Whatever
is refused is counted (``kvxfer_peer_refused_total``) and logged with the sender.

Dependencies are passed in: the registry (which engines exist, their workers), the
observer and ``authenticated`` (did an agent complete an authenticated handshake here).
Nothing is sent from here: each lease that ends leaves a ``Released`` for its engine's
workers in ``outbox``, and ``changed`` tells whoever subscribed (the app sends them, updates
its gauges and the NIXL poll rate).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvxfer.abandoned import Abandoned
from kvxfer.auth import new_token, same_token
from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.leases import Lease, LeaseTable
from kvxfer.observe import Observer
from kvxfer.protocol import (
    DECODE_ERRORS,
    Hold,
    HoldsCheck,
    LeaseRenew,
    LeaseState,
    ReadNotice,
    Release,
    Released,
    read_notice_decoder,
)
from kvxfer.sidecar.admission import admit_hold, check_blocks
from kvxfer.sidecar.lease_words import LeaseWords, deadline_ms, lease_tag
from kvxfer.sidecar.lifecycle import Signal
from kvxfer.sidecar.ownership import Creds, authorize
from kvxfer.sidecar.registry import RankRegistry

BEFORE_HOLD_MAX = 1024  # requests with failed notices kept until their Hold comes
BEFORE_HOLD_READERS = 64  # ... and readers (agent, engine, rank) per request
Reader = tuple[str, str, int, int]  # (agent, engine named, pp rank, tp rank)

log = logging.getLogger("kvxfer.holds")  # (the name operators filter on)


@dataclass(frozen=True)
class Outgoing:
    """A ``Released`` for these engine connections."""

    targets: set[bytes]
    message: Released


class Holds:
    def __init__(self, config: Config, registry: RankRegistry, observer: Observer,
                 authenticated: Callable[[str], bool] = lambda agent: True,
                 abandoned: Abandoned | None = None, words: LeaseWords | None = None) -> None:
        self.config = config
        self.registry = registry
        self.observer = observer
        self._authenticated = authenticated
        self.outbox: list[Outgoing] = []  # Released messages to send (the app takes them)
        self.changed = Signal()  # leases added or ended
        self.table = LeaseTable()
        self.abandoned = abandoned if abandoned is not None else Abandoned()  # (kvxfer.abandoned)
        self._wakeup = asyncio.Event()
        self.words = words if words is not None else LeaseWords(1)  # (kvxfer.sidecar.lease_words)
        # Failed read notices for requests not held yet (a decode that cancelled its load before
        # the prefill's Hold came: push mode), by request id: replayed when the Hold comes.
        self._before_hold: collections.OrderedDict[str, dict[Reader, tuple[float, bytes]]] = (
            collections.OrderedDict())

    def __len__(self) -> int:
        return len(self.table)

    # ------------------------------------------------------------------ engine requests

    def hold(self, ident: bytes, msg: Hold, draining: bool, sender: Creds) -> None:
        """Raises RequestError (the engine gets an ``Error``); ``sender``: the sending process."""
        engine = self.registry.engine_of(msg.engine_id)
        authorize(sender, self.registry.holders(engine), self.config.engine_ownership, "hold", engine,
                  msg.req_id)
        ranks = self.registry.of_engine(engine)
        admit_hold(msg, engine, min(r.layout.num_blocks for r in ranks) if ranks else None,
                   draining=draining, abandoned=(engine, msg.req_id) in self.abandoned, now_unix=time.time(),
                   registered=self.registry.engines,
                   missing=ranks[0].layout.tp_size * ranks[0].layout.pp_size - len(ranks) if ranks else 0)
        now = time.monotonic()
        duration = msg.lease_s or self.config.lease_s
        lease = Lease(req_id=msg.req_id, owner=ident, block_ids=list(msg.block_ids),
                      expires=now + duration, reads_expected=msg.reads, created=now,
                      notify_ranks=msg.notify_ranks, engine=engine, duration=duration, token=msg.token,
                      groups=msg.groups, num_tokens=msg.num_tokens,
                      read_token=new_token() if is_push_hold(msg) else "")
        self.table.add(lease)
        self.words.put(lease.key, lease_tag(engine, msg.req_id, lease.proof_token()),
                       deadline_ms(msg.expires_unix))
        self.changed.emit()
        self._wakeup.set()
        kept = self._before_hold.pop(msg.req_id, {})
        for (agent, named, _pp, _tp, _engine), (at, payload) in kept.items():
            if named in ("", engine) and now - at < duration:  # (its readers will not read: said now)
                try:
                    self.on_notice(agent, payload)
                except Exception:  # (the Hold is made: never an Error for it)
                    log.exception("a kept read notice for %s", msg.req_id)

    def release_request(self, msg: Release, sender: Creds) -> None:
        """The engine dropped a request: end its lease (``aborted``), if ``sender`` speaks for
        the lease's engine."""
        engine = self.registry.engine_of(msg.engine_id)
        authorize(sender, self.registry.holders(engine), self.config.engine_ownership, "release", engine,
                  msg.req_id)
        lease = self.table.pop((engine, msg.req_id))
        if lease is None:
            raise RequestError(ErrorCode.UNKNOWN_REQUEST, "not held", msg.req_id)
        self.release(lease, "aborted")

    # ------------------------------------------------------------------ peers

    def lease_for(self, agent: str, engine: str, req_id: str, token: str, message: str) -> Lease | None:
        """The lease a peer's message means, if that peer may touch it: None when there is
        none, or when the sender is not authenticated or presents the wrong token (refused:
        counted and logged with the sender; to the sender it looks like no lease at all).

        A lease whose time ran out ends first, even when the timer (``run``) has not run yet:
        this process was stopped past it, and its engine may have freed the blocks by now."""
        self.expire_due()
        key = self.table.resolve(engine, req_id)
        lease = self.table.get(key) if key is not None else None
        if lease is None:
            return None
        if not self._authenticated(agent):
            self.observer.peer_refused(agent, req_id, message, "unauthenticated")
            return None
        if lease.token and not same_token(lease.token, token) and not (
                lease.read_token and same_token(lease.read_token, token)):
            self.observer.peer_refused(agent, req_id, message, "bad_token")
            return None
        return lease

    def is_authenticated(self, agent: str) -> bool:
        return self._authenticated(agent)

    def absent(self, engine: str, req_id: str) -> Literal["gone", "unknown"]:
        """What a peer asking for a lease ``lease_for`` did not give it is told: "gone" (it
        ended here: released, aborted, expired) or "unknown" (never held here, not yet, or
        refused to that peer: a refusal looks like no lease at all)."""
        known = self.table.resolve(engine, req_id) is not None  # (refused, not ended)
        return "gone" if not known and self.table.ended(engine, req_id) else "unknown"

    def grow(self, msg: Hold, sender: Creds, growing: bool) -> Lease:
        """The next chunk of a prompt held in chunks (``Hold.extends``): ``block_ids`` is the
        list so far, starting with the one held; the lease renewed as a new hold's would be.
        RequestError: no partial hold of this id and token here (``growing`` False: none, or
        no longer partial, or not streamed: ``unknown_request``, nothing ends), or an extension
        that cannot be right (a list not starting with the one held, blocks out of range): the
        lease ends ``aborted`` (its decode recomputes) and the refusal is ``incompatible``, never
        a code that tells the connector no lease was made (one was, and ends with a Released)."""
        engine = self.registry.engine_of(msg.engine_id)
        authorize(sender, self.registry.holders(engine), self.config.engine_ownership, "hold", engine,
                  msg.req_id)
        lease = self.table.get((engine, msg.req_id))
        if lease is None or lease.token != msg.token or not growing:  # (``growing``: a partial hold)
            raise RequestError(ErrorCode.UNKNOWN_REQUEST, "no partial hold of this id to extend", msg.req_id)
        try:
            if lease.groups is not None or msg.groups is not None:
                grown_groups(lease.block_ids, lease.groups, msg)
            elif list(msg.block_ids[:len(lease.block_ids)]) != lease.block_ids:
                raise RequestError(ErrorCode.MALFORMED, "an extended hold starts with the blocks held")
            if msg.expires_unix and time.time() > msg.expires_unix:
                raise RequestError(ErrorCode.EXPIRED, "the extension came after its engine's deadline")
            fewest = min((r.layout.num_blocks for r in self.registry.of_engine(engine)), default=0)
            check_blocks(msg.req_id, msg.block_ids, fewest, "held")
        except RequestError as e:
            if self.table.pop(lease.key) is not None:
                self.release(lease, "aborted")
            raise RequestError(ErrorCode.INCOMPATIBLE, f"extension refused ({e.code}: {e.reason}); "
                               "the lease ended", msg.req_id) from None
        lease.block_ids = list(msg.block_ids)
        lease.groups = msg.groups if msg.groups is not None else lease.groups
        until = time.monotonic() + (msg.lease_s or lease.duration or self.config.lease_s)
        if self.table.extend(lease.key, min(until, lease.created + self.config.max_lease_s)):
            self._wakeup.set()
        if msg.expires_unix:  # (its lease word's deadline: the engine's own, renewed)
            self.words.put(lease.key, lease_tag(engine, msg.req_id, lease.proof_token()),
                           deadline_ms(msg.expires_unix))
        return lease

    def extend(self, lease: Lease, by_s: float, agent: str, message: str, cap_s: float) -> None:
        """Keep ``lease`` ``by_s`` more seconds, but never more than ``cap_s`` at once nor past
        ``max_lease_s`` from its hold (no peer can pin blocks for ever)."""
        if by_s > cap_s:
            self.observer.peer_refused(agent, lease.req_id, message, "capped")
            by_s = cap_s
        until = min(time.monotonic() + by_s, lease.created + self.config.max_lease_s)
        if self.table.extend(lease.key, until):
            self._wakeup.set()

    def on_notice(self, agent: str, payload: bytes) -> None:
        """A reader's ``ReadNotice``: started (extend), or finished (count; release)."""
        try:
            notice = read_notice_decoder.decode(payload)
        except DECODE_ERRORS:
            self.observer.stray_notice(agent, "", "malformed")
            return
        lease = self.lease_for(agent, notice.engine_id, notice.req_id, notice.token, "read_notice")
        if lease is None:
            if self.table.resolve(notice.engine_id, notice.req_id) is None:  # (not refused: none)
                if (not notice.ok and not notice.reading_s and self._authenticated(agent)
                        and not self.table.ended(notice.engine_id, notice.req_id)):
                    self._keep_until_held(notice, agent, payload)
                    return
                self.observer.stray_notice(agent, notice.req_id,
                                           "expired_lease" if notice.reading_s > 0 else "unknown")
            return
        # (a reader: its sidecar and, when it says, its engine: two decode engines behind one
        # sidecar read one request's blocks apart; found by a review)
        reader = f"{agent}@{notice.reader_engine}" if notice.reader_engine else agent
        if notice.reading_s > 0:
            self.table.note_started(lease.key, (reader, notice.pp_rank, notice.tp_rank))
            self.extend(lease, notice.reading_s + 1.0, agent, "read_notice", self.config.max_read_s)
            return
        before = lease.reads_seen
        done = self.table.note_read(lease.key, (reader, notice.pp_rank, notice.tp_rank), notice.readers)
        if notice.ok and lease.reads_seen > before:  # (a repeated notice counts once)
            self.observer.served(agent, len(lease.block_ids) if before == 0 else 0)
        if done is not None:
            self.release(done, "read" if notice.ok else "aborted")

    def _keep_until_held(self, notice: ReadNotice, agent: str, payload: bytes) -> None:
        """An authenticated decode will not read a request this sidecar does not hold yet:
        replayed when it is (the replay checks the token as any notice). One per reader (agent,
        engine, rank) and request, BEFORE_HOLD_MAX requests, the oldest dropped first."""
        readers = self._before_hold.setdefault(notice.req_id, {})
        reader = (agent, notice.engine_id, notice.pp_rank, notice.tp_rank, notice.reader_engine)
        if reader in readers or len(readers) < BEFORE_HOLD_READERS:
            readers[reader] = (time.monotonic(), payload)
        self._before_hold.move_to_end(notice.req_id)
        while len(self._before_hold) > BEFORE_HOLD_MAX:
            self._before_hold.popitem(last=False)

    def renew(self, req: LeaseRenew) -> LeaseState:
        """A peer still means to read these requests: extend their leases (by ``extend_s``,
        or each lease's own duration); say which are held, gone, or unknown here."""
        held: list[Any] = []
        published: list[bool] = []
        answered: dict[tuple[str, str], int] = {}  # a request named twice: one answer, extended once
        for i, rid in enumerate(req.req_ids):
            token = req.tokens[i] if i < len(req.tokens) else ""
            if (at := answered.setdefault((rid, token), i)) != i:
                held.append(held[at])
                published.append(published[at])
                continue
            lease = self.lease_for(req.agent_name, req.engine_id, rid, token, "lease_renew")
            if lease is None:
                held.append(absent := self.absent(req.engine_id, rid))
                if absent == "gone":
                    self.observer.stray_notice(req.agent_name, rid, "expired_lease")
                published.append(False)
                continue
            self.extend(lease, req.extend_s or lease.duration or self.config.lease_s, req.agent_name,
                         "lease_renew", self.config.max_read_s)
            held.append("held")
            # (its word is tagged with the read token: a reader that claims with the transfer id,
            # an older decode sidecar, would find no word of its own: a claim after the landing
            # decides; found by a review)
            published.append(self.words.word(lease.key) is not None and (
                not lease.read_token or same_token(lease.read_token, token)))
        return LeaseState(seq=req.seq, held=held, published=published)

    # ------------------------------------------------------------------ endings

    def release(self, lease: Lease, reason: str) -> None:
        """Tell the engine it may reuse the blocks: the holder, or every worker of its engine
        (its lease word zeroed first: no reader may take the lease for held after this)."""
        self.words.clear(lease.key)
        ev = Released(req_id=lease.req_id, reason=reason, reads=lease.reads_seen)  # type: ignore[arg-type]
        self.observer.lease_released(lease.req_id, reason)
        targets = self.registry.owners(lease.engine) if lease.notify_ranks else {lease.owner}
        self.outbox.append(Outgoing(targets or {lease.owner}, ev))
        self.changed.emit()

    def take_outbox(self) -> list[Outgoing]:
        out, self.outbox = self.outbox, []
        return out

    def engine_holds(self, engine: str, made_by: float | None = None) -> int:
        """Leases held for ``engine`` (``made_by``: made by then, monotonic)."""
        return sum(1 for lease in self.table.items() if lease.engine == engine
                   and (made_by is None or lease.created <= made_by))

    def end_engine(self, engine: str) -> int:
        """Its rank's memory is being replaced: end the engine's leases now (``aborted``)."""
        leases = self.table.drop(engine=engine)
        for lease in leases:
            self.release(lease, "aborted")
        return len(leases)

    def release_all(self) -> int:
        """Drain: end every lease now (``aborted``); returns how many."""
        leases = self.table.drain_all()
        for lease in leases:
            self.release(lease, "aborted")
        return len(leases)

    async def run(self) -> None:
        """End leases whose time ran out."""
        while True:
            nxt = self.table.next_expiry()
            timeout = None if nxt is None else max(0.0, nxt - time.monotonic())
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            self.expire_due()

    def expire_due(self) -> None:
        """End every lease whose time ran out."""
        for lease in self.table.expire(time.monotonic()):
            log.warning("lease on request %s expired after %.1fs with %d/%d reads", lease.req_id,
                        time.monotonic() - lease.created, lease.reads_seen, lease.reads_expected)
            self.release(lease, "expired")


def grown_groups(held: list[int], groups: list[list[int]] | None, msg: Hold) -> None:
    """A grouped hold's extension (RequestError ``malformed``, else fine): lists for as many
    groups, each group held so far extended (its list starts with the one held; a group held
    by chunk is full attention, whose blocks vLLM keeps), every block held still held, and no
    group naming a block the hold does not."""
    if groups is None or msg.groups is None or len(msg.groups) != len(groups):
        raise RequestError(ErrorCode.MALFORMED, "an extended hold names other KV cache groups than the "
                           "one held")
    for i, (old, new) in enumerate(zip(groups, msg.groups, strict=True)):
        if old and list(new[:len(old)]) != list(old):
            raise RequestError(ErrorCode.MALFORMED, f"an extended hold's group {i} starts with other "
                               "blocks than the ones held")
    now = set(msg.block_ids)
    if not now.issuperset(held) or any(b and b not in now for g in msg.groups for b in g):
        raise RequestError(ErrorCode.MALFORMED, "an extended hold lets go of blocks held, or its groups "
                           "name blocks it does not hold")


def is_push_hold(msg: Hold) -> bool:
    """A push hold (streamed, or named by its capability: the transfer id, which a router's
    retry holds again): its reads prove it with a read token of its own (``Lease.read_token``)."""
    return msg.streamed or (bool(msg.token) and msg.token == msg.req_id)


def unknown_holds(holds: Holds, msg: HoldsCheck, sender: Creds, send: Callable[[Released], None]) -> None:
    """A worker's overdue holds this sidecar does not hold (``HoldsCheck``: their Hold never
    came, or their Released was lost on the way), each answered ``Released(reason="unknown")``:
    the worker frees their blocks. Their Hold is refused from now on should it still come (it
    cannot be admitted anyway: the worker asks only past the deadline the Hold carries). Sent
    through ``send``: the handler returns nothing (a value returned is awaited)."""
    engine = holds.registry.engine_of(msg.engine_id)
    authorize(sender, holds.registry.holders(engine), holds.config.engine_ownership, "checking holds", engine)
    gone = [r for r in dict.fromkeys(msg.req_ids) if (engine, r) not in holds.table]
    if gone:
        holds.abandoned.add(engine, gone, holds.config.lease_s)
        log.warning("engine %s asked after %d holds this sidecar does not hold (e.g. %s): answered unknown, "
                    "its blocks are freed", engine, len(gone), gone[0])
    for r in gone:
        holds.observer.lease_released(r, "unknown")  # (kvxfer_leases_released_total{reason="unknown"})
        send(Released(req_id=r, reason="unknown"))
