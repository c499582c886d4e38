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
from dataclasses import dataclass, field
from typing import Any

from kvxfer.protocol import KVLayout
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
    """One held request's layers: what each rank computed, what a reader may read."""

    stages: dict[int, tuple[int, int]]
    tp_size: int
    done: dict[tuple[int, int], int] = field(default_factory=dict)
    ready: int = 0
    watchers: list[Any] = field(default_factory=list)  # (have, waiter): waiting for more than have

    @property
    def total(self) -> int:
        return sum(n for _, n in self.stages.values())


class LayerBook:
    """The prefill side's held requests in push mode. A request starts with its Hold
    (``start``); reports may come before it (another socket) and are kept, a few, until it
    does. Each change returns the watchers to answer now; the shell answers them."""

    def __init__(self) -> None:
        self._progress: dict[LayerKey, Progress] = {}
        self._early: collections.OrderedDict[LayerKey, dict[tuple[int, int], int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._progress)

    def __contains__(self, key: LayerKey) -> bool:
        return key in self._progress

    def get(self, key: LayerKey) -> Progress | None:
        return self._progress.get(key)

    def start(self, key: LayerKey, stages: dict[int, tuple[int, int]], tp_size: int) -> list[Any]:
        """A streamed Hold: its stages ((first, n) by pipeline stage) and TP size."""
        prog = Progress(dict(stages), tp_size)
        prog.done.update(self._early.pop(key, {}))
        prog.ready = ready_layers(prog.stages, tp_size, prog.done)
        self._progress[key] = prog
        return []

    def report(self, key: LayerKey, pp: int, tp: int, layers: int) -> list[Any]:
        """A rank computed ``layers`` layers of its stage: the watchers that now see more."""
        prog = self._progress.get(key)
        if prog is None:
            early = self._early.setdefault(key, {})
            early[(pp, tp)] = max(early.get((pp, tp), 0), layers)
            self._early.move_to_end(key)
            while len(self._early) > EARLY_MAX:
                self._early.popitem(last=False)
            return []
        if layers <= prog.done.get((pp, tp), 0):
            return []
        prog.done[(pp, tp)] = layers
        ready = ready_layers(prog.stages, prog.tp_size, prog.done)
        if ready <= prog.ready:
            return []
        prog.ready = ready
        due = [w for have, w in prog.watchers if have < ready]
        prog.watchers = [(have, w) for have, w in prog.watchers if have >= ready]
        return due

    def watch(self, key: LayerKey, have: int, waiter: Any) -> bool:
        """A reader waits for more than ``have`` layers: True, answer it now (more are ready,
        or all are); False, it waits (``report``/``end``/``unwatch`` give it back)."""
        prog = self._progress[key]
        if prog.ready > have or prog.ready >= prog.total or len(prog.watchers) >= WATCHERS_MAX:
            return True
        prog.watchers.append((have, waiter))
        return False

    def unwatch(self, key: LayerKey, waiter: Any) -> bool:
        """Its wait is over (timed out): True if it was still waiting."""
        prog = self._progress.get(key)
        if prog is None:
            return False
        n = len(prog.watchers)
        prog.watchers = [(h, w) for h, w in prog.watchers if w is not waiter]
        return len(prog.watchers) < n

    def end(self, key: LayerKey) -> list[Any]:
        """Its lease ended: the watchers still waiting (answer them "gone")."""
        self._early.pop(key, None)
        prog = self._progress.pop(key, None)
        return [w for _, w in prog.watchers] if prog is not None else []

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


def remote_suffix(remote: list[int], n_local: int, ratio_one: bool) -> list[int]:
    """The prefill's blocks a decode with ``n_local`` blocks to fill reads: all of them, or (a
    partial prefix hit on the decode, equal block sizes) the last ``n_local``, so that block i
    of the suffix lands in local block i and nothing shifts."""
    if ratio_one and 0 < n_local < len(remote):
        return remote[len(remote) - n_local:]
    return remote
