"""The prefill sidecar's half of staged reads (#35; the plan: ``kvxfer.sidecar.staging``).

A ``StageRequest`` is a claim that asks for a copy: its lease is judged and extended exactly
as a ``LeaseRenew`` (``Holds.renew``), then the runs it names are checked against the blocks
that lease holds and copied, on the NIXL thread, into a slot of this sidecar's staging arena;
the lease must still be held once the copy is done, or the answer is "gone" (the engine may
have reused the blocks while they were copied). The slot is kept until the reader's final
``ReadNotice`` (it settled its read of the slot, landed or failed) or until its expiry,
whichever comes first; the reader never trusts a landing seen after that expiry. A reader
that asks again (a read in windows, once it read its last window) gives its slot up for the
new one: never two slots for one reader. A slot is in the arena of the ranks' device (host
memory: -1), so all ranks of one request must share a device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import DECODE_ERRORS, LeaseRenew, Staged, StageRequest, read_notice_decoder
from kvxfer.sidecar.holds import Holds
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.nixl_staging import Runs
from kvxfer.sidecar.registry import RankRegistry
from kvxfer.sidecar.staging import Books, arena_device, reader_name

log = logging.getLogger("kvxfer.staging")

MAX_SLOT_S = 600.0  # no reader keeps a slot longer, whatever it asks


@dataclass
class StageTimes:
    """What the slots this sidecar answered cost it (``kvxfer_staged_answer*``): from a
    request's arrival to its answer, and the gather's part of that (the NIXL thread's copy
    and the hand-offs to it and back). A GPU run read a staged answer at 2.8 ms where the
    gather alone costs 0.3-0.4: these say which part is the rest."""

    answers: int = 0
    answer_s: float = 0.0
    gather_s: float = 0.0

    def add(self, answer_s: float, gather_s: float) -> None:
        self.answers += 1
        self.answer_s += answer_s
        self.gather_s += gather_s

    def row(self) -> tuple[int, float, float]:
        return self.answers, self.answer_s, self.gather_s


class StageServer:
    def __init__(self, *, holds: Holds, registry: RankRegistry, nixl: NixlPort,
                 generation: Callable[[], str], books: Books | None = None) -> None:
        self.holds = holds
        self.registry = registry
        self.nixl = nixl
        self._generation = generation
        # (the arenas' one book, shared with this sidecar's decode half: two gave the same bytes
        # to a prefill's gather and a decode's read at once; found by a review)
        self.books = books if books is not None else Books(nixl.spans)
        self.times = StageTimes()  # (the slots answered, ever, and what they cost)
        self._waiting: dict[tuple[object, ...], set[str]] = {}  # slot -> readers whose final notice is due
        self._gathering: set[tuple[object, ...]] = set()  # slots being filled now

    async def answer(self, req: StageRequest) -> Staged:
        arrived = time.monotonic()
        if not self.nixl.spans:
            return Staged(seq=req.seq, held="busy", reason="no staging arena here")
        renew = LeaseRenew(seq=req.seq, engine_id=req.engine_id, req_ids=[req.req_id], extend_s=req.extend_s,
                           agent_name=req.agent_name, tokens=[req.token])
        held = self.holds.renew(renew).held[0]
        if held != "held":
            return Staged(seq=req.seq, held=held, generation=self._generation())
        lease = self.holds.lease_for(req.agent_name, req.engine_id, req.req_id, req.token, "stage")
        assert lease is not None  # (renew just found it held, on this loop, with no await between)
        try:
            ranks, device = self._ranks(req, lease.engine)
        except RequestError as e:
            return Staged(seq=req.seq, held="refused", code=e.code, reason=e.reason)
        ttl = min(max(req.extend_s, 1.0), MAX_SLOT_S)
        # (the readers as their notices name them; the device: which arena)
        key = (req.agent_name, req.engine_id, req.req_id, tuple(req.readers), device)
        for gone in self.books.expire(arrived):
            self._waiting.pop(gone, None)
        if not req.readers or len(set(req.readers)) != len(req.readers):
            return Staged(seq=req.seq, held="refused", code=ErrorCode.MALFORMED,
                          reason="readers must be distinct")
        book = self.books.get(device) if device is not None else None
        if book is None or device is None:  # (UNSUPPORTED: not later either; read it all directly)
            return Staged(seq=req.seq, held="busy", code=ErrorCode.UNSUPPORTED,
                          reason="no staging arena for these ranks' memory")
        if key in self._gathering:  # (its slot is being filled: never freed or replaced under the copy)
            return Staged(seq=req.seq, held="busy", reason="this reader's last request is still being copied")
        for last in [k for k in self._waiting  # (readers ask again only once their last read landed)
                     if k[:3] == key[:3] and set(k[3]) <= set(key[3]) and k not in self._gathering]:
            self._free(last)  # the same readers ask again: their last window or pre-read (on any GPU)
        offset = book.alloc(req.nbytes, key, arrived + ttl)
        if offset is None:
            return Staged(seq=req.seq, held="busy", reason="staging arena full")
        self._waiting[key] = set(req.readers)
        failed, gather_s = await self._gather(key, req, ranks, list(lease.block_ids), offset, device)
        if failed is not None:
            return failed
        if self.holds.lease_for(req.agent_name, req.engine_id, req.req_id, req.token, "stage") is not lease:
            self._free(key)  # released or expired during the copy: the copy proves nothing
            return Staged(seq=req.seq, held="gone", generation=self._generation())
        if not self._waiting.get(key, True):  # its readers' final notices came during the copy
            self._free(key)
            return Staged(seq=req.seq, held="busy", reason="its readers gave it up while it was copied")
        self.nixl.expect_reads()  # (its read follows: see NixlPort.expect_reads)
        self.times.add(time.monotonic() - arrived, gather_s)
        return Staged(seq=req.seq, held="held", addr=self.books.base(device) + offset, nbytes=req.nbytes,
                      ttl_s=ttl, generation=self._generation())

    async def _gather(self, key: tuple[object, ...], req: StageRequest, ranks: Runs, blocks: list[int],
                      offset: int, device: int) -> tuple[Staged | None, float]:
        """Fill the slot (None) or the refusal to answer, and the seconds it took."""
        self._gathering.add(key)
        t0 = time.monotonic()
        try:
            await self.nixl.gather(ranks, blocks, offset, req.nbytes, device)
        except RequestError as e:
            self._free(key)
            return Staged(seq=req.seq, held="refused", code=e.code, reason=e.reason), 0.0
        except Exception as e:
            self._free(key)
            log.exception("staging %s for %s failed", req.req_id, req.agent_name)
            return Staged(seq=req.seq, held="refused", code=ErrorCode.INTERNAL, reason=repr(e)), 0.0
        finally:
            self._gathering.discard(key)
        return None, time.monotonic() - t0

    def _ranks(self, req: StageRequest, engine: str) -> tuple[Runs, int | None]:
        """The ranks' keys and runs, and the arena they share (None: their memory is on
        several devices, which no one slot can gather)."""
        out, devices = [], set()
        for r in req.ranks:
            entry = self.registry.find(engine, r.pp_rank, r.rank)
            if entry is None:
                raise RequestError(ErrorCode.NOT_REGISTERED,
                                   f"rank pp{r.pp_rank}/tp{r.rank} is not registered")
            if len(r.runs) % 16:
                raise RequestError(ErrorCode.MALFORMED, "runs are not [address, length] int64 pairs")
            out.append((entry.key, np.frombuffer(r.runs, dtype="<i8").reshape(-1, 2).astype(np.int64)))
            devices.add(arena_device(entry.info))
        return out, devices.pop() if len(devices) == 1 else None

    def on_notice(self, agent: str, payload: bytes) -> None:
        """A reader's final ``ReadNotice``: once every reader of a slot sent one (their reads
        of it settled), the slot is free."""
        if not self._waiting:
            return
        try:
            notice = read_notice_decoder.decode(payload)
        except DECODE_ERRORS:
            return  # (counted by the holds)
        if notice.reading_s > 0:
            return  # "started": the slot is being read
        reader = reader_name(notice.pp_rank, notice.tp_rank, notice.reader_engine)
        for key, readers in list(self._waiting.items()):
            if key[:3] == (agent, notice.engine_id, notice.req_id) and reader in readers:
                readers.discard(reader)  # (every slot of the reader's: windows on several GPUs)
                if not readers and key not in self._gathering:  # (being filled: answer() frees it)
                    self._free(key)

    def _free(self, key: tuple[object, ...]) -> None:
        self._waiting.pop(key, None)
        self.books.free(key)

    @property
    def slots(self) -> int:
        return len(self.books)
