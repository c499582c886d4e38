"""The peer sidecars this one reads from, and the agents that proved the shared secret here.

``PeerBook`` is the only place that changes a ``Peer`` record: the peer client puts what a
handshake returned, the receiver reports how reads went (``read_done``, ``read_failed``,
``mark_stale``), the verifier asks whether to sample (``first_check``). Everyone else reads
copies (``status.copies``). ``Authenticated`` is the bounded set of agents that completed
an authenticated handshake with this sidecar's listener; the holds ask it before a peer may
touch a lease.

Pure bookkeeping: no sockets, no asyncio.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import RankInfo


@dataclass
class Peer:
    endpoint: str  # host:port of its handshake listener
    engine_id: str
    agent_name: str
    ranks: dict[tuple[str, int, int], RankInfo]  # by (engine, pp, tp): RankInfo.key
    handshake_s: float
    connected_unix: float
    reads: int = 0
    bytes: int = 0
    failures: int = 0
    verified: bool = False  # a read from it was integrity-checked (--verify-sample)
    generation: str = ""  # its registrations when it answered (Welcome.generation)
    stale: bool = False  # handshake again before the next read (a read failed, ranks missing)
    staging_bytes: int = 0  # its staging arena (Welcome.staging_bytes): 0, it stages nothing
    lease_words: tuple[int, int] = (0, 0)  # (address, slots) of its lease words: (0, 0), none
    layer_streams: bool = False  # it answers LayerWatch (push mode; Welcome.layer_streams)
    grouped_streams: bool = False  # ... naming a request's blocks per KV cache group
    chunk_streams: bool = False  # ... answering ChunkWatch (prompts computed in chunks)
    reader_engines: bool = False  # it tells readers apart by decode engine (Welcome.reader_engines)

    def outdated_by(self, generation: str) -> bool:
        """Both generations known and different: this description came from another
        generation of the peer's registrations than ``generation``."""
        return bool(generation) and bool(self.generation) and self.generation != generation

    def engines(self) -> list[str]:
        return sorted({k[0] for k in self.ranks})

    def engine_ranks(self, engine: str) -> dict[tuple[int, int], RankInfo]:
        """(pp, tp) -> rank of one engine this peer serves."""
        return {(pp, tp): info for (e, pp, tp), info in self.ranks.items() if e == engine}

    def resolve_engine(self, wanted: str) -> str:
        """The engine a request names: an engine id this peer serves; with its sidecar's own
        id (older kv_transfer_params) or none at all, the one engine if it serves only one."""
        engines = self.engines()
        if wanted in engines:
            return wanted
        if (not wanted or wanted == self.engine_id) and len(engines) == 1:
            return engines[0]
        raise RequestError(ErrorCode.UNKNOWN_PEER, f"{self.endpoint} serves engines {engines}, not "
                           f"{wanted!r}")


class PeerBook:
    def __init__(self) -> None:
        self._by_endpoint: dict[str, Peer] = {}

    def __len__(self) -> int:
        return len(self._by_endpoint)

    def values(self) -> list[Peer]:
        return list(self._by_endpoint.values())

    def items(self) -> list[tuple[str, Peer]]:
        return list(self._by_endpoint.items())

    def get(self, endpoint: str) -> Peer | None:
        return self._by_endpoint.get(endpoint)

    def by_agent(self, agent: str) -> Peer | None:
        return next((p for p in self._by_endpoint.values() if p.agent_name == agent), None)

    def usable(self, endpoint: str, generation: str = "") -> Peer | None:
        """The peer at ``endpoint`` if it is handshaked, not stale and (when ``generation``
        is given) of that generation."""
        peer = self._by_endpoint.get(endpoint)
        if peer is None or peer.stale or peer.outdated_by(generation):
            return None
        return peer

    def put(self, peer: Peer) -> None:
        """A handshake's result; the same agent keeps its counters and its verified mark."""
        old = self._by_endpoint.get(peer.endpoint)
        if old is not None and old.agent_name == peer.agent_name:
            peer.reads, peer.bytes, peer.failures = old.reads, old.bytes, old.failures
            peer.verified = old.verified
        self._by_endpoint[peer.endpoint] = peer

    def drop(self, agent: str) -> list[str]:
        """Forget every record of this agent; the endpoints it had."""
        gone = [k for k, p in self._by_endpoint.items() if p.agent_name == agent]
        for key in gone:
            del self._by_endpoint[key]
        return gone

    # ------------------------------------------------------------------ what reads tell

    @staticmethod
    def mark_stale(peer: Peer) -> None:
        """Handshake again before the next read (ranks missing, registrations changed)."""
        peer.stale = True

    @staticmethod
    def read_done(peer: Peer, nbytes: int) -> None:
        peer.reads += 1
        peer.bytes += nbytes

    @staticmethod
    def read_failed(peer: Peer) -> None:
        """Any failed read: counted, and the next one handshakes again first."""
        peer.failures += 1
        peer.stale = True

    @staticmethod
    def first_check(peer: Peer) -> bool:
        """Whether no read from this peer was integrity-checked yet; from now on one was."""
        first = not peer.verified
        peer.verified = True
        return first


class Authenticated:
    """Agents that completed an authenticated handshake here (the last used last; bounded).
    Without a secret nobody is authenticated, so anyone may."""

    LIMIT = 4096

    def __init__(self, secret: bytes) -> None:
        self._required = bool(secret)
        self._agents: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, agent: str) -> None:
        self._agents[agent] = None
        self._agents.move_to_end(agent)
        while len(self._agents) > self.LIMIT:
            self._agents.popitem(last=False)

    def __call__(self, agent: str) -> bool:
        if not self._required:
            return True
        if agent not in self._agents:
            return False
        self._agents.move_to_end(agent)  # (by use, not by handshake: 4,096 newer agents, restarted
        return True  # decodes or a script, pushed out a decode in use; found by a review)
