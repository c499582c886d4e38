"""What the NIXL agent knows: local ranks' registered memory, remote agents, and the
descriptor lists prepared between them. Used on the NIXL port's thread only (or by the
loop under the port's lock).

Nothing here is released while a read may still write through it: a rank unregistered or
a peer removed during reads keeps its registrations, remote entry and descriptor lists
until those reads settled (``Cleanup``). ``transfer()`` on a released handle segfaults.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.integrity import digest, region_view
from kvxfer.protocol import DigestItem, RankInfo, RegisterKV, RemoteRegion
from kvxfer.sidecar.mapping import Mapping, map_memory
from kvxfer.sidecar.ownership import Creds
from kvxfer.sidecar.plan import LegPlan, PairRows, ReadSpec, pair_rows, plan_leg, state_pairs, strided_rows
from kvxfer.sidecar.pool_server import PoolServer
from kvxfer.topology import RankPlan

log = logging.getLogger("kvxfer.transfer")


@dataclass
class LocalRank:
    key: Hashable  # kvxfer.sidecar.registry.RankKey: the registry is the only caller of register
    mappings: list[Mapping]
    reg_descs: list[Any]
    info: RankInfo  # absolute region addresses, as peers see them

    @property
    def num_blocks(self) -> int:
        return self.info.layout.num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in all its regions (an upper bound on what a block moves)."""
        return self.info.block_bytes()


@dataclass
class PairLists:
    """Prepared descriptor lists for one (peer, local rank, remote rank) plan."""

    local: Any
    remote: Any
    rows: PairRows
    local_mem: str
    remote_mem: str


@dataclass
class Leg:
    """One leg of a read as it is posted: its lists, its plan, how far it got."""

    pair: PairLists
    plan: LegPlan
    next_desc: int = 0


@dataclass
class _Deferred:
    waits_for: set[str]  # request ids still settling
    action: Callable[[], None]
    peer: str = ""  # set for a remote agent's removal (cancelled if that agent is re-added)


class Cleanup:
    """Actions that wait until named reads settled (none of their chunks can still land)."""

    def __init__(self) -> None:
        self._deferred: list[_Deferred] = []

    def after(self, req_ids: set[str], action: Callable[[], None], peer: str = "") -> None:
        """Run ``action`` once none of ``req_ids`` has a chunk in flight (now, if none has)."""
        if req_ids:
            self._deferred.append(_Deferred(set(req_ids), action, peer))
        else:
            action()

    def settled(self, req_id: str) -> None:
        keep = []
        for d in self._deferred:
            d.waits_for.discard(req_id)
            if d.waits_for:
                keep.append(d)
            else:
                try:
                    d.action()
                except Exception:
                    log.exception("deferred NIXL cleanup failed")
        self._deferred = keep

    def waits_for_peer(self, peer: str) -> bool:
        return any(d.peer == peer for d in self._deferred)

    def keep_peer(self, peer: str) -> None:
        """The peer's removal is off: the same agent was loaded again meanwhile."""
        self._deferred = [d for d in self._deferred if d.peer != peer]


