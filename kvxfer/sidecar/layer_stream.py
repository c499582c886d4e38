"""Push mode's pure half: the layers of a held request as its prefill computes them, and
which of them a decode reads next. No I/O, no clock of its own, no asyncio.

How push works in kvxfer (README "Push mode"): the router sends a request to the prefill and
the decode at once, with one transfer id. The prefill engine holds its blocks as soon as they
are allocated (``Hold.streamed``) and its workers report each layer computed (``LayersDone``).
The decode's sidecar watches the request at the prefill's sidecar (``LayerWatch``, answered
``LayersAt`` as soon as more layers are ready) and reads the layers ready so far while the
prefill computes the next ones; after the last layer, one layer's read (and its lease's proof)
remain. The decode reads, the prefill never writes: every TP mapping, group and layout of the
pull path is used as it is, a decode's abort is the cancel of its own read (nothing can land
in its blocks after its ``Failed``), and no peer ever gets write access to a decode's memory.

Prefill side: ``LayerBook`` (per held request: each worker rank's layers, the layers every
rank holding them computed, the watches waiting for more). Decode side: ``read_ranges`` (the
layer ranges to read next, in aligned power-of-two runs so that the descriptor lists prepared
for them are few and reused) and ``restrict`` (a read's plans cut to some layers).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import KVLayout, LayersAt, Recv
from kvxfer.topology import RankPlan

LayerKey = tuple[str, str]  # (engine, request id): as leases are keyed
EARLY_MAX = 4096  # reports kept for requests whose Hold has not arrived yet (oldest dropped)
WATCHERS_MAX = 64  # watches waiting on one request (a decode has one per local rank); more: answered now


# ---------------------------------------------------------------------------- prefill side


def ready_layers(stages: dict[int, tuple[int, int]], tp_size: int, done: dict[tuple[int, int], int]) -> int:
    """Layers ``[0, n)`` of the model that every rank holding them computed. ``stages``:
    pipeline stage -> (first layer, layers); ``done``: (pp, tp) -> layers of its stage it
    computed. Layers are computed in order, stage after stage."""
    ready = 0
    for pp in sorted(stages):
        first, n = stages[pp]
        if first != ready:
            return ready  # (a stage missing before this one)
        least = min((min(done.get((pp, tp), 0), n) for tp in range(tp_size)), default=0)
        ready = first + least
        if least < n:
            return ready
    return ready


@dataclass
class Progress:
    """One held request's layers: what each rank computed, what a reader may read. A prompt
    computed in chunks (``partial``: more of its blocks are still to be held) has its leading
    ``complete`` blocks computed in every layer; layers (``ready``) count once its last chunk
    is held. ``version`` counts every change a reader may act on."""

    stages: dict[int, tuple[int, int]]
    tp_size: int
    done: dict[tuple[int, int], int] = field(default_factory=dict)
    ready: int = 0
    # (have, version or None, waiter): waiting for more than ``have`` layers (a reader of
    # chunks: for a version after the one it saw)
    watchers: list[Any] = field(default_factory=list)
    partial: bool = False
    blocks_done: dict[tuple[int, int], int] = field(default_factory=dict)
    complete: int = 0
    version: int = 0

    @property
    def total(self) -> int:
        return sum(n for _, n in self.stages.values())

    def due(self) -> list[Any]:
        """The watchers that now see something new (taken off the list)."""
        def wakes(have: int, seen: int | None) -> bool:
            return self.version > seen if seen is not None else not self.partial and have < self.ready
        out = [w for have, seen, w in self.watchers if wakes(have, seen)]
        self.watchers = [(h, s, w) for h, s, w in self.watchers if not wakes(h, s)]
        return out


@dataclass(frozen=True)
class RefusedHold:
    engine: str
    token: str
    code: str
    reason: str
    until: float  # (time.monotonic())


class RefusedHolds:
    """Push holds this sidecar refused (too late, draining, ranks missing, blocks out of range),
    kept a while by request id: a decode watching one is answered "refused" at once, instead
    of "unknown" until its deadline (it used to wait its whole transfer timeout, then
    recompute). Bounded: the oldest go first; a hold of the id that is made drops it."""

    def __init__(self, most: int = 4096) -> None:
        self.most = most
        self._by_id: collections.OrderedDict[str, RefusedHold] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, req_id: str, refused: RefusedHold) -> None:
        self._by_id.pop(req_id, None)
        self._by_id[req_id] = refused
        while len(self._by_id) > self.most:
            self._by_id.popitem(last=False)

    def drop(self, req_id: str) -> None:
        self._by_id.pop(req_id, None)

    def find(self, req_id: str, engine: str, now: float) -> RefusedHold | None:
        """The refusal of ``req_id`` of ``engine`` ("": any) still kept at ``now``."""
        got = self._by_id.get(req_id)
        if got is None or now >= got.until:
            if got is not None:
                del self._by_id[req_id]
            return None
        return got if engine in ("", got.engine) else None


class LayerBook:
    """The prefill side's held requests in push mode. A request starts with its Hold
    (``start``); reports may come before it (another socket) and are kept, a few, until it
    does. Each change returns the watchers to answer now; the shell answers them."""

    def __init__(self) -> None:
        self._progress: dict[LayerKey, Progress] = {}
        self._early: collections.OrderedDict[LayerKey, dict[tuple[int, int], tuple[int, int]]] = (
            collections.OrderedDict())
        self._not_held: collections.OrderedDict[LayerKey, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._progress)

    def __contains__(self, key: LayerKey) -> bool:
        return key in self._progress

    def get(self, key: LayerKey) -> Progress | None:
        return self._progress.get(key)

    def start(self, key: LayerKey, stages: dict[int, tuple[int, int]], tp_size: int,
              partial: bool = False) -> list[Any]:
        """A streamed Hold: its stages ((first, n) by pipeline stage) and TP size; ``partial``:
        a prompt computed in chunks, held at its first (``extend`` holds the next ones)."""
        prog = Progress(dict(stages), tp_size, partial=partial)
        self._not_held.pop(key, None)
        for rank, (layers, blocks) in self._early.pop(key, {}).items():
            prog.done[rank], prog.blocks_done[rank] = layers, blocks
        self._advance(prog)
        self._progress[key] = prog
        return []

    def not_held(self, key: LayerKey) -> None:
        """A streamed Hold refused or released at once: the reports kept for it, and any that
        come before the next streamed Hold of the key, are not counted (a retry held under the
        same id started with them: its decode read blocks not computed; found by a review)."""
        self._early.pop(key, None)
        self._not_held[key] = None
        self._not_held.move_to_end(key)
        while len(self._not_held) > EARLY_MAX:
            self._not_held.popitem(last=False)

    def extend(self, key: LayerKey, partial: bool) -> list[Any]:
        """The next chunk's blocks are held (``partial`` False: the last): readers see it."""
        prog = self._progress[key]
        prog.partial = prog.partial and partial
        prog.version += 1
        return prog.due()

    def report(self, key: LayerKey, pp: int, tp: int, layers: int, blocks: int = 0) -> list[Any]:
        """A rank computed ``layers`` layers of its stage (of the last chunk), or every layer
        of the first ``blocks`` blocks (a chunk): the watchers that now see more."""
        prog = self._progress.get(key)
        if prog is None and key in self._not_held:
            return []
        if prog is None:
            early = self._early.setdefault(key, {})
            old = early.get((pp, tp), (0, 0))
            early[(pp, tp)] = (max(old[0], layers), max(old[1], blocks))
            self._early.move_to_end(key)
            while len(self._early) > EARLY_MAX:
                self._early.popitem(last=False)
            return []
        if layers <= prog.done.get((pp, tp), 0) and blocks <= prog.blocks_done.get((pp, tp), 0):
            return []
        prog.done[(pp, tp)] = max(layers, prog.done.get((pp, tp), 0))
        prog.blocks_done[(pp, tp)] = max(blocks, prog.blocks_done.get((pp, tp), 0))
        return prog.due() if self._advance(prog) else []

    def _advance(self, prog: Progress) -> bool:
        ready = ready_layers(prog.stages, prog.tp_size, prog.done)
        ranks = [(pp, tp) for pp in prog.stages for tp in range(prog.tp_size)]
        complete = min((prog.blocks_done.get(r, 0) for r in ranks), default=0)
        if ready <= prog.ready and complete <= prog.complete:
            return False
        prog.ready, prog.complete = max(ready, prog.ready), max(complete, prog.complete)
        prog.version += 1
        return True

    def watch(self, key: LayerKey, have: int, waiter: Any, seen: int | None = None) -> bool:
        """A reader waits for more than ``have`` layers (a reader of chunks, ``seen``: for a
        version after this one): True, answer it now (there is more, or all is ready); False,
        it waits (``report``/``extend``/``end``/``unwatch`` give it back). An older reader of
        a hold still partial waits for the last chunk's layers: it never sees a partial list."""
        prog = self._progress[key]
        if seen is not None:
            now = prog.version > seen or (not prog.partial and prog.ready >= prog.total)
        else:
            now = not prog.partial and (prog.ready > have or prog.ready >= prog.total)
        if now or len(prog.watchers) >= WATCHERS_MAX:
            return True
        prog.watchers.append((have, seen, waiter))
        return False

    def unwatch(self, key: LayerKey, waiter: Any) -> bool:
        """Its wait is over (timed out): True if it was still waiting."""
        prog = self._progress.get(key)
        if prog is None:
            return False
        n = len(prog.watchers)
        prog.watchers = [(h, s, w) for h, s, w in prog.watchers if w is not waiter]
        return len(prog.watchers) < n

    def end(self, key: LayerKey) -> list[Any]:
        """Its lease ended: the watchers still waiting (answer them "gone")."""
        self._early.pop(key, None)
        prog = self._progress.pop(key, None)
        return [w for _, _, w in prog.watchers] if prog is not None else []

    def held(self) -> list[LayerKey]:
        return list(self._progress)


