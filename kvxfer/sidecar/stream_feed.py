"""The decode side of push mode: a streamed receive follows its prefill layer by layer
(``kvxfer.sidecar.layer_stream`` says how push works and has the pure half).

``follow`` watches the request at the prefill's sidecar (``LayerWatch``; the next watch is
sent before the layers it answered are read, so one always waits there) and reads the layers
computed so far (*pre-reads*: no claim, no read notice: each watch's answer renewed the
lease) until every layer is computed. It returns the receive's Recv completed with what the
prefill's sidecar said (its blocks, generation, TP size) and the plans of the layers still
unread, which the receiver reads as any pull read: claimed, proven by the lease word read
after it landed, reported once. A lease that ended at any moment of the stream fails that
final proof, so bytes of earlier layers are never trusted alone.

A pre-read is the NIXL port's like any read; its landing comes back here through the
receiver (``landed``), and a cancel of the receive settles it (``settle``) before the
engine hears ``Failed``: nothing lands in blocks the engine may reuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Observer
from kvxfer.pairing import pair_groups
from kvxfer.protocol import ChunkWatch, KVLayout, LayersAt, LayerWatch, Recv
from kvxfer.sidecar.admission import check_blocks
from kvxfer.sidecar.layer_stream import (
    after_chunks,
    after_group_chunks,
    chunk_pairs,
    cut_to_layers,
    group_chunk_pairs,
    remote_suffix,
    same_block_size,
)
from kvxfer.sidecar.nixl_port import NixlPort
from kvxfer.sidecar.nixl_types import ReadFinished, ReadRefused
from kvxfer.sidecar.peer_book import Peer
from kvxfer.sidecar.peer_client import PeerClient
from kvxfer.sidecar.plan import ReadSpec, StagedRead
from kvxfer.sidecar.receive import plan_read
from kvxfer.sidecar.recv_state import RecvState, notify_prefill, plan_for
from kvxfer.sidecar.registry import RankRegistry
from kvxfer.sidecar.staged_reads import Staging
from kvxfer.topology import BlockPairing, RankPlan

log = logging.getLogger("kvxfer.streams")

WATCH_WAIT_S = 5.0  # a watch waits this long at the prefill for more layers (then it is sent again)
# A reader's first ChunkWatch says it saw version -1: any prefill that knows ChunkWatch answers it
# at once with what it holds (versions start at 0), computed or not, so the decode pairs and plans
# the prefill's blocks while the first layer is computed, and a load that cannot be paired fails
# then, not after a watch's wait for the first layer (no new field: the bytes, and the MAC over
# them, are any protocol 6's)
FIRST_SEEN = -1
UNKNOWN_PAUSE_S = 0.002  # the prefill's Hold is not there yet: ask again after this, doubling
UNKNOWN_PAUSE_MAX_S = 0.1  # ... up to this
T = TypeVar("T")


@dataclass
class Following:
    """What a streamed receive has seen and read of its prefill so far."""

    host: str
    port: int
    req_id: str  # the transfer id
    token: str
    seen: int | None  # the prefill's progress version seen (None: it answers LayerWatch only)
    have: int = 0  # layers seen ready
    read: int = 0  # layers pre-read
    nbytes: int = 0
    read_blocks: int = 0  # the prefill's first blocks read whole (a prompt computed in chunks)
    # several KV cache groups computed in chunks: group -> the prefill's list as it was read
    read_groups: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # the hold's read token, as its first "held" answer gave it (``LayersAt.token``): every
    # later answer must give the same, or the id was held again (a router's retry) and what
    # was read of the first hold (chunks, layers: proved only by the final read's proof) is
    # not used (found by a review: a chunk of an aborted hold delivered, proven by the retry's)
    read_token: str | None = None


@dataclass(frozen=True)
class Followed:
    """A streamed receive once its prefill computed every layer: its Recv completed, and the
    plans of what is still to read (the last layers, and any state)."""

    msg: Recv
    plans: list[RankPlan]
    pairing: BlockPairing
    pre_read: int  # layers already read (pre-reads)
    pre_bytes: int


class StreamFeed:
    def __init__(self, *, config: Config, registry: RankRegistry, peers: PeerClient, nixl: NixlPort,
                 observer: Observer, staging: Staging | None = None) -> None:
        self.config = config
        self.staging = staging  # (pre-reads staged as pull reads are: on a GPU the only fast lane)
        self.observer = observer
        self.registry = registry
        self.peers = peers
        self.nixl = nixl
        # pre-read key -> (its receive's key, its landing)
        self._reads: dict[str, tuple[str, asyncio.Future[ReadFinished]]] = {}
        self._staged_pre: set[str] = set()  # receives with a staged pre-read (a slot at the prefill)

    def in_flight(self, key: str) -> str | None:
        """The pre-read of receive ``key`` that is in flight (None: none)."""
        return next((rk for rk, (k, _) in self._reads.items() if k == key), None)

    # ------------------------------------------------------------------ NIXL events (via the receiver)

    def landed(self, event: ReadFinished) -> bool:
        """A read's landing or failure: True if it was a pre-read (then it is handled here)."""
        entry = self._reads.pop(event.req_id, None)
        if entry is None:
            return False
        if not entry[1].done():
            entry[1].set_result(event)
        return True

    def refused(self, event: ReadRefused) -> bool:
        entry = self._reads.pop(event.req_id, None)
        if entry is None:
            return False
        if not entry[1].done():
            entry[1].set_exception(event.error)
        return True

    async def settle(self, key: str, err: RequestError) -> None:
        """Cancel the receive's pre-reads in flight, and wait until each settled (its landing
        or failure comes back through ``landed``/``refused`` whether the cancel found it or
        not). The receive is marked stopping first: none is posted after this."""
        while (rk := self.in_flight(key)) is not None:
            fut = self._reads[rk][1]
            await self.nixl.cancel(rk, err.code, err.reason)
            with contextlib.suppress(Exception):
                await asyncio.shield(fut)

    # ------------------------------------------------------------------ following

    async def follow(self, key: str, state: RecvState, peer: Peer, alive: Callable[[], bool]) -> Followed:
        """Watch and pre-read until every layer is computed (RequestError when the prefill's
        lease ends, refuses, or the deadline passes first: after a staged pre-read the prefill
        is told then, which frees the slot it kept for this reader)."""
        try:
            return await self._follow(key, state, peer, alive)
        except RequestError:
            if key in self._staged_pre:
                state.peer_agent = peer.agent_name
                notify_prefill(self.nixl, self.registry, state, False)
            raise
        finally:
            self._staged_pre.discard(key)

    async def _follow(self, key: str, state: RecvState, peer: Peer, alive: Callable[[], bool]) -> Followed:
        local = self.registry.get(state.local)
        if local is None:
            raise RequestError(ErrorCode.NOT_REGISTERED, f"local rank {state.local} was unregistered")
        engine = peer.resolve_engine(state.msg.remote_engine_id)
        msg = state.msg
        self._told_if(state, peer, engine, lambda: streamable(peer, msg))
        f = Following(msg.remote_host, msg.remote_port, msg.remote_req_id or msg.req_id, msg.remote_token,
                      FIRST_SEEN if peer.chunk_streams else None)
        pause = UNKNOWN_PAUSE_S / 2
        plans: list[RankPlan] = []
        pairing: BlockPairing | None = None
        remote_layouts: dict[int, Any] = {}
        blocks: list[int] = []
        ans = await self._answer(self._send_watch(f, engine), state.deadline)
        while True:
            if not alive():
                raise RequestError(ErrorCode.CANCELLED, "receive ended", msg.req_id)
            if ans.held == "unknown":  # (its Hold is not there yet: ask again, less and less often)
                pause = min(UNKNOWN_PAUSE_MAX_S, pause * 2)
                await asyncio.sleep(pause)
                ans = await self._answer(self._send_watch(f, engine), state.deadline)
                continue
            if ans.held != "held":
                raise _refusal(ans, msg.req_id)
            if f.read_token is None:
                f.read_token = ans.token
            elif ans.token != f.read_token:
                raise RequestError(ErrorCode.INCOMPATIBLE, "the prefill held this transfer id again while "
                                   "it was read (another read token): not used", msg.req_id)
            if ans.partial and pairing is None:  # (a prompt computed in chunks: read those done)
                ans = await self._chunk(key, state, local, peer, ans.engine_id or engine, f, ans)
                continue
            if pairing is not None and list(ans.block_ids) != blocks:
                raise RequestError(ErrorCode.INCOMPATIBLE, "the prefill's blocks for this transfer id "
                                   "changed while it was read (the id was held again): not used", msg.req_id)
            if pairing is None:  # (the first answer naming all of the prefill's blocks)
                blocks = list(ans.block_ids)
                ranks = peer.engine_ranks(ans.engine_id or engine)
                remote_layouts = {pp: info.layout for (pp, _), info in ranks.items()}
                msg, plans, pairing = self._told_if(state, peer, ans.engine_id or engine, functools.partial(
                    self._planned, state, peer, local, ans, remote_layouts, f))
            f.have, f.seen = ans.ready, ans.version if f.seen is not None else None
            if f.have >= ans.total:
                rest = plans if f.read == 0 else cut_to_layers(  # (nothing pre-read: the whole plan)
                    plans, (f.read, ans.total), remote_layouts, local.info.layout.num_regions, ans.total)
                self.observer.stream_layers(f.read, ans.total - f.read)
                return Followed(msg, rest, pairing, f.read, f.nbytes)
            sent = self._send_watch(f, engine)  # (waits there while the ready layers are read)
            if f.have > f.read and msg.block_ids:
                cut = cut_to_layers(plans, (f.read, f.have), remote_layouts, local.info.layout.num_regions,
                                    ans.total)
                f.nbytes += await self._pre_read(key, state, local, peer, ans.engine_id or engine, state.msg,
                                                 cut, pairing, f"layers {f.read}-{f.have - 1}")
                f.read = f.have
            ans = await self._answer(sent, state.deadline)

    async def _chunk(self, key: str, state: RecvState, local: Any, peer: Peer, engine: str, f: Following,
                     ans: LayersAt) -> LayersAt:
        """A prompt held chunk by chunk (``LayersAt.partial``): the blocks computed whole since
        the last answer are read (every layer) while the next watch waits there; the answer."""
        f.seen = ans.version
        sent = self._send_watch(f, engine)
        msg = state.msg
        lay = local.info.layout
        ranks = peer.engine_ranks(engine)
        same = same_block_size(lay, (info.layout for info in ranks.values()))
        pairs = (chunk_read(msg, ans, lay.block_size, f.read_blocks)
                 if ans.num_tokens and same and ranks else None)
        if pairs is not None and ans.complete > f.read_blocks:  # (else read at the end)
            mine, theirs, groups, upto = pairs
            if mine:
                sub = msgspec.structs.replace(msg, block_ids=mine, remote_block_ids=theirs,
                                              remote_generation=ans.generation or peer.generation,
                                              remote_tp_size=ans.tp_size or msg.remote_tp_size,
                                              remote_engine_id=ans.engine_id or msg.remote_engine_id,
                                              remote_token=ans.token or msg.remote_token, groups=None,
                                              state_groups=None, state_block_ids=None,
                                              remote_state_block_ids=None)
                plans, pairing = self._told_if(state, peer, engine, functools.partial(
                    plan_read, sub, lay, ranks, engine))
                f.nbytes += await self._pre_read(key, state, local, peer, engine, sub, plans, pairing,
                                                 f"blocks {f.read_blocks}-{upto - 1}")
                self.observer.stream_layers(0, 0, len(mine))
            f.read_blocks = upto
            f.read_groups.update(groups)
        return await self._answer(sent, state.deadline)

    def _told_if(self, state: RecvState, peer: Peer, engine: str, step: Callable[[], T]) -> T:
        """``step()``; if it refuses (RequestError) the receive will never read: its prefill is
        told now, so that it frees its blocks (not at its lease's end)."""
        try:
            return step()
        except RequestError:
            state.peer_agent, state.remote_engine = peer.agent_name, engine
            notify_prefill(self.nixl, self.registry, state, False)
            raise

    def _planned(self, state: RecvState, peer: Peer, local: Any, ans: LayersAt,
                 remote_layouts: dict[int, Any], f: Following
                 ) -> tuple[Recv, list[RankPlan], BlockPairing]:
        """The receive completed with the prefill's first answer naming all its blocks, less the
        blocks read whole as chunks (``f.read_blocks``, the prefill's first), and planned."""
        msg = state.msg
        lay = local.info.layout
        same = same_block_size(lay, remote_layouts.values())
        if msg.groups is not None and not same:  # (pairs per group are block for block)
            raise RequestError(ErrorCode.INCOMPATIBLE, "push of several KV cache groups between different "
                               "block sizes is not supported", msg.req_id)
        if f.read_groups:  # (several KV cache groups: the groups read as chunks, less what was read)
            rest, rest_ans = after_group_chunks(msg, ans, f.read_blocks, f.read_groups, lay.block_size)
            state.msg = completed(rest, rest_ans, peer, same, lay)
            if not state.msg.block_ids and not state.msg.state_block_ids:  # (nothing left: read it
                state.msg = completed(msg, ans, peer, same, lay)  # all again rather than nothing)
        else:
            state.msg = completed(msg, ans, peer, same, lay)
            if f.read_blocks:
                state.msg = after_chunks(state.msg, ans, f.read_blocks, lay.block_size)
        plans, pairing = plan_for(self.registry, state, peer)
        return state.msg, plans, pairing

    def _send_watch(self, f: Following, engine: str) -> Any:
        common = {"seq": 0, "engine_id": engine, "req_id": f.req_id, "have": f.have, "token": f.token,
                  "wait_s": WATCH_WAIT_S, "agent_name": self.peers.channel.agent_name}
        watch = LayerWatch(**common) if f.seen is None else ChunkWatch(**common, seen=f.seen)
        return asyncio.ensure_future(self.peers.call_peer(f.host, f.port, watch, WATCH_WAIT_S + 5.0))

    async def _answer(self, sent: asyncio.Future[Any], deadline: float) -> LayersAt:
        try:
            return await asyncio.wait_for(asyncio.shield(sent), max(0.001, deadline - time.monotonic()))
        except TimeoutError:
            sent.cancel()
            raise RequestError(ErrorCode.DEADLINE, "the prefill computed not every layer before the "
                               "receive's deadline") from None

    async def _pre_read(self, key: str, state: RecvState, local: Any, peer: Peer, engine: str, msg: Recv,
                        cut: list[RankPlan], pairing: BlockPairing, what: str) -> int:
        """Read these plans of ``msg``'s blocks now (some layers, or a chunk's blocks whole);
        wait for them to land (RequestError if they fail: the prefill is told at once, its
        lease then ends with its readers' notices)."""
        try:
            return await self._read(key, state, local, peer, engine, msg, cut, pairing, what)
        except RequestError:
            state.peer_agent = peer.agent_name
            notify_prefill(self.nixl, self.registry, state, False)
            raise

    async def _read(self, key: str, state: RecvState, local: Any, peer: Peer, engine: str, msg: Recv,
                    cut: list[RankPlan], pairing: BlockPairing, what: str) -> int:
        deadline = state.deadline
        rk = f"{key}#{what.replace(' ', '')}"
        try:
            staged = await self._staged(rk, msg, local, peer, engine, cut, pairing, deadline)
            if staged is not None:
                self._staged_pre.add(key)
            if state.stopping:  # (cancelled while the prefill copied: nothing is posted after a cancel)
                raise RequestError(ErrorCode.CANCELLED, "cancelled", msg.req_id)
            fut: asyncio.Future[ReadFinished] = asyncio.get_running_loop().create_future()
            self._reads[rk] = (key, fut)
            spec = ReadSpec(req_id=rk, peer=peer.agent_name, local_rank=local.key,
                            local_blocks=list(msg.block_ids), remote_blocks=list(msg.remote_block_ids),
                            plans=cut, pairing=pairing,
                            deadline=deadline, remote_engine=engine,
                            staged=staged)
            try:
                self.nixl.read(spec)
            except Exception:
                self._reads.pop(rk, None)
                raise
            event = await asyncio.shield(fut)
        finally:
            if self.staging is not None:
                self.staging.release(("pre-read", rk))  # (the prefill frees its own at the next ask)
        if not event.ok:
            raise RequestError(event.code, f"reading {what}: {event.reason}", msg.req_id)
        return event.nbytes

    async def _staged(self, rk: str, msg: Recv, local: Any, peer: Peer, engine: str, cut: list[RankPlan],
                      pairing: BlockPairing, deadline: float) -> StagedRead | None:
        """A pre-read staged as a pull read is (``staged_reads``: the prefill copies the layers'
        runs into its arena, one read of that slot, the scatter here), in one slot and asking
        alone; None: read directly (staging would not pay, no room, a pre-read too large for
        a slot or gathered on several prefill GPUs). RequestError: the prefill refused."""
        if self.staging is None:
            return None
        remaining = deadline - time.monotonic()
        slot = ("pre-read", rk)  # (its slot here: never a receive's, whatever the request ids)
        prepared = self.staging.prepare(slot, msg, local.info, peer, engine, cut, pairing, remaining,
                                        alone=True)
        if prepared is None:
            return None
        if prepared.windows:
            self.staging.release(slot)
            return None
        prepared = dataclasses.replace(prepared, expected=1, alone=True)  # (ranks pre-read at their own pace)
        task = asyncio.ensure_future(self.staging.ask(msg, engine, prepared, remaining, peer, lambda m: None))
        await asyncio.wait([task])
        return self.staging.read_after(slot, prepared, task)


