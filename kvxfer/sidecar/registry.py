"""The registered ranks of a sidecar: one table, keyed by (engine, DP rank, PP stage, TP rank).

A sidecar serves every engine process on its node: the TP workers of one engine, the DP
ranks of a data-parallel deployment (vLLM names them ``<engine_id>_dp<k>``), the stages of
a pipeline. Each registered rank is one ``RankEntry`` (what peers see, which connection
registered it, its process, its shared-memory files) and every change goes through
``register`` / ``remove``, which also map or unmap the memory on the NIXL thread: the
loop's view and the NIXL thread's handle table can never disagree (they did when four
hand-synced maps were updated one by one).

Ownership: a connection may replace or remove only what it registered. A registration of
a key that another *live* process holds is refused (``rank_taken``): two DP engines that
were given the same engine id would otherwise read each other's KV. A restarted engine
(its old process is gone, or the same process reconnected) replaces its ranks. "The same
process" is the kernel's word (``RankEntry.holder``: the registering connection's verified
pid and uid), not the pid a registration claims: a registration claiming a live rank's pid
from another process is refused too.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import msgspec

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import KVGroup, KVLayout, PoolMemory, RankInfo, RegisterKV, ShmMemory
from kvxfer.sidecar.ownership import UNKNOWN, Creds, Holder, same_process

log = logging.getLogger("kvxfer.registry")  # (the name operators filter on)


class RankKey(NamedTuple):
    engine: str
    dp: int
    pp: int
    tp: int

    def __str__(self) -> str:
        return f"{self.engine}/dp{self.dp}/pp{self.pp}/tp{self.tp}"


@dataclass
class RankEntry:
    key: RankKey
    info: RankInfo  # what peers see: absolute region addresses, engine id, DP rank
    owner: bytes  # the engine connection that registered it
    pid: int
    start: str | None  # the process's /proc start time; None: not tracked (pid 0)
    files: list[str] = field(default_factory=list)  # shm files of its KV cache
    pools: list[str] = field(default_factory=list)  # memory-channel pools of its KV cache
    registered_unix: float = 0.0
    # Its engine died while leases still held blocks in it: kept (mapped, registered with
    # NIXL) so those decodes still read them, removed when the last of those leases ends
    # (``orphaned_at``, monotonic: leases the engine id holds that were made later are a
    # replacement's, in its own memory, and keep nothing here alive).
    orphaned: bool = False
    orphaned_at: float = 0.0
    groups: list[KVGroup] = field(default_factory=list)  # vLLM's KV cache groups (hybrid models)
    # the registering connection's process as the kernel reported it, with its ancestry (who
    # speaks for this rank's engine: kvxfer.sidecar.ownership)
    holder: Holder = field(default_factory=lambda: Holder(UNKNOWN))

    @property
    def layout(self) -> KVLayout:
        return self.info.layout

    @property
    def nbytes(self) -> int:
        return self.info.block_bytes() * self.layout.num_blocks


def process_start_time(pid: int) -> str | None:
    """A process's start time from /proc (None: no pid given; "": not visible from here, e.g.
    another pid namespace), so a recycled pid is not mistaken for the engine."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def watched_pid(msg_pid: int, creds: Creds) -> int:
    """The pid whose life is a rank's: the kernel's for a connection with credentials (0
    there: another PID namespace, whose pids mean nothing here, so not watched by pid: its
    memory channel closing says it died), the message's only where there are none (tcp://).
    A pid a message carries names some other process in another PID namespace."""
    return creds.pid if creds.uid >= 0 else msg_pid


class MemoryPort(Protocol):
    """Where a rank's memory is registered (the NIXL port)."""

    async def register(self, key: RankKey, msg: RegisterKV, holder: Holder) -> RankInfo: ...

    async def unregister(self, key: RankKey) -> bool: ...


