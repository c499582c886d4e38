"""Worker-side connector logic: register this rank's KV memory, then report completions.

Nothing here blocks in the engine step: ``start_load_kv`` only records what the
scheduler posted (from the connector metadata), ``get_transfer_results`` drains the
sidecar's events with NOBLOCK. Each rank reports only what its own sidecar connection
was told (``Done``/``Failed`` for its rank, ``Released`` for every rank), as vLLM's
``KVOutputAggregator`` expects one report per worker. vLLM objects are duck-typed;
nothing here imports vLLM.

If the sidecar never answers (it died, its socket was replaced), the deadlines that the
scheduler put in the metadata fire here: an overdue receive is reported failed (vLLM
recomputes it), an overdue hold as sent (its lease is over; nobody can be reading). A
heartbeat (a Ping about once a second, answered with the sidecar's instance name) notices
a restarted sidecar at once: loads in flight fail, holds are freed, memory re-registered.
While the sidecar still answers heartbeats an overdue receive is left to it (up to
``settle_s`` more): a failed read is reported only once its NIXL chunks stopped, and
failing it here first would let vLLM reuse blocks a late chunk may still write.

Early events (a ``Done`` that comes before the step that names its request): ``early.py``.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvxfer.client import SEND_ERRORS, Drained, SidecarClient
from kvxfer.connector.early import EARLY_MAX, EarlyEvents
from kvxfer.connector.holds_check import OverdueHolds
from kvxfer.connector.layer_reports import LayerReports
from kvxfer.connector.layout import Placement, registration_from_tensors, tensor_of_layer
from kvxfer.connector.rejoin import Rejoin, naming_abandoned
from kvxfer.connector.settings import ConnectorSettings
from kvxfer.connector.shm_pool import SharedAllocator
from kvxfer.connector.sidecar_death import SidecarDeath
from kvxfer.connector.state_parts import StateSplit
from kvxfer.errors import ErrorCode, KvxferError
from kvxfer.memory import cuda_ipc_memory, cuda_ordinal
from kvxfer.pool import PoolClient
from kvxfer.protocol import Done, Failed, KVGroup, LayersDone, MemoryRef, Registered, Released

log = logging.getLogger(__name__)
# A memory-channel call made inside an engine step (after a sidecar restart) waits at most this long
# (the client's 30 s, per call and per pool, once held the step: found by a review); one not
# answered in time is tried again with the registration (``Rejoin``)
STEP_CALL_S = 0.25



@dataclass
class TransferResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass
class WorkerStats:
    recv_ok: int = 0
    recv_failed: int = 0
    bytes: int = 0
    seconds: float = 0.0
    descriptors: int = 0
    released: int = 0
    expired: int = 0

    def take(self) -> dict[str, float]:
        out = dict(self.__dict__)
        self.__init__()  # type: ignore[misc]
        return out


@dataclass(frozen=True)
class CacheShape:
    num_blocks: int
    block_size: int
    num_kv_heads: int  # total, model-wide
    local_kv_heads: int
    head_dim: int
    mla: bool
    fused: str = "kv_content"  # how K and V share a block without a K/V dimension
    model: str = ""  # the model's identity (connector.model_identity)


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, tp_rank: int, tp_size: int, device: str,
                 place: Placement | None = None) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.place = place or Placement()
        self.device = device
        # vLLM's KV cache is allocated in pools the sidecar owns (its memory channel): on a
        # CPU always, on a GPU with gpu_memory "vmm" (else the engine allocates: CUDA IPC)
        gpu = cuda_ordinal(device) if settings.gpu_memory == "vmm" else None
        uses_pools = device == "cpu" or gpu is not None
        self.pools = PoolClient.for_engine_socket(settings.sidecar) if uses_pools else None
        if gpu is not None and self.pools is None:
            raise RuntimeError("kvxfer: gpu_memory 'vmm' needs an ipc:// sidecar socket (the memory channel)")
        self.allocator = SharedAllocator(settings.shm_dir, pools=self.pools, gpu=gpu) if uses_pools else None
        self.client: SidecarClient | None = None
        self.registered: Registered | None = None
        self._recvs: dict[str, tuple[list[int], float]] = {}
        self._holds: dict[str, float] = {}
        self._overdue = OverdueHolds(settings.lease_s + settings.grace_s + settings.settle_s)  # (holds_check)
        self._names: dict[str, str] = {}  # push mode: lease (transfer) id -> vLLM's request id
        self._layers = LayerReports({})  # push mode: the layers a step computed, as the sidecar counts them
        self._invalid: set[int] = set()
        self.stats = WorkerStats()
        self._registration: Any = None
        self._instance = ""
        self._next_heartbeat = 0.0
        self._last_pong = time.monotonic()
        self._failed_now: dict[str, list[int]] = {}
        self._abandoned: dict[str, float] = {}  # req id -> deadline: failed / freed at a sidecar restart
        self._reported_failed: set[str] = set()  # metadata can be bound twice in one step
        self._rejoin = Rejoin()  # registering with a restarted sidecar (sent again until answered)
        self.death = SidecarDeath()  # the sidecar's pidfd: proof that it exited
        self._gone = False  # it exited (proven) and no successor answered yet
        # Done/Failed/Released that came before their bind()
        self._early = EarlyEvents(settings.transfer_timeout_s + settings.lease_s + settings.grace_s)

    def mem_pool_context(self) -> AbstractContextManager[Any] | None:
        return self.allocator

    def _memory_of(self, tensor: Any) -> tuple[MemoryRef, object, int]:
        found = self.allocator.lookup(tensor) if self.allocator is not None else None
        if found is not None:
            ref, offset = found
            return ref, ("mem", getattr(ref, "pool", "") or getattr(ref, "path", "")), offset
        if tensor.device.type == "cuda":
            storage = tensor.untyped_storage()
            ref = cuda_ipc_memory(tensor)
            return ref, ("cuda", storage.data_ptr()), tensor.data_ptr() - storage.data_ptr()
        raise RuntimeError(
            "kvxfer: this CPU KV cache is not in shared memory; it must be allocated inside "
            "the connector's get_mem_pool_context()"
        )

    def register_kv_caches(self, kv_caches: dict[str, Any], shape: CacheShape,
                           state: dict[str, Any] | None = None, state_kind: str = "",
                           groups: list[KVGroup] | None = None,
                           state_split: StateSplit | None = None) -> Registered:
        """``state``: the views of state layers (Mamba/GDN), registered after the KV layers;
        ``groups``: vLLM's KV cache groups, as ``kvxfer status`` shows them."""
        msg = registration_from_tensors(
            kv_caches,
            num_blocks=shape.num_blocks,
            block_size=shape.block_size,
            num_kv_heads=shape.num_kv_heads,
            local_kv_heads=shape.local_kv_heads,
            head_dim=shape.head_dim,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            mla=shape.mla,
            memory_of=self._memory_of,
            fused=shape.fused,
            model=shape.model,
            place=self.place,
            state=state,
            state_kind=state_kind,
            state_split=state_split,
        )
        if groups:
            msg = msgspec.structs.replace(msg, groups=groups)
        self.client = SidecarClient(self.settings.sidecar, ring=self.settings.engine_channel == "ring")
        self.client.ping(self.settings.sidecar_timeout_s)
        self.registered = self.client.register(msg, self.settings.sidecar_timeout_s)
        self._layers = LayerReports(tensor_of_layer(kv_caches), state=bool(state))
        self._registration = msg
        self._instance = self.registered.agent_name
        self.death.watch(self.pools)
        log.info("rank %d registered %d bytes with sidecar %s", self.tp_rank,
                 self.registered.bytes_registered, self.settings.sidecar)
        return self.registered

    def bind(self, recvs: dict[str, tuple[list[int], float]], holds: dict[str, float],
             failed: dict[str, list[int]] | None = None,
             refused: dict[str, list[tuple[int, int]]] | None = None,
             names: dict[str, str] | None = None, unheld: list[str] | None = None,
             extended: list[str] | None = None) -> None:
        """Record what the scheduler posted this step (from the connector metadata); ``failed``
        are loads it could not post at all (its sidecar did not take messages), ``refused``
        loads the sidecar refused to these (pp, tp) ranks (not registered with it yet);
        ``extended``: leases this step extends, held only while they are (one ended already gets
        no Released: it became a finished send vLLM asserts on at a restart; found by a review)."""
        self._recvs.update(recvs)
        ended = {x for x in extended or () if x not in self._holds}
        self._holds.update({lease: t for lease, t in holds.items() if lease not in ended})
        self._names.update(names or {})
        for lease in [x for x in unheld or () if x in self._holds]:  # (its Hold refused: no Released
            self._early.keep(Released(req_id=lease, reason="refused"), time.monotonic())  # will come)
        for req_id, blocks in (failed or {}).items():
            if req_id not in self._failed_now and req_id not in self._reported_failed:
                self._failed_now[req_id] = blocks
        me = (self.place.pp_rank, self.tp_rank)
        for req_id, ranks in (refused or {}).items():
            if me in ranks and req_id in self._recvs and req_id not in self._reported_failed:
                self._failed_now[req_id] = self._recvs.pop(req_id)[0]  # (nothing was posted for it)

    def get_transfer_results(self) -> TransferResults:
        out = TransferResults()
        if self.client is None:
            return out
        for req_id, blocks in self._failed_now.items():
            log.warning("KV load of request %s was not posted (sidecar not taking messages) or was "
                        "refused to this rank; recomputing", req_id)
            self._fail(out, req_id, blocks)
            self._reported_failed.add(req_id)
        self._failed_now.clear()
        if len(self._reported_failed) > EARLY_MAX:
            self._reported_failed.clear()
        now = time.monotonic()
        try:
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + self.settings.heartbeat_s
                self.client.heartbeat()
            ev = self.client.poll()
        except SEND_ERRORS as e:  # never into vLLM's step: the deadlines below still run
            log.warning("sidecar %s: %s", self.settings.sidecar, e)
            ev = Drained()
        if any(p.instance and p.instance != self._instance for p in ev.pongs):
            self._sidecar_restarted(out, ev.pongs)
            return out
        if ev.pongs:
            self._last_pong, self._overdue.supported = now, ev.pongs[-1].holds_check
        elif self._gone or (now - self._last_pong > self.settings.heartbeat_s and self.death.proven()):
            self._sidecar_gone(out, now)
        for reg in ev.registered:
            self.registered, self._instance = reg, reg.agent_name
            self._rejoin.answered()
            log.info("rank %d re-registered with sidecar %s", self.tp_rank, self.settings.sidecar)
        self._early.apply(lambda event: self._apply(out, event), now)
        for event in [*ev.done, *ev.failed, *ev.released]:  # (each admitted as it is applied)
            if self._overdue.admit(event, event.req_id in self._holds, now) and not self._apply(out, event):
                self._early.keep(event, now)
        for e in ev.errors:
            # (a RegisterKV's refusal names no request; a LayersDone of this rank before it is
            # registered is answered not_registered, never a registration)
            if not e.req_id and self._rejoin.outstanding and e.code != ErrorCode.NOT_REGISTERED:
                log.error("re-registration of rank %d refused by sidecar %s: [%s] %s; again in %.1fs",
                          self.tp_rank, self.settings.sidecar, e.code, e.message, self._rejoin.refused(now))
            else:
                log.warning("sidecar error for %r: [%s] %s", e.req_id, e.code, e.message)
        if not self._gone and now - self._last_pong <= 2 * self.settings.heartbeat_s:
            self._register_again(now)  # (only while it answers: the memory channel's connect waits)
        self._expire(out, time.monotonic())
        return out

    def _apply(self, out: TransferResults, event: Done | Failed | Released) -> bool:
        """Report one event of a bound request; False if its request is not bound (yet)."""
        if isinstance(event, Done):
            if self._recvs.pop(event.req_id, None) is None:
                return False
            out.finished_recving.add(event.req_id)
            self.stats.recv_ok += 1
            self.stats.bytes += event.nbytes
            self.stats.seconds += event.seconds
            self.stats.descriptors += event.descriptors
        elif isinstance(event, Failed):
            entry = self._recvs.pop(event.req_id, None)
            if entry is None:
                return False
            log.warning("KV load of request %s failed: [%s] %s", event.req_id, event.code, event.reason)
            self._fail(out, event.req_id, entry[0])
        else:
            if self._holds.pop(event.req_id, None) is None:
                return False
            out.finished_sending.add(self._names.pop(event.req_id, event.req_id))
            self.stats.released += 1
            self.stats.expired += event.reason == "expired"
        return True

    def _sidecar_restarted(self, out: TransferResults, pongs: list[Any]) -> None:
        """A new sidecar answers on our socket: everything the old one held is gone."""
        log.warning("sidecar %s restarted: failing %d loads, freeing %d holds, re-registering",
                    self.settings.sidecar, len(self._recvs), len(self._holds))
        # The Recv of a load failed here, or the Hold of blocks freed here, may still reach
        # the new sidecar (the scheduler sent it on its own socket, with no order against our
        # registration): read, it would overwrite blocks vLLM is recomputing; held, a decode
        # would read blocks that are another request's by then. The registration names them
        # (and those of an earlier restart still within their deadline), so the sidecar
        # refuses them until their last deadline has passed (kvxfer.abandoned).
        self._give_up(out, time.monotonic())
        self._early.clear()  # the old sidecar's answers
        self._gone = False
        self._last_pong = time.monotonic()
        # (do not treat the same restart twice; the registration is sent until answered)
        self._instance = next((p.instance for p in reversed(pongs) if p.instance), "")
        self._rejoin.restarted(time.monotonic())
        self._register_again(time.monotonic())
        self.death.watch(self.pools, STEP_CALL_S)

    def _register_again(self, now: float) -> None:
        """Send our registration to the restarted sidecar when ``Rejoin`` says so. Never blocks
        the engine step: the answer comes back through poll(); until it does, the sidecar
        refuses this rank's loads (not_registered) and vLLM recomputes."""
        if not self._rejoin.due(now):
            return
        assert self.client is not None
        try:
            if self.pools is not None and self.pools.pools:
                # the restarted sidecar gets our pools back (same ids) before the registration
                # that names them; local and quick (one packet per pool)
                self.pools.readopt(STEP_CALL_S)
            self.client.register_nowait(naming_abandoned(self._registration, self._abandoned, now))
        except KvxferError as e:
            log.error("re-registration of rank %d with sidecar %s not sent: %s; again in %.1fs",
                      self.tp_rank, self.settings.sidecar, e, self._rejoin.not_sent(now))
            return
        self._rejoin.sent()
        if self._rejoin.attempts > 1:
            log.warning("rank %d: re-registration with sidecar %s sent again (attempt %d)", self.tp_rank,
                        self.settings.sidecar, self._rejoin.attempts)
            self.death.watch(self.pools, STEP_CALL_S)  # (the first attempt's may have found no channel)

    def _sidecar_gone(self, out: TransferResults, now: float) -> None:
        """The sidecar process exited (its pidfd says so; ``connector.sidecar_death``): none of
        its reads can write any more, so its loads fail and its holds are freed now, and so
        are those bound until a successor answers (it would refuse them: they are named in
        the re-registration, as at a restart)."""
        if not self._gone:
            log.warning("sidecar %s exited: failing %d loads, freeing %d holds now", self.settings.sidecar,
                        len(self._recvs), len(self._holds))
            self._gone = True
        self._give_up(out, now)

    def _give_up(self, out: TransferResults, now: float) -> None:
        """Fail every load in flight and free every hold, remembering them (``_abandoned``)."""
        self._abandoned = {r: d for r, d in self._abandoned.items() if d > now}
        self._abandoned.update({r: d for r, (_, d) in self._recvs.items()})
        self._abandoned.update(self._holds)
        for req_id, (blocks, _) in list(self._recvs.items()):
            self._fail(out, req_id, blocks)
        self._recvs.clear()
        out.finished_sending.update(self._names.pop(r, r) for r in self._holds)
        self._holds.clear()

    def _fail(self, out: TransferResults, req_id: str, blocks: list[int]) -> None:
        out.finished_recving.add(req_id)
        out.failed_recving.add(req_id)
        self._invalid.update(blocks)
        self.stats.recv_failed += 1

    def _expire(self, out: TransferResults, now: float) -> None:
        silent = now - self._last_pong > self.settings.grace_s
        for req_id, (blocks, deadline) in list(self._recvs.items()):
            if now > deadline and (silent or now > deadline + self.settings.settle_s):
                del self._recvs[req_id]
                log.warning("no answer from the sidecar for request %s; failing its KV load", req_id)
                self._fail(out, req_id, blocks)
        for req_id in self._overdue.expire(self._holds, silent, now, self.client, self.place.engine_id):
            del self._holds[req_id]
            log.warning("no release for request %s past its lease (its sidecar silent, or a name no sidecar "
                        "takes); freeing it", req_id)
            out.finished_sending.add(self._names.pop(req_id, req_id))
            self.stats.expired += 1

    def save_layer(self, layer_name: str, streamed: list[str]) -> None:
        """Push mode: this step (``streamed``: its requests) computed ``layer_name`` ("": all); what
        is now ready is reported (``LayersDone``, ``LayerReports``). Never raises into vLLM."""
        n = self._layers.computed(layer_name, streamed)
        if self.client is not None and n is not None:
            report(self.client, streamed, n, self.place, self.tp_rank)

    def save_chunks(self, chunks: dict[str, int]) -> None:
        """Push mode: a chunk of these prompts is computed (lease -> its blocks now whole)."""
        for n, leases in by_value(chunks).items():
            if self.client is not None and n:
                report(self.client, leases, 0, self.place, self.tp_rank, blocks=n)

    def take_invalid_block_ids(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def shutdown(self) -> None:
        self.death.close()
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.allocator is not None:
            self.allocator.close()


def report(client: SidecarClient, leases: list[str], layers: int, place: Placement, tp_rank: int,
           blocks: int = 0) -> None:
    """Push mode: layers (or a chunk's blocks) computed (``LayersDone``); never raises into
    vLLM's forward (a report not sent: the decode reads at the end, or at its deadline fails)."""
    try:
        client.send(LayersDone(req_ids=leases, layers=layers, tp_rank=tp_rank, pp_rank=place.pp_rank,
                               engine_id=place.engine_id, blocks=blocks))
    except SEND_ERRORS as e:
        log.warning("computed layers of %s not reported to the sidecar: %s", leases[:4], e)


def by_value(d: dict[str, int]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for k, v in d.items():
        out.setdefault(v, []).append(k)
    return out