def stages_of(layouts: list[KVLayout]) -> tuple[dict[int, tuple[int, int]], int]:
    """An engine's pipeline stages ((first layer, layers) by pp rank) and TP size, from the
    layouts of its registered ranks. A stage's layers are its KV tensors and, where it has
    state layers (Mamba/GDN), its state as one more: reported only once the forward is over
    (``kvxfer.connector.layer_reports``), read with the last range (``restrict``)."""
    stages = {lay.pp_rank: (lay.first_layer, lay.num_layers + (1 if lay.state_regions else 0))
              for lay in layouts}
    return stages, max((lay.tp_size for lay in layouts), default=1)


# ---------------------------------------------------------------------------- decode side


def read_ranges(have: int, ready: int) -> list[tuple[int, int]]:
    """Layers ``[have, ready)`` as aligned power-of-two runs (a run of 2**k layers starts at a
    multiple of 2**k): a request's reads, whatever the moments its layers became ready, use
    at most 2 x layers distinct layer ranges, each of whose descriptor lists is prepared once."""
    out = []
    a = have
    while a < ready:
        size = a & -a if a else 1 << (ready - 1).bit_length()
        while a + size > ready:
            size //= 2
        out.append((a, a + size))
        a += size
    return out


def restrict(plans: list[RankPlan], layers: tuple[int, int], remote: dict[int, KVLayout],
             n_local_regions: int, last: bool) -> list[RankPlan]:
    """``plans`` cut to the model layers ``[a, b)`` (``remote``: the remote stage layouts by pp
    rank; ``n_local_regions``: the local rank's attention regions, what a plan's
    ``num_regions`` 0 means). Regions pair one to one in order, layer-major on both sides, so a
    plan's layers are cut on the remote side and shifted alike on the local one. State plans
    (Mamba/GDN: the state after the whole prompt) go with the ``last`` range only."""
    a, b = layers
    out = []
    for plan in plans:
        if plan.state:
            if last:
                out.append(plan)
            continue
        lay = remote[plan.remote_pp]
        parts = lay.kv_parts
        lo = (max(a, lay.first_layer) - lay.first_layer) * parts
        hi = (min(b, lay.first_layer + lay.num_layers) - lay.first_layer) * parts
        lslice, rslice = plan.region_slices(n_local_regions)
        start, stop = max(rslice.start, lo), min(rslice.stop, hi)
        if start >= stop:
            continue
        shift = start - rslice.start
        out.append(dataclasses.replace(plan, remote_region0=start, local_region0=lslice.start + shift,
                                       num_regions=stop - start))
    return out


