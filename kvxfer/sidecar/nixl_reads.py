"""Reads in flight on the NIXL agent: the chunk scheduler and the settle state machine.
Used on the NIXL port's thread only (or by the loop under the port's lock).

Reads are split into chunks of at most ``chunk_bytes`` and posted round-robin across
requests with a cap on chunks in flight, so a 2 GiB request cannot delay a 2 MiB one by
seconds.

A failed read is reported only once nothing can still write into its blocks. Releasing a
handle whose GETs are in flight does not stop the data: UCX cancels the requests, but
responses the peer already queued still land (measured over TCP: after a 2 s link cut, the
rest of a 120 MiB read arrived in blocks the engine had already reused). So at a deadline,
a cancel or a chunk's error the read stops posting and *settles*: its in-flight chunks are
polled until each is DONE or ERR, then released, then the failure goes out. A read that
does not settle within ``settle_timeout_s`` is reported as ``ReadStuck``: the sidecar then
exits, because only the death of the process that owns the endpoints guarantees that no
late write lands (the connector sees the restart and fails the loads).

Handle lifetimes are guarded: a handle is forgotten the moment it is released
(``transfer()`` on a released handle segfaults), and a handle that refuses release is
parked and retried, never reused.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.errors import ErrorCode
from kvxfer.sidecar.nixl_agent import error_code, release_or_park, release_parked, xfer_state
from kvxfer.sidecar.nixl_fences import Fences
from kvxfer.sidecar.nixl_memory import Cleanup, Leg
from kvxfer.sidecar.nixl_types import Event, ReadFinished, ReadStuck, TransferOptions

log = logging.getLogger("kvxfer.transfer")
PROOF_WAIT_S = 0.05  # a lease word read still running after this proves nothing (the claim decides)
PROOF_SPIN_S = 30e-6  # how long a word read is polled for at once before the next poll period


class ProofScratch:
    """Where lease words land: 16-byte slots of host memory registered with the agent that
    reads them (the NIXL thread's only; a slot whose read was given up is used again only
    once that read settled and its handle was let go: ``settle``).

    That agent is one of its own, without UCX worker threads (``inline``): a word read then
    copies inside ``transfer()`` (~20 µs here) where the main agent, whose worker threads
    copy the large reads in parallel, handed it to a worker and learnt of its end only at
    its next poll (~0.9 ms after the data landed, measured in push mode's tail). It loads
    every peer the main agent loads (``add_peer``/``remove_peer``); without it (no second
    agent could be made) the main agent reads the words."""

    def __init__(self, agent: Any, slots: int, inline: Any = None) -> None:
        self.agent = inline if inline is not None else agent
        self.inline = inline is not None
        self.mem = np.zeros(2 * slots, dtype=np.uint64)
        self.addr = int(self.mem.ctypes.data)
        self._reg = self.agent.register_memory([(self.addr, int(self.mem.nbytes), 0, "")], "DRAM")
        self._free = list(range(slots - 1, -1, -1))
        self._peers: set[str] = set()  # loaded into the inline agent
        self._unloading: set[str] = set()  # removed by the main agent, not yet by the inline one
        self._settling: list[tuple[Any, int]] = []  # (handle, slot) given up on: polled (``retry``)
        self.lost = 0  # word reads given up on (slow, or their handle not let go), ever

    def take(self) -> int:
        return self._free.pop() if self._free else -1

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def settle(self, handle: Any, slot: int) -> None:
        """A word read given up on (it lags) or whose handle was not let go: polled by ``retry``
        until it settled and is released, then its slot is free again (slots lost for good
        left, once all were, every read waiting for its claim: found by a review)."""
        self.lost += 1
        self._settling.append((handle, slot))

    def let_go(self, handle: Any, slot: int) -> None:
        """A settled word read: its handle released and its slot free (or kept until it is)."""
        if release_or_park(self.agent, handle, []):
            self.give(slot)
        else:
            self.settle(handle, slot)

    def add_peer(self, name: str, metadata: bytes) -> None:
        """The main agent loaded ``name``: the inline agent loads it too (a failure only
        leaves its words unread: the claim decides)."""
        if not self.inline:
            return
        self.remove_peer(name)  # (its metadata replaced)
        if name in self._peers:  # (still loaded: the same process, agent names are per process: its
            self._unloading.discard(name)  # words did not move; wanted again)
            return
        try:
            self.agent.add_remote_agent(metadata)
            self._peers.add(name)
        except Exception as e:
            log.info("lease words of %s will not be read inline: %s", name, e)

    def remove_peer(self, name: str) -> None:
        """Unload ``name`` from the inline agent; refused (a word read still in flight), it
        is read no more and unloaded by ``retry`` once it can be (it stayed loaded until the
        peer came back, if ever: found by a review)."""
        if name in self._peers:
            try:
                self.agent.remove_remote_agent(name)
                self._peers.discard(name)
                self._unloading.discard(name)
            except Exception as e:
                self._unloading.add(name)
                log.debug("lease word agent kept %s loaded: %s", name, e)

    def post(self, slot: int, remote_addr: int, peer: str) -> Any:
        if self.inline and (peer not in self._peers or peer in self._unloading):
            raise RuntimeError(f"{peer} is not loaded for lease word reads")
        self.mem[2 * slot] = 0
        self.mem[2 * slot + 1] = 0
        local = np.array([[self.addr + 16 * slot, 16, 0]], dtype=np.int64)
        remote = np.array([[remote_addr, 16, 0]], dtype=np.int64)
        agent = self.agent
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                       agent.get_xfer_descs(remote, "DRAM"), peer)
        if agent.transfer(handle) == "ERR":
            agent.release_xfer_handle(handle)
            raise RuntimeError("lease word read returned ERR")
        return handle

    def state(self, handle: Any) -> str:
        return xfer_state(self.agent, handle)

    def retry(self) -> None:
        """Let go of the word reads given up on that have settled since."""
        settling, self._settling = self._settling, []
        for handle, slot in settling:
            if self.state(handle) in ("DONE", "ERR") and release_or_park(self.agent, handle, []):
                self.give(slot)
            else:
                self._settling.append((handle, slot))
        for name in list(self._unloading):
            self.remove_peer(name)

    def word(self, slot: int) -> tuple[int, int]:
        return int(self.mem[2 * slot]), int(self.mem[2 * slot + 1])

    def close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._reg)


@dataclass
class Read:
    req_id: str
    peer: str
    local_rank: Hashable  # the registry's RankKey
    legs: list[Leg]
    nbytes: int
    deadline: float
    started: float = field(default_factory=time.monotonic)
    leg: int = 0  # the leg being posted
    handles: list[Any] = field(default_factory=list)
    failure: tuple[str, str] | None = None  # (code, reason) once failed; then it settles
    failed_at: float = 0.0
    stuck_reported: bool = False
    started_notice: bytes = b""  # sent to the peer once the chunks the cap allows are posted
    corrupt_at: int = 0  # test-only: a host address this read flips once it lands
    trace: list[tuple[str, int]] | None = None  # (hop, monotonic ns) when the receive is traced
    # a staged read: the scatter out of its slot, run once it landed (before it is reported),
    # and the moment after which a landing is not trusted (0: none)
    after_landing: Callable[[], None] | None = None
    trust_until: float = 0.0
    # its lease word (kvxfer.sidecar.lease_words): read once the data landed, into a slot of
    # the proof scratch; a word read that fails or lags proves nothing (the claim decides)
    proof_addr: int = 0
    proof_handle: Any = None
    proof_slot: int = -1
    proof_at: float = 0.0
    proof_word: tuple[int, int] | None = None
    descriptors_before: int = 0  # (the last window of a staged read in windows: the others')

    @property
    def all_posted(self) -> bool:
        return self.leg >= len(self.legs)

    @property
    def descriptors(self) -> int:
        return sum(leg.plan.count for leg in self.legs) + self.descriptors_before


class Reads:
    def __init__(self, agent: Any, options: TransferOptions, emit: Callable[[Event], None],
                 cleanup: Cleanup, scratch: ProofScratch | None, fences: Fences) -> None:
        self._agent = agent
        self._scratch = scratch
        self._options = options
        self._emit = emit
        self._cleanup = cleanup
        self._reads: dict[str, Read] = {}
        self._post_queue: collections.deque[str] = collections.deque()
        self.inflight_chunks = 0
        self._zombies: list[Any] = []
        self._fences = fences  # (a notification is sent through them: a fence follows it)
        self.landed_in_post = 0  # reads of one chunk DONE when transfer() returned, ever

    def __len__(self) -> int:
        return len(self._reads)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reads

    @property
    def full(self) -> bool:
        return self.inflight_chunks >= self._options.max_inflight_chunks

    def add(self, rd: Read) -> None:
        self._reads[rd.req_id] = rd
        self._post_queue.append(rd.req_id)

    def post_now(self, req_id: str) -> bool:
        """Post every chunk of this read the cap allows, then check it; whether it is still in
        flight (the poll loop then finishes it)."""
        rd = self._reads[req_id]
        while not rd.all_posted and not self.full:
            self._post_next(rd)
        if req_id in self._reads:
            self._check(rd, time.monotonic())
        return req_id in self._reads

    def pump(self) -> bool:
        """Post what the cap allows, check every read; whether anything moved."""
        progressed = self._post_chunks()
        now = time.monotonic()
        for rd in list(self._reads.values()):
            progressed |= self._check(rd, now)
        if self._zombies:
            self._zombies = release_parked(self._agent, self._zombies)
        if self._scratch is not None:
            self._scratch.retry()
        return progressed

    def cancel(self, req_id: str, code: str, reason: str) -> bool:
        rd = self._reads.get(req_id)
        if rd is None:
            return False
        self._fail(rd, code, reason)
        return True

    def fail_where(self, match: Callable[[Read], bool], code: str, reason: str) -> set[str]:
        """Fail every read ``match`` picks; the ids of those still settling."""
        for rd in [r for r in self._reads.values() if match(r)]:
            self._fail(rd, code, reason)
        return {r.req_id for r in self._reads.values() if match(r)}

    # ------------------------------------------------------------------ posting

    def _post_chunks(self) -> bool:
        posted = False
        while self._post_queue and not self.full:
            req_id = self._post_queue.popleft()
            rd = self._reads.get(req_id)
            if rd is None or rd.all_posted:
                continue
            posted = True
            self._post_next(rd)
            if not rd.all_posted:
                self._post_queue.append(req_id)
        return posted

    def _post_next(self, rd: Read) -> None:
        """Post the read's next chunk (a failure fails the read: nothing more is posted)."""
        if time.monotonic() > rd.deadline:
            # e.g. this process was stopped (SIGSTOP, a frozen cgroup) past the deadline: the
            # engine may have given up on these blocks already, so no chunk is posted late
            self._fail(rd, ErrorCode.DEADLINE, f"not posted by its deadline ({rd.leg} legs posted)")
            return
        agent = self._agent
        leg = rd.legs[rd.leg]
        plan = leg.plan
        lo = leg.next_desc
        hi = min(lo + plan.chunk, plan.count)
        only = lo == 0 and hi >= plan.count and len(rd.legs) == 1  # (the read's only chunk)
        try:
            if plan.runs is None:
                handle = agent.make_prepped_xfer("READ", leg.pair.local, plan.local_idx[lo:hi],
                                                 leg.pair.remote, plan.remote_idx[lo:hi])
            else:
                handle = agent.initialize_xfer(
                    "READ", agent.get_xfer_descs(plan.runs[0][lo:hi], leg.pair.local_mem),
                    agent.get_xfer_descs(plan.runs[1][lo:hi], leg.pair.remote_mem), rd.peer)
        except Exception as e:
            self._fail(rd, error_code(e), f"prepare: {e}")
            return
        leg.next_desc = hi
        if hi >= plan.count:
            rd.leg += 1
        rd.handles.append(handle)
        self.inflight_chunks += 1
        try:
            state = agent.transfer(handle)
        except Exception as e:
            self._fail(rd, error_code(e), f"post: {e}")
            return
        if state == "ERR":
            self._fail(rd, ErrorCode.TRANSFER_ERROR, "post returned ERR")
            return
        if rd.trace is not None and len(rd.trace) == 2:  # the first chunk
            rd.trace.append(("posted", time.monotonic_ns()))
        notice, rd.started_notice = rd.started_notice, b""
        if state == "DONE" and only:
            self.landed_in_post += 1
        elif notice and not rd.all_posted and not self.full:  # (a notification would hold up the
            rd.started_notice = notice  # next chunk's flush: sent after the last one posted now)
        elif notice:  # (one that landed needs no notice: its lease cannot run out under it)
            self._fences.notify(rd.peer, notice, f"read-started notice for {rd.req_id}")

    # ------------------------------------------------------------------ completion

    def _check(self, rd: Read, now: float) -> bool:
        if rd.failure is not None:
            return self._settle(rd, now)
        progressed = False
        for handle in list(rd.handles):
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as e:
                self._fail(rd, error_code(e), str(e))
                return True
            if state == "DONE":
                rd.handles.remove(handle)
                self.inflight_chunks -= 1
                self._release(handle)
                progressed = True
            elif state == "ERR":
                self._fail(rd, ErrorCode.TRANSFER_ERROR, "transfer state ERR")
                return True
        if rd.all_posted and not rd.handles:
            if rd.proof_addr and not self._prove(rd, now):
                return progressed  # (its lease word is being read)
            self._landed(rd, now)
            return True
        if now > rd.deadline:
            self._fail(rd, ErrorCode.DEADLINE, f"not finished after {now - rd.started:.3f}s")
            return True
        return progressed

    def _prove(self, rd: Read, now: float) -> bool:
        """Read the lease word of a read whose data landed; True once nothing more is to be
        waited for (``rd.proof_word`` set when it was read)."""
        scratch = self._scratch
        if scratch is None:
            rd.proof_addr = 0
            return True
        if rd.proof_handle is None:
            rd.proof_slot = scratch.take()
            if rd.proof_slot < 0:
                rd.proof_addr = 0
                return True
            try:
                rd.proof_handle = scratch.post(rd.proof_slot, rd.proof_addr, rd.peer)
            except Exception as e:
                log.debug("lease word of %s not read: %s", rd.req_id, e)
                scratch.give(rd.proof_slot)
                rd.proof_addr = 0
                return True
            rd.proof_at = now
            if rd.trace is not None:
                rd.trace.append(("data_done", time.monotonic_ns()))  # (the word read's post follows)
        state = scratch.state(rd.proof_handle)
        spin_until = time.monotonic() + PROOF_SPIN_S  # (16 bytes: waiting here beats a poll period)
        while state not in ("DONE", "ERR") and time.monotonic() < spin_until:
            state = scratch.state(rd.proof_handle)
        if state not in ("DONE", "ERR"):
            if now - rd.proof_at < PROOF_WAIT_S:
                return False
            self._drop_proof(rd)  # (it lags: the claim decides)
            return True
        if state == "DONE":
            rd.proof_word = scratch.word(rd.proof_slot)
        scratch.let_go(rd.proof_handle, rd.proof_slot)
        rd.proof_handle, rd.proof_addr = None, 0
        return True

    def read_word(self, peer: str, addr: int) -> tuple[int, int] | None:
        """Read one lease word now, waiting up to PROOF_WAIT_S (None: not read)."""
        scratch = self._scratch
        slot = scratch.take() if scratch is not None else -1
        if scratch is None or slot < 0:
            return None
        try:
            handle = scratch.post(slot, addr, peer)
        except Exception as e:
            log.debug("lease word at %x of %s not read: %s", addr, peer, e)
            scratch.give(slot)
            return None
        end = time.monotonic() + PROOF_WAIT_S
        while (state := scratch.state(handle)) not in ("DONE", "ERR") and time.monotonic() < end:
            time.sleep(20e-6)
        if state not in ("DONE", "ERR"):
            scratch.settle(handle, slot)
            return None
        word = scratch.word(slot) if state == "DONE" else None
        scratch.let_go(handle, slot)
        return word

    def _drop_proof(self, rd: Read) -> None:
        """Give up a word read in flight: its slot is free again only once it settled (a late
        landing could still write it)."""
        if rd.proof_handle is not None and self._scratch is not None:
            self._scratch.settle(rd.proof_handle, rd.proof_slot)
        rd.proof_handle, rd.proof_addr = None, 0

    def _landed(self, rd: Read, now: float) -> None:
        if rd.trust_until and (seen := time.monotonic()) > rd.trust_until:  # (now, not the pump's start:
            # other reads' scatters and word reads came between; found by a review)
            self._fail(rd, ErrorCode.EXPIRED, f"the staged copy landed {seen - rd.trust_until:.3f}s after "
                       "the peer could reuse its slot; not used")
            return
        if rd.after_landing is not None:
            try:
                rd.after_landing()
            except Exception as e:
                log.exception("scatter of %s failed", rd.req_id)
                self._fail(rd, ErrorCode.INTERNAL, f"scatter out of the staging slot: {e!r}")
                return
        if rd.corrupt_at:
            ctypes.c_uint8.from_address(rd.corrupt_at).value ^= 0xFF
            log.warning("test hook: flipped one byte of read %s after it landed", rd.req_id)
        del self._reads[rd.req_id]
        trace = () if rd.trace is None else (*rd.trace, ("landed", time.monotonic_ns()))
        self._emit(ReadFinished(rd.req_id, rd.peer, True, rd.nbytes, now - rd.started,
                                descriptors=rd.descriptors, trace=trace, proof=rd.proof_word))

    def _fail(self, rd: Read, code: str, reason: str) -> None:
        """Stop posting; report the failure once no chunk of the read can write any more."""
        if rd.req_id not in self._reads or rd.failure is not None:
            return
        rd.failure = (code, reason)
        rd.failed_at = time.monotonic()
        self._drop_proof(rd)
        rd.leg = len(rd.legs)  # nothing more is posted
        self._settle(rd, rd.failed_at)

    def _settle(self, rd: Read, now: float) -> bool:
        progressed = False
        for handle in list(rd.handles):
            if self._state(handle) in ("DONE", "ERR"):  # terminal: nothing more lands
                rd.handles.remove(handle)
                self.inflight_chunks -= 1
                self._release(handle)
                progressed = True
        if rd.handles:
            if now - rd.failed_at > self._options.settle_timeout_s and not rd.stuck_reported:
                rd.stuck_reported = True
                self._emit(ReadStuck(rd.req_id, rd.peer, now - rd.failed_at))
            return progressed
        del self._reads[rd.req_id]
        assert rd.failure is not None  # only failed reads settle
        code, reason = rd.failure
        waited = now - rd.failed_at
        if waited > 0.05:
            reason = f"{reason} (its in-flight chunks stopped {waited:.2f}s later)"
        self._emit(ReadFinished(rd.req_id, rd.peer, False, 0, now - rd.started, code, reason))
        self._cleanup.settled(rd.req_id)
        return True

    def _state(self, handle: Any) -> str:
        return xfer_state(self._agent, handle)

    def _release(self, handle: Any) -> None:
        release_or_park(self._agent, handle, self._zombies)  # (still active: parked, never touched again)