class Registrations:
    def __init__(self, agent: Any, pools: PoolServer | None, cleanup: Cleanup) -> None:
        self._agent = agent
        self._pools = pools
        self._cleanup = cleanup
        self.local: dict[Hashable, LocalRank] = {}
        self.peers: dict[str, dict[tuple[str, int, int], RankInfo]] = {}  # agent -> RankInfo.key -> info
        self._pairs: dict[tuple[Any, ...], PairLists] = {}  # (peer, local key, plan identity)
        self.dlists_prepared = 0  # descriptor list pairs prepared (prep_xfer_dlist), ever

    # ------------------------------------------------------------------ local ranks

    def register(self, key: Hashable, msg: RegisterKV, peer: Creds) -> RankInfo:
        """Map a rank's memory and register it with NIXL; returns what peers need to read
        from it (absolute region addresses). The caller unregistered the key first. ``peer``:
        the registering process, whose own memory it must be (``map_memory``)."""
        mappings: list[Mapping] = []
        regs: list[Any] = []
        agent = self._agent
        try:
            for ref in msg.memory:
                mappings.append(map_memory(ref, self._pools, peer))
            mem_types = {m.mem_type for m in mappings}
            if len(mem_types) != 1:
                raise RequestError(ErrorCode.INVALID_LAYOUT, "mixed DRAM and VRAM in one rank")
            mem_type = mem_types.pop()
            for m in mappings:
                regs.append(agent.register_memory([(m.addr, m.size, m.device_id, "")], mem_type))
            remote = [RemoteRegion(addr=mappings[r.memory].addr + r.offset, block_len=r.block_len,
                                   block_stride=r.block_stride, device_id=mappings[r.memory].device_id)
                      for r in msg.regions]
        except BaseException:
            for reg in regs:
                agent.deregister_memory(reg)
            for m in mappings:
                m.close()
            raise
        info = RankInfo(layout=msg.layout, regions=remote, mem_type=mem_type)  # type: ignore[arg-type]
        self.local[key] = LocalRank(key, mappings, regs, info)
        return info

    def unregister(self, key: Hashable, settling: set[str]) -> None:
        """Forget a rank now; release its memory once ``settling`` (its failed reads) settled."""
        local = self.local.pop(key)
        pairs = self._take_pairs(lambda k: k[1] == key)

        def release() -> None:
            self._release_pairs(pairs)
            for reg in local.reg_descs:
                self._agent.deregister_memory(reg)
            for m in local.mappings:
                m.close()

        self._cleanup.after(settling, release)

    def digest(self, key: Hashable, items: list[DigestItem], region0: int = 0, num_regions: int = 0) -> str:
        """Digest of these blocks and runs of a local rank's regions ``[region0, +num_regions)``
        (0: all; ``kvxfer.integrity``), on the thread that owns the mappings (an unregister
        cannot unmap them underneath)."""
        local = self.local.get(key)
        if local is None:
            raise RequestError(ErrorCode.NOT_REGISTERED, f"rank {key} not registered")
        nb = local.num_blocks
        for item in items:
            if any(b >= nb for b in item.blocks):
                raise RequestError(ErrorCode.BLOCK_OUT_OF_RANGE, f"digest of blocks outside [0, {nb})")
        regions = local.info.regions
        stop = region0 + (num_regions or len(regions))
        if stop > len(regions):
            raise RequestError(ErrorCode.INVALID_LAYOUT, f"digest of regions up to {stop} of {len(regions)}")
        views = []
        for reg in regions[region0:stop]:
            if any(off + n > reg.block_len for item in items for off, n in item.runs):
                raise RequestError(ErrorCode.INVALID_LAYOUT, "digest run outside a block")
            m = next(m for m in local.mappings if m.addr <= reg.addr < m.addr + m.size)
            views.append(region_view(m.as_tensor(), m.addr, reg.addr, nb, reg.block_len, reg.block_stride))
        return digest(views, items)

    # ------------------------------------------------------------------ peers

    def add_peer(self, name: str, metadata: bytes, ranks: list[RankInfo], reload: bool) -> str:
        """Load a peer's agent metadata (the caller removed an entry of the same name first);
        descriptor lists are prepared per plan on first use."""
        if reload and self._cleanup.waits_for_peer(name):
            # Its registrations changed (new memory, new keys): the new metadata must be
            # loaded, which NIXL allows only once the old entry is removed, and that waits
            # until the reads against it settled. Refuse this time; the next request retries.
            raise RequestError(ErrorCode.TRANSFER_ERROR, f"peer {name} re-registered while reads of its "
                               "old registrations still settle; try again")
        if self._cleanup.waits_for_peer(name):
            # The same process again, still loaded while reads of its old entry settle:
            # keep it loaded (its old descriptor lists are still released later).
            self._cleanup.keep_peer(name)
            self.peers[name] = {info.key: info for info in ranks}
            return name
        raw = self._agent.add_remote_agent(metadata)
        loaded = raw.decode() if isinstance(raw, bytes) else str(raw)
        if loaded != name:
            self._agent.remove_remote_agent(loaded)
            raise RequestError(ErrorCode.HANDSHAKE_FAILED,
                               f"peer metadata names agent {loaded!r}, its handshake said {name!r}")
        self.peers[name] = {info.key: info for info in ranks}
        return name

    def remove_peer(self, name: str, settling: set[str], at_once: bool = False) -> bool:
        """Forget a peer now; its lists go once ``settling`` settled, and its NIXL entry too
        (``at_once``: now, which ends the transfers in flight against it)."""
        known = self.peers.pop(name, None) is not None
        pairs = self._take_pairs(lambda key: key[0] == name)
        self._cleanup.after(settling, lambda: self._release_pairs(pairs))

        def forget() -> None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # unknown to NIXL already
                log.debug("remove_remote_agent(%s): %s", name, e)

        if at_once:
            self._cleanup.keep_peer(name)  # (a deferred removal of it must not remove a later load)
            try:
                self._agent.remove_remote_agent(name)
                return known
            except Exception as e:  # (refused with transfers outstanding: once they settled, then)
                log.warning("remove_remote_agent(%s) refused now (%s): again once its reads settled", name, e)
        self._cleanup.after(settling, forget, peer=name)
        return known

    # ------------------------------------------------------------------ reads

    def legs(self, spec: ReadSpec, chunk_bytes: int, merge: bool) -> tuple[list[Leg], int]:
        """The legs of a read (one per remote rank that moves anything) and its bytes."""
        local = self.local[spec.local_rank]
        pairs = spec.pairing.pairs(len(spec.local_blocks), len(spec.remote_blocks))
        lb = np.asarray(spec.local_blocks, dtype=np.int64)
        rb = np.asarray(spec.remote_blocks, dtype=np.int64)
        sl, sr = spec.state_blocks
        spairs = state_pairs(len(sl))
        slb = np.asarray(sl, dtype=np.int64)
        srb = np.asarray(sr, dtype=np.int64)
        legs, nbytes = [], 0
        for plan in spec.plans:
            pl = self._pair_lists(spec.peer, local, plan, spec.remote_engine)
            remote = self.peers[spec.peer][(spec.remote_engine, plan.remote_pp, plan.remote_rank)]
            leg = plan_leg(pl.rows, spairs if plan.state else pairs, slb if plan.state else lb,
                           srb if plan.state else rb, local.num_blocks, remote.layout.num_blocks,
                           merge=merge, chunk_bytes=chunk_bytes)
            if leg is not None:
                legs.append(Leg(pl, leg))
                nbytes += leg.nbytes
        return legs, nbytes

    def first_byte(self, spec: ReadSpec) -> int:
        """The host address of the first byte a read writes (0: none, or not host memory);
        the test hook that flips it after the read landed (KVXFER_TEST_CORRUPT_READS)."""
        local = self.local[spec.local_rank]
        sl = spec.state_blocks[0]
        target = next((p for p in spec.plans if (sl if p.state else spec.local_blocks)), None)
        if target is None or local.info.mem_type != "DRAM":
            return 0
        reg = local.info.regions[target.local_region0]
        seg = next(q[0] for q in target.segments if q)
        pairs = spec.pairing.pairs(len(spec.local_blocks), len(spec.remote_blocks))
        first = sl[0] if target.state else spec.local_blocks[pairs[0][0]]
        return reg.addr + first * reg.block_stride + seg.local_off

    def _pair_lists(self, peer: str, local: LocalRank, plan: RankPlan, remote_engine: str) -> PairLists:
        key = (peer, local.key, remote_engine, plan.remote_pp, plan.remote_rank, plan.local_region0,
               plan.remote_region0, plan.num_regions)
        pl = self._pairs.get(key)
        if pl is not None:
            return pl
        remote = self.peers[peer][(remote_engine, plan.remote_pp, plan.remote_rank)]
        lslice, rslice = plan.region_slices(len(local.info.regions))
        if lslice.stop > len(local.info.regions) or rslice.stop > len(remote.regions):
            raise RequestError(ErrorCode.INCOMPATIBLE, f"plan reads regions {rslice} of "
                               f"{len(remote.regions)} into {lslice} of {len(local.info.regions)}")
        rows = pair_rows(plan, local.info.regions, remote.regions,
                         min(local.num_blocks, remote.layout.num_blocks))
        agent = self._agent
        self.dlists_prepared += 1  # read by a metrics gauge: a hostile peer must never get here
        ldl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", strided_rows(rows.local, local.num_blocks),
                                    local.info.mem_type)
        try:
            rdl = agent.prep_xfer_dlist(peer, strided_rows(rows.remote, remote.layout.num_blocks),
                                        remote.mem_type)
        except Exception:
            agent.release_dlist_handle(ldl)
            raise
        pl = PairLists(ldl, rdl, rows, local.info.mem_type, remote.mem_type)
        self._pairs[key] = pl
        return pl

    def _take_pairs(self, match: Callable[[tuple[Any, ...]], bool]) -> list[PairLists]:
        return [self._pairs.pop(key) for key in [k for k in self._pairs if match(k)]]

    def _release_pairs(self, pairs: list[PairLists]) -> None:
        for pl in pairs:
            for handle in (pl.local, pl.remote):
                try:
                    self._agent.release_dlist_handle(handle)
                except Exception as e:
                    log.debug("release_dlist_handle: %s", e)
