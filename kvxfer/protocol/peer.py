"""The sidecar <-> peer sidecar conversation: the handshake socket (ZMQ over TCP;
``HandshakeRequest`` / ``HandshakeReply``, a ``Welcome`` followed by one extra frame holding
the NIXL agent metadata) and the NIXL notification a reader sends (``ReadNotice``).

No I/O; never imports NIXL, ZMQ, torch or vLLM (see ``kvxfer.protocol``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from kvxfer.protocol.base import BlockIds, EngineId, GroupBlockIds, NonNeg, Positive, ReqId, Token, _Msg
from kvxfer.protocol.layout import KVLayout

# --------------------------------------------------------------------------- handshake


class Hello(_Msg, tag="hello"):
    version: int
    compat_hash: str
    engine_id: str
    agent_name: str
    nonce: str = ""  # with a shared secret: random, never reused
    ts: float = 0.0  # sender's wall clock (replay window)
    mac: str = ""  # HMAC-SHA256 of the fields above (kvxfer.auth)
    model: str = ""  # the dialer's KVLayout.model, so a refusal can name both models
    challenge: str = ""  # with a shared secret: the listener's Challenge.nonce this answers
    target: str = ""  # with a shared secret: the listener's agent name (from its Challenge)
    compat_tp: str = ""  # kvxfer.protocol.compat_tp_hash of the dialer's layout ("": none)


class DigestItem(_Msg, tag="ditem"):
    """Blocks of one sub-position and the byte runs ([offset, length]) read from each."""

    blocks: BlockIds
    runs: list[list[NonNeg]]


class DigestRank(_Msg, tag="drank"):
    rank: NonNeg  # tp rank
    items: list[DigestItem]
    pp_rank: NonNeg = 0
    region0: NonNeg = 0  # the regions digested: [region0, region0 + num_regions)
    num_regions: NonNeg = 0  # 0: all of the rank's regions


class DigestRequest(_Msg, tag="digest"):
    """Decode sidecar -> prefill sidecar, on the handshake socket: the digest of the bytes
    a receive read from these held blocks (``kvxfer.integrity``), one per remote rank."""

    req_id: ReqId  # the prefill side's request id: its blocks must still be held
    ranks: list[DigestRank]
    agent_name: str = ""  # the asking sidecar
    mac: str = ""  # with a shared secret: HMAC of the request (kvxfer.auth)
    engine_id: EngineId = ""  # the prefill engine holding the blocks
    token: Token = ""  # the lease's capability (Hold.token)


class LeaseRenew(_Msg, tag="renew"):
    """Decode sidecar -> prefill sidecar, on the handshake socket: keep these held requests'
    leases for ``extend_s`` more seconds (0: each lease's own duration). Sent for requests
    still waiting on the decode (``KeepAlive``) and as the *claim* of every read, in parallel
    with it: a read whose claim comes back "not held" fails instead of delivering bytes of
    blocks the prefill may already have reused."""

    seq: NonNeg
    engine_id: EngineId
    req_ids: Annotated[list[ReqId], Meta(max_length=4096)]
    extend_s: Annotated[float, Meta(ge=0, le=86400)] = 0.0
    agent_name: str = ""  # the asking sidecar
    mac: str = ""  # with a shared secret: HMAC of the request (kvxfer.auth)
    tokens: Annotated[list[Token], Meta(max_length=4096)] = []  # per req_ids: the leases' capabilities


class StageRank(_Msg, tag="srank"):
    """One remote rank's part of a staged read: byte runs of its held blocks."""

    rank: NonNeg  # tp rank
    # int64 little-endian [address, length] pairs (the prefill's addresses, from its
    # Welcome), in the order they go into the slot (kvxfer.sidecar.staging)
    runs: bytes
    pp_rank: NonNeg = 0


class StageRequest(_Msg, tag="stage"):
    """Decode sidecar -> prefill sidecar, on the handshake socket (``PeerLink``): copy these
    runs of blocks held for ``req_id``, rank after rank, into a slot of your staging arena,
    and keep the slot until my final ``ReadNotice`` for each of ``readers`` (or for
    ``extend_s``); answered by ``Staged`` once copied. It is also the reads' *claim*: the
    copy is taken while the lease holds the blocks, and the lease is extended by
    ``extend_s`` like a ``LeaseRenew``. One request serves every local rank of the asking
    sidecar that receives ``req_id`` at once (a round trip and a copy per request, not per
    rank)."""

    seq: NonNeg
    engine_id: EngineId  # the prefill engine holding the blocks
    req_id: ReqId  # the prefill side's request id
    ranks: Annotated[list[StageRank], Meta(max_length=4096)]
    nbytes: Positive  # the runs' total: the slot's size
    # the receives of the asking sidecar it serves ("pp/tp" of each, their bytes in this
    # order): the slot is kept until every one's final ReadNotice
    readers: Annotated[list[Annotated[str, Meta(max_length=64)]], Meta(max_length=4096)]
    extend_s: Annotated[float, Meta(ge=0, le=86400)] = 0.0
    agent_name: str = ""  # the asking sidecar
    mac: str = ""  # with a shared secret: HMAC of the request (kvxfer.auth)
    token: Token = ""  # the lease's capability (Hold.token)


class LayerWatch(_Msg, tag="watch"):
    """Decode sidecar -> prefill sidecar, push mode (``kvxfer.sidecar.layer_stream``): answer
    with ``LayersAt`` as soon as more than ``have`` layers of this held request are computed
    (or its lease ended, or after ``wait_s``). It renews the lease like a ``LeaseRenew`` of
    ``extend_s``. ``token``: the lease's capability (the transfer id both engines were given)."""

    seq: NonNeg
    engine_id: EngineId  # the prefill engine ("": the only one holding req_id)
    req_id: ReqId  # the transfer id
    have: NonNeg  # layers this reader has seen computed (0 at first)
    token: Token
    wait_s: Annotated[float, Meta(ge=0, le=60)] = 1.0
    extend_s: Annotated[float, Meta(ge=0, le=86400)] = 0.0
    agent_name: str = ""  # the asking sidecar
    mac: str = ""  # with a shared secret: HMAC of the request (kvxfer.auth)


class ChunkWatch(LayerWatch, tag="cwatch"):
    """A ``LayerWatch`` of a reader that reads a prompt computed in chunks as its chunks are
    computed (sent only to a prefill whose ``Welcome`` says ``chunk_streams``): answered as
    soon as the request's progress is past version ``seen`` (``LayersAt.version``): a reader's
    first says -1, answered at once with what is held (versions start at 0)."""

    seen: int = 0


HandshakeRequest = Hello | DigestRequest | LeaseRenew | StageRequest | LayerWatch | ChunkWatch


class RemoteRegion(_Msg, tag="rregion"):
    addr: NonNeg
    block_len: Positive
    block_stride: Positive
    device_id: NonNeg = 0


class RankInfo(_Msg, tag="rank"):
    layout: KVLayout
    regions: list[RemoteRegion]
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    engine_id: EngineId = ""  # the engine this rank belongs to (never "" from a v3 sidecar)
    dp_rank: NonNeg = 0

    @property
    def key(self) -> tuple[str, int, int]:
        """(engine, pp, tp): how a peer's ranks are addressed."""
        return (self.engine_id, self.layout.pp_rank, self.layout.tp_rank)

    def block_bytes(self, attention_only: bool = False) -> int:
        """Bytes of one block in this rank's regions as registered (``attention_only``: the
        KV regions, not the state regions that follow them). The one place this sum is
        written; a method, so the encoded bytes do not change."""
        regions = self.regions[: self.layout.num_regions] if attention_only else self.regions
        return sum(r.block_len for r in regions)


class Welcome(_Msg, tag="welcome"):
    """Handshake accepted; the NIXL agent metadata follows as the next frame."""

    version: int
    compat_hash: str
    engine_id: str
    agent_name: str
    ranks: list[RankInfo]
    mac: str = ""  # with a shared secret: proves the answer comes from a holder of it
    generation: str = ""  # the registrations these ranks describe (Pong.generation)
    staging_bytes: NonNeg = 0  # its staging arena (StageRequest): 0, it stages nothing
    lease_words_addr: NonNeg = 0  # its lease words (kvxfer.sidecar.lease_words) in its NIXL memory
    lease_words_slots: NonNeg = 0  # 0: none (every read waits for its claim's answer)
    layer_streams: bool = False  # it answers LayerWatch (push mode)
    grouped_streams: bool = False  # ... and its LayersAt names the blocks per KV cache group
    chunk_streams: bool = False  # ... and answers ChunkWatch (prompts computed in chunks)
    compat_tp: str = ""  # kvxfer.protocol.compat_tp_hash of its layout ("": none)
    reader_engines: bool = False  # it keys readers by decode engine too (ReadNotice.reader_engine)


class Challenge(_Msg, tag="challenge"):
    """With a shared secret, the answer to an unsigned Hello: sign a Hello over this nonce
    and this agent name (``kvxfer.auth``); it is accepted once, within a short time."""

    version: int
    nonce: str
    agent_name: str


class Refused(_Msg, tag="refused"):
    version: int
    code: str
    reason: str


class DigestReply(_Msg, tag="digested"):
    req_id: str
    digests: list[str]  # in the order of DigestRequest.ranks


class LeaseState(_Msg, tag="leases"):
    seq: NonNeg
    # per LeaseRenew.req_ids: "held" (and now extended), "gone" (its lease ended: released or
    # expired) or "unknown" (never held here, or not yet: its Hold may still be on its way)
    held: list[Literal["held", "gone", "unknown"]]
    # the answering sidecar's registration generation now (Welcome.generation): a read planned
    # from a handshake of another generation used stale memory descriptions
    generation: str = ""
    # per req_id: its lease word is published (kvxfer.sidecar.lease_words): a word read after
    # the data landed that does not show it means the lease ended during the read
    published: list[bool] = []


class Staged(_Msg, tag="staged"):
    """The answer to a ``StageRequest`` (matched by ``seq``). ``held``: "held" (copied into
    the slot at ``addr``, ``nbytes`` long, kept ``ttl_s`` from the request's arrival at most),
    "gone" / "unknown" (as ``LeaseState``), "busy" (no room in the arena now: read the blocks
    directly) or "refused" (``code``/``reason``: runs outside held blocks, unknown ranks)."""

    seq: NonNeg
    held: Literal["held", "gone", "unknown", "busy", "refused"]
    addr: NonNeg = 0
    nbytes: NonNeg = 0
    ttl_s: Annotated[float, Meta(ge=0)] = 0.0
    code: str = ""
    reason: str = ""
    generation: str = ""  # as LeaseState.generation


class LayersAt(_Msg, tag="layersat"):
    """The answer to a ``LayerWatch`` (matched by ``seq``). ``held``: "held" (``ready`` of
    ``total`` model layers computed by every rank holding them, in these blocks), "gone" (its
    lease ended: released, aborted, expired), "unknown" (not held here, or not yet: its Hold may
    be on its way; ask again) or "refused" (``code``/``reason``)."""

    seq: NonNeg
    held: Literal["held", "gone", "unknown", "refused"]
    ready: NonNeg = 0
    total: NonNeg = 0
    block_ids: BlockIds = []
    state_block_ids: BlockIds = []
    generation: str = ""  # as LeaseState.generation
    tp_size: NonNeg = 0  # the prefill engine's TP size
    engine_id: EngineId = ""  # the prefill engine holding it
    code: str = ""
    reason: str = ""
    groups: GroupBlockIds | None = None  # as Hold.groups (several KV cache groups)
    num_tokens: NonNeg = 0  # as Hold.num_tokens
    # a prompt computed in chunks: more blocks will be held (``block_ids``: the list so far),
    # its first ``complete`` blocks are computed in every layer (``ready`` counts layers of the
    # last chunk, once it is held); ``version`` of that progress (ChunkWatch.seen)
    partial: bool = False
    complete: NonNeg = 0
    version: NonNeg = 0
    # "held": the hold's read capability (push: a fresh one per Hold, ``Lease.read_token``):
    # the reads of these blocks, their claims, notices and lease word present it, so that a
    # hold again under the same transfer id (a router's retry) never proves them. "": the
    # watch's token (an older prefill sidecar)
    token: Token = ""


HandshakeReply = Welcome | Refused | DigestReply | LeaseState | Challenge | Staged | LayersAt


# --------------------------------------------------------------------------- NIXL notification


class ReadNotice(_Msg, tag="read"):
    """Decode sidecar -> prefill sidecar once a read finished (ok) or was abandoned."""

    req_id: str
    tp_rank: NonNeg
    ok: bool
    readers: NonNeg = 0  # notices the prefill side should expect in all (decode TP); 0: Hold.reads
    reading_s: Annotated[float, Meta(ge=0)] = 0.0  # >0: "started; done or failed within this"
    engine_id: str = ""  # the prefill engine whose lease this is ("": the only one with req_id)
    pp_rank: NonNeg = 0  # the reader's pipeline stage (a reader is (agent, pp_rank, tp_rank))
    token: Token = ""  # the lease's capability (Hold.token)
    # the decode engine whose rank read (a decode sidecar may serve several: DP ranks, which a
    # router's retry may send the same request to): a reader is (agent, reader_engine,
    # pp_rank, tp_rank), and a staging slot's readers are "pp/tp@reader_engine" at a prefill
    # whose Welcome says reader_engines ("": an older decode sidecar, readers by agent)
    reader_engine: EngineId = ""