def streamable(peer: Peer, msg: Recv) -> None:
    """RequestError when this receive cannot follow its prefill (it is then recomputed)."""
    if not peer.layer_streams:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"prefill sidecar {peer.endpoint} does not serve "
                           "push mode (an older kvxfer): send it the request first and pull")
    if msg.state_block_ids:  # (a streamed receive's state blocks are paired from its groups)
        raise RequestError(ErrorCode.MALFORMED, "a streamed receive names its state blocks in its groups")
    if msg.groups is not None and not peer.grouped_streams:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"prefill sidecar {peer.endpoint} does not stream models "
                           "of several KV cache groups (an older kvxfer): send it the request first and pull")


def chunk_read(msg: Recv, ans: LayersAt, block_size: int, read_blocks: int
               ) -> tuple[list[int], list[int], dict[int, list[int]], int] | None:
    """What a partial answer lets a decode read now, its blocks computed whole since
    ``read_blocks``: (local, remote, the groups read with the prefill's lists, the prompt
    blocks read up to); None: nothing (lists that cannot be paired: read at the end)."""
    total = -(-ans.num_tokens // block_size)
    grouped = msg.groups is not None
    if grouped != (ans.groups is not None) or (grouped and msg.num_tokens != ans.num_tokens):
        return None  # (lists that cannot be paired: refused at the end, nothing written before)
    if msg.groups is None:
        pairs = chunk_pairs(list(msg.block_ids), list(ans.block_ids), total, read_blocks, ans.complete)
        return None if pairs is None else (*pairs, {}, min(ans.complete, len(ans.block_ids)))
    assert ans.groups is not None
    got = group_chunk_pairs(msg.groups, ans.groups, list(msg.state_groups or ()), total, read_blocks,
                            ans.complete)
    if got is None or not got[2]:
        return None
    mine, theirs, groups = got
    if not set(mine).issubset(msg.block_ids):  # (only blocks admitted with the Recv are written)
        return None
    upto = min(ans.complete, *(len(ans.groups[i]) for i in groups))
    return mine, theirs, {i: list(ans.groups[i]) for i in groups}, upto


def completed(msg: Recv, ans: LayersAt, peer: Peer, same_block_size: bool, local: KVLayout) -> Recv:
    """The Recv of a streamed receive once the prefill's sidecar named its blocks (a partial
    prefix hit on the decode reads the suffix; with block sizes that differ, every block; a
    model of several KV cache groups pairs them group by group: ``paired``)."""
    common = {"remote_generation": ans.generation or peer.generation,
              "remote_tp_size": ans.tp_size or msg.remote_tp_size,
              "remote_engine_id": ans.engine_id or msg.remote_engine_id,
              "remote_token": ans.token or msg.remote_token}  # (the hold's read token: LayersAt.token)
    if msg.groups is not None:
        return msgspec.structs.replace(msg, **paired(msg, ans, local), **common)
    if ans.groups is not None:  # (a decode without its lists per group: its hybrid KV cache manager off?)
        raise RequestError(ErrorCode.INCOMPATIBLE, "the prefill holds this request per KV cache group (a "
                           "model of several groups), this engine names one list: not the same KV cache "
                           "layout, not read", msg.req_id)
    if not same_block_size and 0 < len(msg.block_ids) < -(-ans.num_tokens // local.block_size):
        # (a partial prefix hit here, block sizes that differ: the pairing lines both lists up
        # from the first token, and every block would shift: found by a review)
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{len(msg.block_ids)} blocks of {local.block_size} "
                           f"tokens here for a prompt of {ans.num_tokens} held in blocks of another size: "
                           "a partial prefix hit cannot be paired; computed here", msg.req_id)
    remote = remote_suffix(list(ans.block_ids), len(msg.block_ids), same_block_size)
    return msgspec.structs.replace(msg, remote_block_ids=remote, **common)


def paired(msg: Recv, ans: LayersAt, local: KVLayout) -> dict[str, Any]:
    """A grouped streamed receive's blocks, paired with the prefill's lists as pull pairs them
    (``kvxfer.pairing``): RequestError ``incompatible`` when they cannot be (another number of
    groups or of prompt tokens: the state, or the window, would be another prompt's)."""
    if ans.groups is None:
        raise RequestError(ErrorCode.INCOMPATIBLE, "the prefill holds this request without its blocks per "
                           "KV cache group (one group there: not the same model)", msg.req_id)
    if msg.num_tokens != ans.num_tokens:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"the prefill computes {ans.num_tokens} prompt tokens, "
                           f"this engine loads {msg.num_tokens}: not read", msg.req_id)
    try:
        pairs = pair_groups(msg.groups or [], ans.groups, msg.state_groups or ())
    except ValueError as e:
        raise RequestError(ErrorCode.INCOMPATIBLE, str(e), msg.req_id) from None
    mine = set(msg.block_ids)
    if any(b not in mine for b in pairs.local):  # (only blocks admitted with the Recv are written)
        raise RequestError(ErrorCode.MALFORMED, "the receive's groups name attention blocks its block "
                           "ids do not", msg.req_id)
    check_blocks(msg.req_id, pairs.state_local, local.num_blocks, "local")
    if pairs.state_local and not local.state_regions:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "state blocks to receive, but this rank registered no "
                           "state layers", msg.req_id)
    return {"block_ids": pairs.local, "remote_block_ids": pairs.remote,
            "state_block_ids": pairs.state_local or None,
            "remote_state_block_ids": pairs.state_remote or None}


def _refusal(ans: LayersAt, req_id: str) -> RequestError:
    if ans.held == "gone":
        return RequestError(ErrorCode.EXPIRED, "the prefill's lease on this request ended before every "
                            "layer was computed (aborted, or expired)", req_id)
    return RequestError(ans.code or ErrorCode.TRANSFER_ERROR, ans.reason or "refused by the prefill", req_id)
