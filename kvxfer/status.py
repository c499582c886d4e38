"""A point-in-time view of a sidecar, taken on its loop, for the control plane and the CLI.

The gRPC servicer builds its replies from a ``Snapshot`` and never reaches into the
sidecar's parts; the parts keep their state to themselves.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from kvxfer.observe import Totals
from kvxfer.sidecar.peer_book import Peer
from kvxfer.sidecar.registry import RankEntry


@dataclass(frozen=True)
class LeaseView:
    req_id: str
    engine: str
    num_blocks: int
    age_s: float
    expires_in_s: float
    reads_seen: int
    reads_expected: int


@dataclass(frozen=True)
class TransferView:
    req_id: str
    tp_rank: int
    peer: str
    state: str  # handshake | reading | verifying
    num_blocks: int
    nbytes: int
    age_s: float
    deadline_in_s: float


@dataclass(frozen=True)
class Snapshot:
    engine_id: str
    role: str
    version: str
    nixl_backends: list[str]
    handshake_endpoint: str
    agent_name: str
    protocol_version: int
    ucx_error_mode: str
    uptime_s: float
    ready: bool
    draining: bool
    insecure: bool = False
    authenticated: bool = False
    encrypted: bool = False
    host_key: bool = False
    ranks: list[RankEntry] = field(default_factory=list)
    peers: list[Peer] = field(default_factory=list)
    leases: list[LeaseView] = field(default_factory=list)
    transfers: list[TransferView] = field(default_factory=list)
    totals: Totals = field(default_factory=Totals)

    def transfers_of(self, req_id: str = "", state: str = "") -> list[TransferView]:
        return [t for t in self.transfers
                if (not req_id or t.req_id == req_id) and (not state or t.state == state)]


def copies(items: list) -> list:  # type: ignore[type-arg]
    """Shallow copies: a snapshot must not change under its reader."""
    return [copy.copy(x) for x in items]
