"""The engines of this sidecar: their registrations, and what happens when one dies.

A worker registers its rank's KV memory (``RegisterKV``: validated, mapped and registered
with NIXL through the registry) and gets ``Registered`` with this sidecar's handshake
endpoint; what its engine gave up on at a restart is refused from then on
(``kvxfer.abandoned``). An engine process that died (its pid gone, or its memory channel
closed: the only notice that works across PID namespaces) has its receives failed; its
held blocks stay readable until their leases end (the rank is kept as an *orphan*), then
its memory is freed.

Each registration records the registering process as the kernel reported it
(``EngineServer.sender``) with its ancestry: who speaks for the engine from then on
(``kvxfer.sidecar.ownership``), and whose memory the registration may name.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvxfer.abandoned import Abandoned
from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import Event, Observer
from kvxfer.protocol import CudaIpcMemory, Error, Registered, RegisterKV, ShmMemory, Unregister
from kvxfer.sidecar.engine_server import EngineServer
from kvxfer.sidecar.holds import Holds
from kvxfer.sidecar.lifecycle import Signal
from kvxfer.sidecar.mapping import check_shm_files
from kvxfer.sidecar.ownership import Creds, authorize
from kvxfer.sidecar.pool_server import PoolServer
from kvxfer.sidecar.procfs import holder
from kvxfer.sidecar.receiver import Receiver
from kvxfer.sidecar.registry import RankEntry, RankRegistry
from kvxfer.sidecar.validate import validate_registration
from kvxfer.topology import Incompatible, check_layout

log = logging.getLogger("kvxfer.sidecar")


# What a registration whose memory channel closed while it was processed is answered: a code
# the worker takes for its registration's refusal (it registers again), not ``not_registered``
CHANNEL_CLOSED = ErrorCode.MEMORY_MAP_FAILED

@dataclass
class Advertised:
    """Where peers reach this sidecar's handshake listener (the port is known once bound)."""

    host: str
    port: int
    agent_name: str


