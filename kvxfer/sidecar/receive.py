"""One receive (a request's blocks for one local rank), as a state machine with no I/O.

Phases: ``handshake`` (the peer is being handshaked, or the read planned) -> ``reading``
(the read is posted; its lease *claim* runs beside it, unless its lease word will prove it:
``claim_deferred``) -> ``verifying`` (it landed; the claim's answer or a sampled digest is
awaited) -> ended. Every receive ends exactly once,
in one of the ``Exit``s, and its ``Outcome`` says everything the shell must do about it:
what the engine is told, whether the prefill gets a read notice (and with which verdict) or
its peer is dropped, whether the peer is to be handshaked again.

The rules that keep blocks safe live here:
- a read that landed is reported only once the prefill confirmed its lease held the blocks
  (the claim), or its lease word read after the landing proved it (``lease_words``); a lease
  that was over, or a claim that failed, fails the load;
- a read that failed is reported only after the NIXL port settled it (its event);
- a cancelled receive whose read is posted is failed by the port (``cancel`` says so), never
  here, so no late chunk lands after its ``Failed``.

``plan_read`` and ``claim_verdict`` are the pure halves of planning a read and judging a
claim's answer. The shell (``kvxfer.sidecar.receiver``) does the I/O and feeds the results back.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import KVLayout, RankInfo, Recv
from kvxfer.sidecar.admission import check_blocks
from kvxfer.sidecar.nixl_types import ReadFinished
from kvxfer.topology import BlockPairing, Incompatible, RankPlan, block_pairing, plan_stages, plan_state


class Phase(enum.StrEnum):
    HANDSHAKE = "handshake"
    READING = "reading"
    VERIFYING = "verifying"
    ENDED = "ended"


class Exit(enum.StrEnum):
    EMPTY = "empty"  # nothing to read (a full prefix hit, an abort): Done, the prefill released
    DONE = "done"  # read, claimed (and verified when sampled)
    NOT_STARTED = "not_started"  # handshake, plan or deadline failed before anything was posted
    READ_FAILED = "read_failed"  # the port reported the read failed (settled), cancels included
    CLAIM_REFUSED = "claim_refused"  # it landed, but the prefill did not confirm its lease
    INTEGRITY = "integrity"  # it landed, but the sampled digests differ
    CANCELLED = "cancelled"  # cancelled before a read was posted, or while verifying


class Step(enum.Enum):
    WAIT = "wait"  # nothing to do until the next event
    CHECK = "check"  # landed and claimed: verify a sample (``verifying``), or end (``succeed``)
    REPROVE = "reprove"  # read its lease word again (``reproved``): the first read did not show it
    RECLAIM = "reclaim"  # claim again, after the landing (``reclaimed``): nothing proved the lease then
    END = "end"  # ended: ``outcome`` says what to do


@dataclass(frozen=True)
class Outcome:
    exit: Exit
    error: RequestError | None = None  # None: Done
    read: ReadFinished | None = None  # what landed (sizes and times for Done)
    notice: bool | None = None  # a ReadNotice to the prefill with this verdict (None: none)
    drop_peer: bool = False  # the peer disconnected: forget it instead of notifying
    peer_failed: bool = False  # count a failure and handshake again before the next read

    @property
    def ok(self) -> bool:
        return self.error is None


_PENDING = object()


class Receive:
    """The state of one receive; every method is a transition (see the module docstring)."""

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        self.phase = Phase.HANDSHAKE
        self.outcome: Outcome | None = None
        self._read: ReadFinished | None = None
        self._claim: object = None  # None: no claim; _PENDING; then the refusal or True
        self._published = False  # the claim said the lease's word is published
        self._proof: bool | None = None  # its word read after the landing: showed the lease, or not
        self._after = False  # its claim was sent after the data landed (or the bytes were copied under it)
        self.deferred = False  # no claim went beside the read (``claim_deferred``)

    # ------------------------------------------------------------------ before the read

    def start(self, nothing_to_read: bool, remaining_s: float) -> Step:
        """Planned: post the read (``reading``, a claim pending), or end at once."""
        assert self.phase is Phase.HANDSHAKE, self.phase
        if nothing_to_read:
            return self._end(Outcome(Exit.EMPTY, notice=True))
        if remaining_s <= 0:
            return self.not_started(RequestError(ErrorCode.DEADLINE, "deadline passed during handshake"))
        self.phase = Phase.READING
        self._claim = _PENDING
        return Step.WAIT

    def not_started(self, err: RequestError, tell: bool = False) -> Step:
        """The handshake, the plan or the post failed: nothing was posted. ``tell``: the prefill
        may have reserved something for it (a staged copy asked for): it is told this reader
        will not read (else its slot and lease waited for their time to run out)."""
        if self.phase is Phase.ENDED:
            return Step.WAIT
        return self._end(Outcome(Exit.NOT_STARTED, error=err, notice=False if tell else None))

    # ------------------------------------------------------------------ events

    def landed(self, event: ReadFinished, proof: bool | None = None) -> Step:
        """The port's report: landed, or failed and settled. ``proof``: what its lease word,
        read after it landed, showed (``kvxfer.sidecar.lease_words``; None: not read). True:
        the lease still held, the claim's answer is not waited for (a refusal that came first
        still fails it). False: once the claim says the word is published, read it again."""
        if self.phase is Phase.ENDED:
            return Step.WAIT
        if not event.ok:
            err = RequestError(event.code, event.reason, self.req_id)
            disconnected = event.code == ErrorCode.PEER_DISCONNECTED
            stalled = event.code == ErrorCode.PEER_STALLED  # (dropped already; no notice to it)
            return self._end(Outcome(Exit.READ_FAILED, error=err, read=event,
                                     notice=None if disconnected or stalled else False,
                                     drop_peer=disconnected, peer_failed=True))
        self._read = event
        self._proof = proof
        return self._after_read()

    def claim_deferred(self) -> None:
        """No claim beside this read (posted, not landed): its lease word, read once it
        landed, proves it; only a word that does not is followed by a claim, sent after the
        landing (``RECLAIM``). What else the claim did: the read's ``ReadNotice``, sent once
        its chunks are posted, extends the lease over it (not while it waits behind the cap
        on chunks in flight), and the stall guard probes a peer reads run against."""
        if self.phase is Phase.READING and self._claim is _PENDING:
            self._claim, self.deferred = None, True

    def claim_sent(self) -> bool:
        """Its claim goes out now: once the data landed (a read that landed inside its post), its
        "held" proves the lease held after the landing (True: then it must be a claim of its own,
        not another rank's sent earlier)."""
        self._after = self._read is not None
        return self._after

    def claimed(self, refusal: RequestError | None, published: bool = False, copied: bool = False) -> Step:
        """The claim's answer: None, the prefill held the blocks (``published``: and its lease
        word is published); else why the read must not be trusted. ``copied``: a staged read's
        (the prefill copied the bytes into its slot under the lease: ``trust_until`` guards it)."""
        if self.phase is Phase.ENDED or self._claim is not _PENDING:
            return Step.WAIT
        self._after = self._after or copied
        if self._read is not None and self._proof is True:
            return Step.WAIT  # (its lease word proved it after the landing: the answer is moot)
        self._published = published and refusal is None
        self._claim = True if refusal is None else RequestError(refusal.code, refusal.reason, self.req_id)
        if self._read is None:
            return Step.WAIT  # (not landed yet)
        return self._after_read()

    def reproved(self, shows: bool | None) -> Step:
        """The lease word read again (after the claim said it is published): it shows the
        lease, or the lease ended during the read (the engine aborted, a drain); None: it could
        not be read (no word address here, the read failed): a claim sent after the landing
        decides (``reclaimed``), unless the first one was sent after it already."""
        if self.phase is Phase.ENDED:
            return Step.WAIT
        if shows is None:
            return Step.CHECK if self._after else Step.RECLAIM
        if shows:
            self._proof = True
            return Step.CHECK
        return self._end(Outcome(Exit.CLAIM_REFUSED, error=RequestError(
            ErrorCode.EXPIRED, "the prefill's lease ended while the blocks were read (its lease word was "
            "cleared): they may hold another request's KV; not used", self.req_id),
            read=self._read, notice=False, peer_failed=True))

    def reclaimed(self, refusal: RequestError | None) -> Step:
        """The answer to a claim sent after the landing (nothing else proved the lease held
        then: no lease word, or it could not be read; the first claim's "held" may predate the
        landing, and a lease the prefill ended during the read, a drain or an abort, was
        delivered with the reused blocks' bytes: found by a review)."""
        if self.phase is Phase.ENDED:
            return Step.WAIT
        if refusal is None:
            self._after = True
            self._claim = True  # (a claim deferred to the landing: this is its "held")
            return Step.CHECK
        why = "its lease word did not show it" if self.deferred else "no lease word"
        err = RequestError(refusal.code, f"the prefill's lease ended before the read was proven ({why}; "
                           f"asked after the landing: [{refusal.code}])", self.req_id)
        return self._end(Outcome(Exit.CLAIM_REFUSED, error=err, read=self._read, notice=False,
                                 peer_failed=True))

    def verifying(self) -> None:
        """A sample of this read is being digested on both sides."""
        assert self._read is not None, "not landed"
        assert self._trusted, "not claimed"
        self.phase = Phase.VERIFYING

    def succeed(self) -> Step:
        """Landed, claimed, and verified or not sampled (or unverifiable: not a verdict)."""
        assert self._read is not None, "not landed"
        assert self._trusted, "not claimed"
        return self._end(Outcome(Exit.DONE, read=self._read, notice=True))

    @property
    def _trusted(self) -> bool:
        return self._claim is True or (self._proof is True and not isinstance(self._claim, RequestError))

    def verified(self, mismatch: RequestError | None) -> Step:
        """The digests' verdict (None: they match, or could not be taken)."""
        if self.phase is Phase.ENDED:
            return Step.WAIT
        if mismatch is None:
            return self.succeed()
        return self._end(Outcome(Exit.INTEGRITY, error=mismatch, read=self._read, notice=False,
                                 peer_failed=True))

    @property
    def read_in_flight(self) -> bool:
        """Posted and not landed: a cancel must go to the port, whose failure comes back
        through ``landed`` once the read settled (no chunk can land after that)."""
        return self.phase is Phase.READING and self._read is None

    def cancelled(self, err: RequestError) -> Step:
        """Cancelled with no read in flight (before the post, or once it landed): the prefill
        is told it will not be read (its lease ends ``aborted`` once every rank said so)."""
        if self.phase is Phase.ENDED:
            return Step.WAIT
        return self._end(Outcome(Exit.CANCELLED, error=err, notice=False))

    # ------------------------------------------------------------------ internals

    def _after_read(self) -> Step:
        if isinstance(self._claim, RequestError):
            return self._end(Outcome(Exit.CLAIM_REFUSED, error=self._claim, read=self._read, notice=False,
                                     peer_failed=True))
        if self._proof is True:
            return Step.CHECK  # (its lease word showed the lease after the landing)
        self.phase = Phase.VERIFYING  # (drain waits, a cancel fails it)
        if self._claim is _PENDING:
            return Step.WAIT  # (the claim's answer is awaited)
        if self._published and self._proof is not True:
            # (published, and the word read after the landing did not show it, or was not made:
            # slow, no scratch slot; the claim's "held" may predate the landing: found by a review)
            return Step.REPROVE
        return Step.CHECK if self._after else Step.RECLAIM

    def _end(self, outcome: Outcome) -> Step:
        self.phase = Phase.ENDED
        self.outcome = outcome
        return Step.END


# ---------------------------------------------------------------------- planning


def plan_read(msg: Recv, local: KVLayout, ranks: dict[tuple[int, int], RankInfo],
              engine: str) -> tuple[list[RankPlan], BlockPairing]:
    """Which remote ranks of ``engine`` (its registered ``ranks`` by (pp, tp)) a receive
    reads, with which plans, and how its blocks pair up (``kvxfer.topology``); RequestError
    when they do not fit (NOT_REGISTERED: ranks are missing, a fresh handshake may cure it)."""
    remote = next(iter(ranks.values())).layout
    if msg.remote_tp_size != remote.tp_size:
        raise RequestError(ErrorCode.INCOMPATIBLE,
                           f"request says remote tp_size {msg.remote_tp_size}, peer has {remote.tp_size}")
    stages: dict[int, KVLayout] = {}
    for (pp, _tp), info in sorted(ranks.items()):
        stages.setdefault(pp, info.layout)
    try:
        shared, pairing = layout_plans(local, tuple(stages.items()), remote)
        plans = list(shared)
        if msg.block_ids:
            if not msg.streamed:  # (push: this sidecar paired them, kvxfer.sidecar.stream_feed)
                check_paired_for(msg.remote_block_size, remote.block_size, local.block_size)
            pairing.pairs(len(msg.block_ids), len(msg.remote_block_ids))
    except Incompatible as e:
        if len(stages) < remote.pp_size:
            raise RequestError(ErrorCode.NOT_REGISTERED, f"peer has {len(stages)} of {remote.pp_size} "
                               f"pipeline stages of engine {engine!r} registered: {e}") from None
        raise RequestError(ErrorCode.INCOMPATIBLE, str(e)) from None
    for plan in plans:
        info = ranks.get((plan.remote_pp, plan.remote_rank))
        if info is None:
            raise RequestError(ErrorCode.NOT_REGISTERED,
                               f"peer has {len(ranks)} of {remote.tp_size * remote.pp_size} ranks of engine "
                               f"{engine!r} registered; pp{plan.remote_pp}/tp{plan.remote_rank} is missing")
        check_blocks(msg.req_id, msg.state_pairs[1] if plan.state else msg.remote_block_ids,
                     info.layout.num_blocks, "remote")
    return plans, pairing


def check_paired_for(told: int, remote: int, local: int) -> None:
    """Incompatible unless a receive's lists were paired for the prefill's block size
    (``Recv.remote_block_size``; 0, not said, fits equal sizes only): lists paired one to one
    while a decode block holds two prefill blocks pair the wrong tokens, and a list whose
    length happens to fit the ratio (one block each) would be read, wrong, without this."""
    if told != remote and (told or remote != local):
        raise Incompatible(f"the block lists were paired for prefill blocks of {told or local} tokens; "
                           f"the prefill's blocks hold {remote} (kv_transfer_params remote_block_size)")


@functools.lru_cache(maxsize=1024)
def layout_plans(local: KVLayout, stages: tuple[tuple[int, KVLayout], ...],
                 remote: KVLayout) -> tuple[tuple[RankPlan, ...], BlockPairing]:
    """The plans and the block pairing of a local rank against a remote engine's stages:
    pure in the layouts (frozen, hashable), so computed once per pair of layouts, not once
    per receive (~30 us each, D times per request at decode TP D; a refusal is not cached)."""
    return tuple(plan_stages(local, dict(stages)) + plan_state(local, remote)), block_pairing(local, remote)


# ---------------------------------------------------------------------- the claim


@dataclass(frozen=True)
class ClaimVerdict:
    refusal: RequestError | None = None  # final: None held, else why not
    retry_in_s: float = 0.0  # > 0: not final, ask again after this long
    expired: bool = False  # the lease was over before the read (counted as an event)
    stale_peer: bool = False  # the prefill re-registered since it was handshaked


def claim_verdict(answer: str, *, moved: tuple[str, str] | None, remaining_s: float,
                  pause_s: float) -> ClaimVerdict:
    """Judge one answer to a claim: ``held``, ``gone`` or ``unknown`` (the prefill sidecar
    has no lease for it: its Hold may still be on the way, so ask again after ``pause_s``
    while ``remaining_s`` allows). ``moved``: (the generation the read was planned from, the
    prefill sidecar's now) when the request named none and they differ."""
    if answer == "held":
        if moved is not None:
            # A request that names no generation was planned from a cached handshake older
            # than the prefill's registrations (one that names it was checked against the
            # handshake it was planned from). The generation is the whole sidecar's: another
            # engine's re-registration fails this read too.
            return ClaimVerdict(RequestError(
                ErrorCode.INCOMPATIBLE, "the prefill sidecar re-registered since it was handshaked "
                f"(generation {moved[0]}, now {moved[1]}): this read followed its old memory description; "
                "not used"),
                stale_peer=True)
        return ClaimVerdict()
    if answer == "gone":
        return ClaimVerdict(RequestError(
            ErrorCode.EXPIRED, "the prefill's lease on these blocks was over before the read: they may "
            "already hold another request's KV; not used"), expired=True)
    if pause_s > remaining_s:
        return ClaimVerdict(RequestError(ErrorCode.EXPIRED, "the prefill sidecar does not hold this request "
                                         "(its Hold never arrived)"))
    return ClaimVerdict(retry_in_s=pause_s)