class RankRegistry:
    """Registered ranks; their memory is registered with NIXL through ``memory``."""

    def __init__(self, default_engine: str, memory: MemoryPort) -> None:
        self.default_engine = default_engine
        self._memory = memory
        self._entries: dict[RankKey, RankEntry] = {}
        self._registering: collections.Counter[RankKey] = collections.Counter()  # new memory in flight
        self.changes = 0  # bumped when a registration is replaced or removed (the generation)

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def generation(self, instance: str) -> str:
        """The sidecar's registration generation: changes when the sidecar restarts (a new
        ``instance``: its agent name) or a registration is replaced or removed (its memory may
        be gone). Held blocks are only valid in their generation. A rank registered for the
        first time does not change it."""
        return f"{instance}/{self.changes}"

    def entries(self) -> list[RankEntry]:
        return [self._entries[k] for k in sorted(self._entries)]

    def engine_of(self, engine_id: str) -> str:
        """The engine a message names ("": this sidecar's own)."""
        return engine_id or self.default_engine

    def get(self, key: RankKey) -> RankEntry | None:
        return self._entries.get(key)

    def find(self, engine: str, pp: int, tp: int) -> RankEntry | None:
        engine = self.engine_of(engine)
        for key, entry in self._entries.items():
            if key.engine == engine and key.pp == pp and key.tp == tp:
                return entry
        return None

    def of_engine(self, engine: str) -> list[RankEntry]:
        engine = self.engine_of(engine)
        return [e for e in self.entries() if e.key.engine == engine]

    def engines(self) -> list[str]:
        return sorted({k.engine for k in self._entries})

    def holders(self, engine: str) -> list[Holder]:
        """The processes that registered ``engine``'s ranks (orphans included: their leases
        are still that engine's)."""
        engine = self.engine_of(engine)
        return [e.holder for e in self._entries.values() if e.key.engine == engine]

    def owners(self, engine: str) -> set[bytes]:
        return {e.owner for e in self.of_engine(engine)}

    def infos(self) -> list[RankInfo]:
        return [e.info for e in self.entries()]

    def first_layout(self) -> KVLayout | None:
        entries = self.entries()
        return entries[0].layout if entries else None

    def describe(self) -> str:
        return ", ".join(str(k) for k in sorted(self._entries)) or "none"

    # ------------------------------------------------------------------ changes

    def key_of(self, msg: RegisterKV) -> RankKey:
        return RankKey(self.engine_of(msg.engine_id), msg.dp_rank, msg.layout.pp_rank, msg.layout.tp_rank)

    def check(self, msg: RegisterKV, owner: bytes, holder: Holder | None = None) -> RankKey:
        """Refuse a registration that conflicts with what is registered (RequestError)."""
        key = self.key_of(msg)
        lay = msg.layout
        for other in self._entries.values():
            o = other.layout
            if other.key.engine == key.engine and other.key.dp != key.dp:
                raise RequestError(ErrorCode.INVALID_LAYOUT, f"engine {key.engine!r} is registered as DP "
                                   f"rank {other.key.dp}, this registration says {key.dp}")
            if (other.key.engine, other.key.pp, other.key.tp) == (key.engine, key.pp, key.tp):
                continue
            if o.model_signature() != lay.model_signature():
                raise RequestError(ErrorCode.INVALID_LAYOUT, f"model layout differs from rank {other.key}'s: "
                                   f"{o.model_signature()} vs {lay.model_signature()}")
            if other.key.engine == key.engine and (o.tp_size, o.pp_size) != (lay.tp_size, lay.pp_size):
                raise RequestError(ErrorCode.INVALID_LAYOUT, f"engine {key.engine!r} has tp_size {o.tp_size} "
                                   f"pp_size {o.pp_size}; this rank says {lay.tp_size}, {lay.pp_size}")
        old = self.find(key.engine, key.pp, key.tp)
        creds = (holder or Holder(UNKNOWN)).creds
        # (the same connection identity proves nothing where the kernel names the process: an
        # identity is the client's choice; over tcp:// it is all there is)
        if old is not None and (old.owner != owner or creds.uid >= 0) and self._alive(old):
            if old.pid != (watched_pid(msg.pid, creds) or -1):
                raise RequestError(ErrorCode.RANK_TAKEN, f"rank {key} is registered by live process "
                                   f"{old.pid}; two engines with the same engine id and DP rank? (give "
                                   "each its own)")
            if not same_process(old.holder.creds, creds):
                raise RequestError(ErrorCode.RANK_TAKEN, f"rank {key} is registered by live process "
                                   f"{old.pid} ({old.holder.creds}); this registration claims its pid "
                                   f"but comes from {creds}")
        return key

    @staticmethod
    def _alive(entry: RankEntry) -> bool:
        """The registering process still runs (unknown: treated as gone, the newer one wins)."""
        if not entry.start:
            return False
        return process_start_time(entry.pid) == entry.start

    async def register(self, msg: RegisterKV, owner: bytes,
                       holder: Holder | None = None) -> tuple[RankEntry, bool]:
        """Map and register a rank's memory (replacing the key's old registration); returns
        the entry and whether it replaced one. On failure the key's old registration is gone
        too (its memory was dropped first): the key is unregistered and the generation moves.
        ``holder``: the registering connection's process (None: unknown, as over tcp://)."""
        holder = holder or Holder(UNKNOWN)
        key = self.check(msg, owner, holder)
        old = self.find(key.engine, key.pp, key.tp)
        if old is not None and old.key != key:
            await self._drop(old)
        self._registering[key] += 1  # (a dead or orphaned entry of this key is not freed meanwhile)
        try:
            info = await self._memory.register(key, msg, holder)
        except BaseException:
            if self._entries.pop(key, None) is not None:
                self.changes += 1
            raise
        finally:
            self._registering[key] -= 1
            if not self._registering[key]:
                del self._registering[key]
        info = msgspec.structs.replace(info, engine_id=key.engine, dp_rank=key.dp)
        replaced = key in self._entries
        if replaced:
            self.changes += 1  # its old memory is gone: reads planned against it are stale
        pid = watched_pid(msg.pid, holder.creds)
        # (the start time read when the connection came, if it is this pid's: a process that
        # died while it registered still shows as dead)
        start = (holder.creds.start if holder.creds.pid == pid and holder.creds.start
                 else process_start_time(pid))
        entry = RankEntry(key=key, info=info, owner=owner, pid=pid, start=start,
                          files=[m.path for m in msg.memory if isinstance(m, ShmMemory)],
                          pools=[m.pool for m in msg.memory if isinstance(m, PoolMemory)],
                          registered_unix=time.time(), groups=list(msg.groups or ()), holder=holder)
        self._entries[key] = entry
        return entry, replaced

    async def remove(self, key: RankKey, *, unlink: bool = False,
                     only: RankEntry | None = None) -> RankEntry | None:
        """Unregister a rank (its in-flight reads fail on the NIXL thread); ``unlink``: also
        remove its shared-memory files (its engine died and cannot). ``only``: if that is
        still the key's registration and no new one is being made (a dead engine's, found
        before an await: its replacement's must not go with it)."""
        entry = self._entries.get(key)
        if entry is None or (only is not None and (entry is not only or key in self._registering)):
            return None
        await self._drop(entry)
        if unlink:
            for path in entry.files:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return entry

    async def _drop(self, entry: RankEntry) -> None:
        self._entries.pop(entry.key, None)
        self.changes += 1
        await self._memory.unregister(entry.key)

    def dead(self) -> list[RankEntry]:
        """Ranks whose registering process exited (a recycled pid does not count as alive),
        not already kept as orphans."""
        return [e for e in self.entries() if not e.orphaned and e.key not in self._registering
                and e.start is not None and process_start_time(e.pid) != e.start]

    def in_pools(self, pools: set[str]) -> list[RankEntry]:
        """Live ranks whose KV cache is in any of ``pools`` (their engine's channel closed)."""
        return [e for e in self.entries() if not e.orphaned and pools.intersection(e.pools)]

    def orphans(self) -> list[RankEntry]:
        return [e for e in self.entries() if e.orphaned and e.key not in self._registering]
