"""The decode sidecar's half of staged reads (#35; the plan: ``kvxfer.sidecar.staging``, the
prefill's half: ``kvxfer.sidecar.stage_server``).

``prepare`` decides, for a planned receive, whether it is staged: both sidecars have an
arena for its memory (host, or its CUDA device's), no state blocks, its direct descriptors
many and small (``worth_staging``; VRAM: always), and a free slot here; the slot is then
this receive's until ``release``. One too large for its share of a slot is read in windows
through that slot (``Windows``). ``ask`` sends the ``StageRequest`` (the read's claim) and
waits for its ``Staged`` answer, asking again while the prefill does not know the request
yet, as a claim does (``receive.claim_verdict``). The receiver then posts the slot-to-slot
read (``ReadSpec.staged``); the NIXL port scatters the slot into the blocks before it
reports the read landed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import msgspec

from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import RankInfo, Recv, Staged, StageRank, StageRequest
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.nixl_types import ReadFinished, ReadRefused
from kvxfer.sidecar.peer_book import Peer, PeerBook
from kvxfer.sidecar.peer_client import PeerClient
from kvxfer.sidecar.plan import PairRows, StagedRead
from kvxfer.sidecar.receive import claim_verdict
from kvxfer.sidecar.staged_windows import NoArena, Windows
from kvxfer.sidecar.staging import (
    Books,
    StagedPlan,
    arena_device,
    read_pieces,
    reader_name,
    staged_plan,
    windows_of,
    worth_staging,
)
from kvxfer.topology import BlockPairing, RankPlan

log = logging.getLogger("kvxfer.staging")

# The first receive of a request waits this long at most for its other ranks (each sends its
# own Recv in the same engine step; one that never comes costs the others this much). 2 ms
# split requests in two when the loop took longer than that over the ranks' rings (a 1 -> 8
# round: the first rank's StageRequest went alone, and the prefill gathered twice).
BATCH_WINDOW_S = 0.02
MAX_RUNS_BYTES = 512 << 10  # a StageRequest stays well under the listener's 1 MiB messages
ROWS_CACHE = 512  # pair_rows kept per (peer registration, local registration, plan)
MIN_WINDOW = 1 << 20  # a read in windows smaller than this would be mostly round trips: direct
VRAM_WAIT_S = 1.0  # a VRAM read the prefill has no room for asks again this long, then reads directly


@dataclass(frozen=True)
class Prepared:
    """A receive that will be staged: its plan, its slot here, what the prefill is asked."""

    plan: StagedPlan
    offset: int  # of its slot in this sidecar's arena
    ranks: list[StageRank]
    expected: int  # receives of this request on this engine's ranks (one StageRequest for all)
    device: int = -1  # the arenas: this sidecar's (-1: host) ...
    remote_device: int = -1  # ... and the prefill's
    # a read too large for one slot: the windows read before ``plan`` (the last), each with
    # what its StageRequest asks (``staging.windows_of``)
    windows: tuple[tuple[StagedPlan, list[StageRank]], ...] = ()
    window_devices: tuple[int, ...] = ()  # each window's prefill arena (TP across GPUs: several)
    alone: bool = False  # asks alone, never in another receive's batch (a push pre-read)
    reader_engine: str = ""  # the local engine whose rank reads (ReadNotice.reader_engine)


@dataclass
class _Member:
    """One receive of a batch: what it asks, and its part of the answer."""

    msg: Recv
    prepared: Prepared
    mark: Callable[[str], None]
    reading_s: float
    answer: asyncio.Future[tuple[Staged | None, float]]

    @property
    def runs_bytes(self) -> int:
        return sum(len(r.runs) for r in self.prepared.ranks)


@dataclass
class _Batch:
    """Receives of one request asking together."""

    members: list[_Member] = field(default_factory=list)


def parts(members: list[_Member], limit: int = MAX_RUNS_BYTES) -> list[list[_Member]]:
    """A batch cut into StageRequests whose runs fit ``limit`` bytes, members in order (one
    member alone may fill one: ``prepare`` never stages a receive whose runs exceed it)."""
    out: list[list[_Member]] = []
    size = 0
    for m in members:
        if not out or size + m.runs_bytes > limit:
            out.append([])
            size = 0
        out[-1].append(m)
        size += m.runs_bytes
    return out


_RowsCache = dict[tuple[object, ...], tuple[RankInfo, RankInfo, dict[tuple[int, ...], PairRows]]]


def _rows_for(cache: _RowsCache, peer: Peer, local: RankInfo,
              infos: list[RankInfo]) -> dict[tuple[int, ...], PairRows] | None:
    """The pair_rows cache of this pair of registrations (None: more than one remote rank's
    registration is involved, so nothing is cached)."""
    if len({id(i) for i in infos}) != 1:
        return None
    ck = (peer.agent_name, id(local), id(infos[0]))
    got = cache.get(ck)
    if got is None or got[0] is not local or got[1] is not infos[0]:
        if len(cache) >= ROWS_CACHE:
            cache.clear()
        got = cache[ck] = (local, infos[0], {})
    return got[2]


def _split(plan: StagedPlan, groups: list[int], arena: int, sharing: int) -> list[StagedPlan] | None:
    """A staged plan as the windows it is read in (the last: the receive's own read); None: not
    staged. Too large for its share of a slot (or one request's runs): windows of half that
    share; gathered on several GPUs of the prefill (TP that differs across GPUs: a slot there
    is on one GPU): windows of one GPU each."""
    big = plan.nbytes * sharing > arena or plan.gather_runs * 16 > MAX_RUNS_BYTES
    several = len({g for g, runs in zip(groups, plan.remote_runs, strict=True) if len(runs)}) > 1
    if not (big or several):
        return [plan]
    room = arena // (2 * sharing) if big else plan.nbytes
    if room < MIN_WINDOW and big:
        return None
    return windows_of(plan, room, MAX_RUNS_BYTES // 16, groups)


class Staging:
    def __init__(self, config: Config, peers: PeerClient, book: PeerBook, nixl: NixlPort,
                 agent_name: str, books: Books | None = None) -> None:
        self.config = config
        self.peer_book = book
        self.below = config.stage_below_kib << 10
        self.peers = peers
        self.nixl = nixl
        self.agent_name = agent_name
        self.books = books if books is not None else Books(nixl.spans)  # (shared: StageServer)
        self._rows: _RowsCache = {}
        self.staged = 0  # receives staged, ever
        self._batches: dict[tuple[object, ...], _Batch] = {}
        self._tasks: set[asyncio.Task[tuple[Staged | None, float]]] = set()
        self.fell_back = 0  # prepared, but the prefill had no room: read directly
        self.windowed = 0  # of the staged: read in windows
        self._windows: dict[str, Windows] = {}  # receive key -> its windows' reads (a read in windows)

    # ------------------------------------------------------------------ decide

    def prepare(self, key: Hashable, msg: Recv, local: RankInfo, peer: Peer, engine: str,
                plans: list[RankPlan], pairing: BlockPairing, remaining_s: float,
                alone: bool = False) -> Prepared | None:
        """The receive's staged plan and slot, or None: read it directly. Host memory is staged
        when its direct descriptors are many and small (``worth_staging``); VRAM always (the
        arenas are the only memory UCX moves over cuda_ipc: ``staging``). One too large for
        its share of a slot goes in windows (``staging.windows_of``). ``alone``: it will ask
        alone (a push pre-read), so no other rank's read shares its request."""
        device = arena_device(local)
        book = self.books.get(device) if device is not None and (device >= 0 or self.below > 0) else None
        if (book is None or not peer.staging_bytes or not msg.block_ids or msg.state_block_ids
                or any(p.state for p in plans)):
            return None
        ranks = peer.engine_ranks(engine)
        infos = [ranks[(p.remote_pp, p.remote_rank)] for p in plans]
        gpus = [arena_device(i) for i in infos]
        if None in gpus or any(i.mem_type != local.mem_type for i in infos):
            return None  # (a remote rank on several devices: no one slot there gathers it)
        groups = [int(g) for g in gpus if g is not None]
        remote = {(p.remote_pp, p.remote_rank): (i.regions, i.layout.num_blocks) for p, i in zip(plans, infos,
                                                                                               strict=True)}
        legs = read_pieces(plans, pairing, local.regions, local.layout.num_blocks, remote,
                           list(msg.block_ids),
                           list(msg.remote_block_ids), _rows_for(self._rows, peer, local, infos))
        plan = staged_plan(legs)
        vram = device is not None and device >= 0
        # (a host arena serves all of a request's ranks at once; a VRAM one, the ranks of its device)
        sharing = 1 if vram else max(1, local.layout.tp_size)
        if plan.nbytes == 0 or not (vram or worth_staging(plan, self.below, self.config.stage_min_descs,
                                                          ranks=1 if alone else local.layout.tp_size)):
            return None
        cut = _split(plan, groups, min(peer.staging_bytes, book.size), sharing)  # (the smaller arena)
        if cut is None:
            return None
        *windows, plan = cut
        until = time.monotonic() + remaining_s + self.config.settle_timeout_s
        offset = book.alloc(max(w.nbytes for w in (*windows, plan)), key, until)
        if offset is None:
            return None

        def asks(p: StagedPlan) -> list[StageRank]:
            return [StageRank(rank=q.remote_rank, pp_rank=q.remote_pp, runs=runs.astype("<i8").tobytes())
                    for q, runs in zip(plans, p.remote_runs, strict=True) if len(runs)]

        def gpu(p: StagedPlan) -> int:  # (the prefill GPU whose arena gathers the window)
            return next(g for g, runs in zip(groups, p.remote_runs, strict=True) if len(runs))

        # (VRAM: each rank asks alone; its ranks' prefill ranks may sit on other GPUs, whose
        # arenas no one StageRequest reaches; a read in windows asks alone too)
        alone = vram or bool(windows)
        return Prepared(plan, offset, asks(plan), expected=1 if alone else max(1, local.layout.tp_size),
                        device=device, remote_device=gpu(plan),
                        windows=tuple((w, asks(w)) for w in windows),
                        window_devices=tuple(gpu(w) for w in windows), reader_engine=local.engine_id)

    def counts(self) -> dict[str, int]:
        """Receives staged, by how (``transfer_gauges.staging_gauges``)."""
        return {"slot": self.staged - self.windowed, "windows": self.windowed, "direct": self.fell_back}

    def release(self, key: Hashable) -> None:
        """The receive ended: its slot here is free (its read settled, or never started)."""
        self.books.free(key)
        self._windows.pop(key, None)

    # ------------------------------------------------------------------ windows

    def windows_for(self, key: str, prepared: Prepared,
                    spec: Callable[[StagedRead, str], object]) -> Windows | None:
        """The reads of a receive's earlier windows (None: it has none), followed here."""
        if not prepared.windows:
            return None
        w = self._windows[key] = Windows(key, spec, self.nixl)
        return w

    def _windows_of(self, req_id: str) -> Windows | None:
        w = self._windows.get(req_id.rsplit("#", 2)[0]) if "#w" in req_id else None  # (key#w<i>#<n>)
        return w if w is not None and w.reading(req_id) else None

    def landed(self, event: ReadFinished) -> bool:
        """A window's read (then handled here, not by the receiver)."""
        w = self._windows_of(event.req_id)
        return w is not None and w.landed(event)

    def refused(self, event: ReadRefused) -> bool:
        w = self._windows_of(event.req_id)
        return w is not None and w.refused(event)

    async def settle(self, key: str, err: RequestError) -> None:
        """A cancel: the receive's window read in flight, if any, settled first (``Windows``)."""
        w = self._windows.get(key)
        if w is not None:
            await w.settle(err)

    def read_after(self, key: Hashable, prepared: Prepared,
                   task: asyncio.Future[tuple[Staged | None, float]]) -> StagedRead | None:
        """What ``ask`` ended with: the read of the prefill's slot into this receive's, or
        None (the prefill had no room: the slot here is freed, read directly). Raises the
        RequestError that fails the receive (nothing was posted)."""
        if task.cancelled():
            raise RequestError(ErrorCode.EXPIRED, "stage request cancelled")
        err = task.exception()
        if err is not None:
            raise err if isinstance(err, RequestError) else RequestError(ErrorCode.TRANSFER_ERROR, repr(err))
        answer, sent = task.result()
        if answer is None:
            self.release(key)
            return None
        return self._staged_read(key, prepared, answer, sent)

    def _staged_read(self, key: str, prepared: Prepared, answer: Staged, sent: float) -> StagedRead:
        """The read of the prefill's slot (``answer``) into this receive's, then its scatter."""
        book = self.books.get(prepared.device)
        offset = book.offset(key) if book is not None else None
        if offset is None or answer.nbytes != prepared.plan.nbytes:
            raise RequestError(ErrorCode.TRANSFER_ERROR, "staged answer does not match the request")
        vram = prepared.device >= 0
        w = self._windows.get(key)
        return StagedRead(local_addr=self.books.base(prepared.device) + offset, remote_addr=answer.addr,
                          nbytes=answer.nbytes,
                          scatter=prepared.plan.scatter, trust_until=sent + answer.ttl_s,
                          mem_type="VRAM" if vram else "DRAM", local_device=max(prepared.device, 0),
                          remote_device=max(prepared.remote_device, 0),
                          before=w.before() if w is not None and prepared.windows else (0, 0, 0.0))

    # ------------------------------------------------------------------ ask

    async def ask(self, msg: Recv, engine: str, prepared: Prepared, reading_s: float, peer: Peer,
                  mark: Callable[[str], None], windows: Windows | None = None) -> tuple[Staged | None, float]:
        """The prefill's ``Staged`` answer for this receive (its part of the slot) and when
        the request that got it was sent (monotonic); (None, 0): it had no room, read
        directly. Raises RequestError when the read must not happen (lease over, runs
        refused, no answer).

        The receives of one request on this engine's ranks share one ``StageRequest`` (or a
        few, when their runs exceed MAX_RUNS_BYTES: ``parts``): the first waits up to
        ``BATCH_WINDOW_S`` for the others (each TP rank sends its own ``Recv``, in the same
        engine step), and the batch goes as soon as all are in. A read in windows asks alone,
        for each window in turn, and reads all but the last here (``windows``)."""
        if prepared.windows or prepared.device >= 0 or prepared.alone:  # (alone: see _in_windows)
            return await self._in_windows(msg, engine, prepared, reading_s, peer, mark, windows)
        loop = asyncio.get_running_loop()
        key = (msg.remote_host, msg.remote_port, engine, msg.remote_req_id or msg.req_id, msg.remote_token,
               msg.pp_rank, prepared.reader_engine if peer.reader_engines else "")
        # (two local engines' ranks ask apart where the prefill tells their readers apart; at an older
        # one together, refused: apart, each would free the other's slot there: a review)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch()
            loop.call_later(BATCH_WINDOW_S, self._flush, key, batch, engine, peer)
        member = _Member(msg, prepared, mark, reading_s, loop.create_future())
        batch.members.append(member)
        if len(batch.members) >= prepared.expected:
            self._flush(key, batch, engine, peer)
        answer, sent = await asyncio.shield(member.answer)
        if answer is None:
            self.fell_back += 1
            return None, 0.0
        self.staged += 1
        return answer, sent

    async def _in_windows(self, msg: Recv, engine: str, prepared: Prepared, reading_s: float, peer: Peer,
                          mark: Callable[[str], None],
                          windows: Windows | None) -> tuple[Staged | None, float]:
        """``ask`` for a receive that asks alone: a VRAM one, or one read in windows. Each
        window's StageRequest in turn, every window but the last read here; the last's answer
        is the receive's. A window the prefill has no room for is asked again: a later one
        until the deadline (it just gave this reader's slot up, another reader took it), a
        VRAM read's first for up to VRAM_WAIT_S (reading it directly instead costs ~100x).
        Raises CANCELLED once the receive is being cancelled."""
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        end = start + reading_s
        steps = (*prepared.windows, (prepared.plan, prepared.ranks))
        devices = (*prepared.window_devices, prepared.remote_device)
        for i, (plan, ranks) in enumerate(steps):
            part = dataclasses.replace(prepared, plan=plan, ranks=ranks, windows=(), window_devices=(),
                                       remote_device=devices[i])
            pause = 0.002
            until = end if i else (min(end, start + VRAM_WAIT_S) if prepared.device >= 0 else 0.0)
            while True:
                if windows is not None:
                    windows.check()
                try:
                    got, sent = await self._ask([_Member(msg, part, mark, reading_s, loop.create_future())],
                                                engine, peer)
                except NoArena:  # (a GPU of the prefill's without one: the whole read goes directly,
                    self.fell_back += 1  # rewriting what earlier windows scattered)
                    return None, 0.0
                if got is not None or time.monotonic() + pause > until:
                    break
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.05)
            if windows is not None:
                windows.check()  # (a slot it holds at the prefill goes with the cancel's notice)
            if got is None:
                if i == 0:
                    self.fell_back += 1
                    return None, 0.0  # (nothing read yet: the whole read goes directly)
                raise RequestError(ErrorCode.TRANSFER_ERROR, f"the prefill had no room for window {i + 1} "
                                   f"of {len(steps)} in {reading_s:.1f}s")
            if i == len(steps) - 1:
                self.staged += 1
                self.windowed += bool(prepared.windows)
                return got, sent
            assert windows is not None, "a read in windows needs its reads posted"
            await windows.read(i, self._staged_read(windows.key, part, got, sent))
        raise AssertionError("unreachable")

    def _flush(self, key: tuple[object, ...], batch: _Batch, engine: str, peer: Peer) -> None:
        if self._batches.get(key) is not batch:
            return  # (sent already)
        del self._batches[key]
        for part in parts(batch.members):
            task = asyncio.ensure_future(self._ask(part, engine, peer))
            self._tasks.add(task)
            task.add_done_callback(lambda t, part=part: self._settle(part, t))

    def _settle(self, part: list[_Member], task: asyncio.Task[tuple[Staged | None, float]]) -> None:
        """Each member's part of its StageRequest's answer: its slice of the prefill's slot."""
        self._tasks.discard(task)
        offset = 0
        for m in part:
            if m.answer.done():
                pass
            elif task.cancelled():
                m.answer.set_exception(RequestError(ErrorCode.EXPIRED, "stage request cancelled"))
            elif isinstance(task.exception(), NoArena):
                m.answer.set_result((None, 0.0))  # (read directly, as for "busy")
            elif task.exception() is not None:
                m.answer.set_exception(task.exception())  # type: ignore[arg-type]
            else:
                got, sent = task.result()
                m.answer.set_result((None, 0.0) if got is None else (msgspec.structs.replace(
                    got, addr=got.addr + offset, nbytes=m.prepared.plan.nbytes), sent))
            offset += m.prepared.plan.nbytes

    async def _ask(self, part: list[_Member], engine: str, peer: Peer) -> tuple[Staged | None, float]:
        msg = part[0].msg
        reading_s = max(m.reading_s for m in part)
        marks = [m.mark for m in part]
        req = StageRequest(seq=0, engine_id=engine, req_id=msg.remote_req_id or msg.req_id,
                           ranks=[r for m in part for r in m.prepared.ranks],
                           nbytes=sum(m.prepared.plan.nbytes for m in part),
                           readers=[reader_name(m.msg.pp_rank, m.msg.tp_rank,
                                                m.prepared.reader_engine if peer.reader_engines else "")
                                    for m in part],
                           extend_s=reading_s + self.config.handshake_timeout_s + 1.0,
                           agent_name=self.agent_name, token=msg.remote_token)
        timeout = self.config.handshake_timeout_s
        start = time.monotonic()
        end, unknown_end = start + max(timeout, reading_s), start + timeout
        pause = 0.002
        while True:
            sent = time.monotonic()
            for mark in marks:
                mark("stage_sent")
            got: Staged = await self.peers.call_peer(msg.remote_host, msg.remote_port, req,
                                                     max(0.05, end - sent))
            if got.held == "busy":
                if got.code == ErrorCode.UNSUPPORTED:  # (no arena for those ranks: not later either)
                    raise NoArena(got.reason)
                return None, 0.0
            if got.held == "refused":
                raise RequestError(got.code or ErrorCode.TRANSFER_ERROR,
                                   f"the prefill refused to stage: {got.reason}")
            moved = (None if msg.remote_generation or not peer.outdated_by(got.generation)
                     else (peer.generation, got.generation))
            left = min(end, unknown_end) - time.monotonic()
            verdict = claim_verdict(got.held, moved=moved, remaining_s=left, pause_s=pause)
            if verdict.retry_in_s:
                await asyncio.sleep(verdict.retry_in_s)
                pause = min(pause * 2, 0.1)
                continue
            if verdict.stale_peer:
                self.peer_book.mark_stale(peer)  # the next receive handshakes again
            if verdict.refusal is not None:
                raise verdict.refusal
            for mark in marks:
                mark("staged")
            return got, sent

