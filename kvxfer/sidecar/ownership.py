"""Who may act for an engine, and whose memory a registration may name: pure rules over
facts the I/O shells verified (``kvxfer.sidecar.procfs``). No I/O here, ever.

Every connection to the engine socket and the memory channel is a ``Creds``: the pid and uid
the kernel reports for it (``SO_PEERCRED``), never what a message claims. A registered rank
remembers the ``Holder`` that registered it: those credentials and the process's ancestry (pid,
parent, grandparent, ...) as read from /proc when it registered.

A connection *speaks for* an engine (may ``Hold``, ``Release``, ``Recv`` or ``Unregister``
for it) when it runs as the uid of one of the engine's registered ranks and, with
``engine_ownership = process`` (the default), its pid is that rank's process or one of its
ancestors: vLLM's scheduler (the EngineCore process) is the parent of its multiproc workers
and the very process of a uniproc one. A pid this sidecar cannot see (0: another PID
namespace, a Kubernetes pod's other container) proves nothing either way, so uid equality
decides there; ``engine_ownership = uid`` makes uid equality decide always (executors whose
workers are not the scheduler's children: Ray). An engine with no registered rank has
nothing to protect: admission refuses what it is asked with its own reason.

Memory: a pool of the memory channel may back only a registration from the process that
created (or handed back) it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvxfer.errors import ErrorCode, RequestError

MODES = ("process", "uid")


@dataclass(frozen=True, slots=True)
class Creds:
    """A connection's process as the kernel reported it."""

    pid: int  # 0: not visible from this sidecar's PID namespace
    uid: int  # -1: unknown (a tcp:// engine socket: no credentials at all)
    start: str = ""  # its start time as /proc says ("": unknown): a recycled pid is another process

    def __str__(self) -> str:
        return f"pid {self.pid or '?'} uid {self.uid if self.uid >= 0 else '?'}"


UNKNOWN = Creds(0, -1)  # a connection with no credentials (tcp://): all such are alike


@dataclass(frozen=True, slots=True)
class Holder:
    """The process that registered a rank: its credentials and its ancestry, nearest first."""

    creds: Creds
    lineage: tuple[int, ...] = ()  # its pid, its parent's, ...; () when its pid is unknown
    starts: tuple[str, ...] = ()  # their start times, when known (the same order)

    def has_ancestor(self, who: Creds) -> bool:
        """``who`` is this process or one of its ancestors as they were at registration: the
        same pid, and the same start time where both are known (a process that got an exited
        ancestor's pid since is not it)."""
        for i, pid in enumerate(self.lineage):
            if pid == who.pid:
                start = self.starts[i] if i < len(self.starts) else ""
                return not (start and who.start and start != who.start)
        return False


def same_process(a: Creds, b: Creds) -> bool:
    """Whether two connections come from one process (as far as this sidecar can tell: two
    processes it cannot see are told apart by uid only)."""
    return a.uid == b.uid and a.pid == b.pid


def why_not(sender: Creds, holders: Sequence[Holder], mode: str = "process") -> str:
    """"" when ``sender`` speaks for the engine whose ranks ``holders`` registered; else what is
    missing, in words."""
    if not holders:
        return ""
    mine = [h for h in holders if h.creds.uid == sender.uid]
    if not mine:
        uids = ", ".join(sorted({str(h.creds.uid) for h in holders}))
        return f"it runs as uid {sender.uid}, the engine's ranks as uid {uids}"
    if mode == "uid" or sender.pid == 0:
        return ""
    if any(h.has_ancestor(sender) for h in mine):
        return ""
    if any(h.creds.pid == 0 for h in mine):
        return ""  # a rank in another PID namespace: its ancestry cannot be known, uid decides
    pids = ", ".join(str(h.creds.pid) for h in mine)
    return (f"its process {sender.pid} is neither a rank's process ({pids}) nor an ancestor of one "
            "(the scheduler of a vLLM engine is; with workers that are not its children, as "
            "under Ray, set engine_ownership = uid)")


def authorize(sender: Creds, holders: Sequence[Holder], mode: str, doing: str, engine: str,
              req_id: str = "") -> None:
    """Raise ``UNAUTHORIZED`` unless ``sender`` speaks for ``engine`` (see ``why_not``)."""
    why = why_not(sender, holders, mode)
    if why:
        raise RequestError(ErrorCode.UNAUTHORIZED, f"{doing} for engine {engine!r} refused: this "
                           f"connection ({sender}) does not speak for it: {why}", req_id)


def pool_refusal(pool: str, creator: Creds, user: Creds) -> str:
    """"" when ``user`` may register memory of a pool ``creator`` created (or handed back);
    else why not."""
    if same_process(creator, user):
        return ""
    return (f"pool {pool[:8]} belongs to another process ({creator}); this registration comes "
            f"from {user}: a rank may register only pools its own process created or handed back")