def cut_to_layers(plans: list[RankPlan], layers: tuple[int, int], remote: dict[int, KVLayout],
                  n_local_regions: int, total: int) -> list[RankPlan]:
    """``plans`` cut to the layers ``[a, b)`` in ``read_ranges``' runs (``restrict`` each; the
    state goes with the run that ends at ``total``)."""
    return [p for a, b in read_ranges(*layers)
            for p in restrict(plans, (a, b), remote, n_local_regions, last=b == total)]


def same_block_size(local: KVLayout, remote: Iterable[KVLayout]) -> bool:
    return all(lay.block_size == local.block_size for lay in remote)


def remote_suffix(remote: list[int], n_local: int, ratio_one: bool) -> list[int]:
    """The prefill's blocks a decode with ``n_local`` blocks to fill reads: all of them, or (a
    partial prefix hit on the decode, equal block sizes) the last ``n_local``, so that block i
    of the suffix lands in local block i and nothing shifts."""
    if ratio_one and 0 < n_local < len(remote):
        return remote[len(remote) - n_local:]
    return remote


def chunk_pairs(local: list[int], remote: list[int], total: int, lo: int, hi: int
                ) -> tuple[list[int], list[int]] | None:
    """A prompt held chunk by chunk: the pairs of the prefill's blocks ``[lo, hi)`` (computed
    whole; ``remote``: its list so far) and the decode's, which are the last ``len(local)`` of
    the prompt's ``total`` blocks (a partial prefix hit on the decode: positions before those
    are not read). None: the decode names more blocks than the prompt has."""
    offset = total - len(local)
    if offset < 0:
        return None
    pos = range(max(lo, offset), min(hi, len(remote), total))
    return [local[p - offset] for p in pos], [remote[p] for p in pos]