class Engines:
    def __init__(self, *, config: Config, registry: RankRegistry, receiver: Receiver, holds: Holds,
                 pools: PoolServer | None, abandoned: Abandoned, server: EngineServer, observer: Observer,
                 advertised: Advertised) -> None:
        self.config = config
        self.registry = registry
        self.receiver = receiver
        self.holds = holds
        self.pools = pools
        self.abandoned = abandoned
        self.server = server
        self.observer = observer
        self.advertised = advertised
        self.changed = Signal()  # a rank registered, removed or orphaned

    # ---------------------------------------------------------------- registrations

    async def register(self, ident: bytes, msg: RegisterKV, sender: Creds) -> None:
        """Register a rank (``RankRegistry``: a failed re-registration unregisters the key,
        whose old memory is already gone, and moves the generation). ``sender``: the sending
        process, as the kernel reported it."""
        try:
            self._admit(msg, sender)
            key = self.registry.key_of(msg)
            if self.registry.find(key.engine, key.pp, key.tp) is not None:
                self.registry.check(msg, ident, holder(sender))  # (refused before any lease ends)
                ended = self.holds.end_engine(key.engine)
                if ended:
                    log.warning("%s registers new memory: %d leases on its old memory ended", key, ended)
                # Its receives were asked for into the old memory: none may be read into the new
                # one (a receive still handshaking, waiting for a staged copy or following a push
                # would plan against the new registration: found by a review).
                why = "the rank registered new memory during the receive"
                failed = await self.receiver.cancel("", ErrorCode.NOT_REGISTERED, why, rank=key)
                if failed:
                    log.warning("%s registers new memory: %d receives into its old memory failed",
                                key, failed)
            entry, _replaced = await self.registry.register(msg, ident, holder(sender))
            self._abandon(msg)  # (only a registration that took: a refused one speaks for no engine)
        except Exception as e:
            if not isinstance(e, RequestError):
                log.exception("registration failed")
                e = RequestError(ErrorCode.MEMORY_MAP_FAILED, repr(e))
            log.warning("registration of %s refused: [%s] %s", self.registry.key_of(msg), e.code, e.reason)
            self.server.send(ident, Error(code=e.code, message=e.reason))
            self.changed.emit()  # (a failed re-registration unregistered the key)
            return
        if entry.pools and self.pools is not None and not self._pools_held(entry):
            # (its memory channel closed while it registered: pools_closed found no entry then)
            why = "engine process exited while it registered (its memory channel closed)"
            await self.gone(entry, why)
            # (answered: a worker that lives on, its channel closed under it, registers again
            # rather than wait for an answer for ever; a review. Not ``not_registered``: a
            # worker takes that for a refusal of another message, never of its registration)
            self.server.send(ident, Error(code=CHANNEL_CLOSED, message=why))
            return
        nbytes = sum(m.size for m in msg.memory)
        log.info("registered %s: %d bytes", entry.key, nbytes)
        self._note_memory_kind(entry, msg)
        a = self.advertised
        self.server.send(ident, Registered(
            tp_rank=entry.key.tp, engine_id=entry.key.engine, agent_name=a.agent_name,
            bytes_registered=nbytes, handshake_host=a.host, handshake_port=a.port, pp_rank=entry.key.pp,
            dp_rank=entry.key.dp))
        self.changed.emit()

    def _admit(self, msg: RegisterKV, sender: Creds) -> None:
        validate_registration(msg)
        check_shm_files(msg, self.config.shm_dir_list, sender.uid)
        try:
            check_layout(msg.layout)
        except Incompatible as e:
            raise RequestError(ErrorCode.INVALID_LAYOUT, str(e)) from None

    def _abandon(self, msg: RegisterKV) -> None:
        """Requests the registering engine gave up on (a worker that outlived its sidecar):
        refused if they arrive, for as long as they could (never longer than a lease or a
        receive may live, whatever the message asks)."""
        if msg.abandoned:
            engine = self.registry.engine_of(msg.engine_id)
            cap = max(self.config.max_lease_s, self.config.transfer_timeout_s) + 60.0
            for_s = min(msg.abandoned_s or self.config.transfer_timeout_s + 60.0, cap)
            self.abandoned.add(engine, list(msg.abandoned), for_s)
            log.info("%s: %d requests its engine gave up on (loads failed, holds freed) are refused "
                     "for %.0fs if they arrive", engine, len(msg.abandoned), for_s)

    @staticmethod
    def _note_memory_kind(entry: RankEntry, msg: RegisterKV) -> None:
        if any(isinstance(m, ShmMemory) for m in msg.memory):
            log.warning("%s registered engine-owned files (%s): the legacy path; a SIGKILLed engine "
                        "leaves them in RAM while this sidecar is down. Allocate the KV cache from "
                        "the memory channel instead (the connector's get_mem_pool_context)", entry.key,
                        ", ".join(m.path for m in msg.memory if isinstance(m, ShmMemory)))
        elif any(isinstance(m, CudaIpcMemory) for m in msg.memory):
            log.info("%s registered engine-owned VRAM over CUDA IPC (UCX cannot re-export it; "
                     "gpu_memory 'vmm' gives it sidecar-owned VMM pools instead)", entry.key)

    async def unregister(self, ident: bytes, msg: Unregister, sender: Creds) -> None:
        entry = self.registry.find(msg.engine_id, msg.pp_rank, msg.tp_rank)
        if entry is None or entry.owner != ident:
            raise RequestError(ErrorCode.NOT_REGISTERED, f"rank pp{msg.pp_rank}/tp{msg.tp_rank} of engine "
                               f"{self.registry.engine_of(msg.engine_id)!r} is not registered by "
                               "this connection")
        # (an identity is the client's choice, and ROUTER_HANDOVER hands it to the last to claim it)
        authorize(sender, [entry.holder], self.config.engine_ownership, "unregister", entry.key.engine)
        try:
            # Its receives and the engine's leases go with its memory: a receive still handshaking,
            # waiting for a staged copy or following a push would plan against the next
            # registration of the key, which finds no entry to cancel them for (a review)
            why = "the rank unregistered during the receive"
            await self.receiver.cancel("", ErrorCode.NOT_REGISTERED, why, rank=entry.key)
            if ended := self.holds.end_engine(entry.key.engine):
                log.warning("%s unregistered: %d leases on its memory ended", entry.key, ended)
            await self.registry.remove(entry.key)
        finally:
            self.changed.emit()

    # ---------------------------------------------------------------- deaths

    async def check(self) -> None:
        """Engine processes that died (their receives fail; their held blocks stay readable
        until those leases end), and orphaned ranks nobody holds any more (freed)."""
        for entry in self.registry.dead():
            await self.gone(entry, f"engine process {entry.pid} exited")
        for entry in self.registry.orphans():
            if not self.holds.engine_holds(entry.key.engine, made_by=entry.orphaned_at):
                log.warning("%s: the last lease of its dead engine ended; freeing its memory", entry.key)
                await self.registry.remove(entry.key, unlink=True, only=entry)
                self.changed.emit()

    async def pools_closed(self, pools: set[str], pid: int) -> None:
        """An engine's memory channel closed with pools in it: the engine is gone, whatever
        PID namespace it ran in (its pid may mean nothing here)."""
        for entry in self.registry.in_pools(pools):
            if self._pools_held(entry):
                continue  # handed back on a new connection meanwhile (a worker that reconnected)
            await self.gone(entry, f"engine process {pid} exited (its memory channel closed; "
                                   "exited or killed)")

    def _pools_held(self, entry: RankEntry) -> bool:
        """Every pool of the rank's is held by a memory channel (its engine's, open)."""
        return self.pools is not None and all(self.pools.holds(p) for p in entry.pools)

    async def gone(self, entry: RankEntry, reason: str) -> None:
        try:
            await self._gone(entry, reason)
        finally:
            self.changed.emit()

    async def _gone(self, entry: RankEntry, reason: str) -> None:
        if self.registry.get(entry.key) is not entry:
            return  # (found before an await; its key has another registration now: not this one's)
        await self.receiver.cancel("", ErrorCode.NOT_REGISTERED, reason, rank=entry.key)
        held = self.holds.engine_holds(entry.key.engine)
        if held:
            # A finished prefill's KV is still the decode's to read: keep the rank's mapping
            # and NIXL registration (the memory lives while we map it) until its leases end.
            log.warning("%s: %s; %d held requests stay readable until read or expired, then its "
                        "memory is freed", entry.key, reason, held)
            entry.orphaned, entry.orphaned_at = True, time.monotonic()
        else:
            log.warning("%s: %s; dropping its registration and receives", entry.key, reason)
            await self.registry.remove(entry.key, unlink=True, only=entry)  # (it cannot remove its files)
        self.observer.emit(Event("engine_gone", reason=f"{entry.key}: {reason}", tp_rank=entry.key.tp))