def group_chunk_pairs(local: list[list[int]], remote: list[list[int]], state: list[bool], total: int,
                      lo: int, hi: int) -> tuple[list[int], list[int], list[int]] | None:
    """A model of several KV cache groups held chunk by chunk: ``chunk_pairs`` of each group the
    prefill holds by chunk so far (its list not empty: full attention and MLA; a window's and
    a state's come with the last chunk), pairs with a null block skipped. Returns (local,
    remote, the groups read); None: the lists cannot be paired (another number of groups, a
    decode list longer than the prompt)."""
    if len(local) != len(remote):
        return None
    mine: list[int] = []
    theirs: list[int] = []
    read = []
    for i, (lg, rg) in enumerate(zip(local, remote, strict=True)):
        if not rg or (i < len(state) and state[i]):
            continue
        pairs = chunk_pairs(list(lg), list(rg), total, lo, hi)
        if pairs is None:
            return None
        read.append(i)
        for a, b in zip(*pairs, strict=True):
            if a and b:
                mine.append(a)
                theirs.append(b)
    return mine, theirs, read


def after_group_chunks(msg: Recv, ans: LayersAt, read_blocks: int, read: dict[int, list[int]],
                       block_size: int) -> tuple[Recv, LayersAt]:
    """A grouped streamed receive and the prefill's final answer, each group read by chunk
    (``read``: group -> the prefill's list as it was read) less the prompt's first
    ``read_blocks`` positions, on both sides (pairing them at the tail, as ``pair_groups``
    does, then lines up the rest as before). RequestError ``incompatible``: a group's final list
    is not the prompt's length or does not start with the blocks read (they were another
    request's)."""
    total = -(-ans.num_tokens // block_size)
    local, remote = [list(g) for g in msg.groups or []], [list(g) for g in ans.groups or []]
    for i, seen in read.items():
        if i >= len(remote) or i >= len(local):
            raise RequestError(ErrorCode.INCOMPATIBLE, f"group {i} read by chunk is not in the prefill's "
                               "final lists", msg.req_id)
        rg, lg = remote[i], local[i]
        if len(rg) != total or rg[:read_blocks] != seen[:read_blocks]:
            raise RequestError(ErrorCode.INCOMPATIBLE, f"the prefill's group {i} holds {len(rg)} blocks for "
                               f"{ans.num_tokens} tokens, not starting with the blocks read as chunks",
                               msg.req_id)
        remote[i] = rg[read_blocks:]
        local[i] = lg[max(0, read_blocks - (total - len(lg))):]
    return (msgspec.structs.replace(msg, groups=local), msgspec.structs.replace(ans, groups=remote))


def after_chunks(msg: Recv, ans: LayersAt, read_blocks: int, block_size: int) -> Recv:
    """A completed streamed Recv less the pairs of the prefill's first ``read_blocks`` blocks
    (read whole as chunks, ``chunk_pairs``). RequestError ``incompatible``: the prefill's list
    is not the length its prompt's tokens make (the positions read would not be these)."""
    total = len(ans.block_ids)
    if not ans.num_tokens or -(-ans.num_tokens // block_size) != total:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"the prefill holds {total} blocks for "
                           f"{ans.num_tokens} tokens: its chunks read are not these", msg.req_id)
    k = max(0, read_blocks - (total - len(msg.block_ids)))
    if k >= len(msg.block_ids):
        return msg  # (nothing left: read it all again rather than nothing)
    return msgspec.structs.replace(msg, block_ids=msg.block_ids[k:],
                                   remote_block_ids=msg.remote_block_ids[k:])
