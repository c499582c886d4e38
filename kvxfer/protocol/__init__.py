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

The messages live in submodules by topic, and every name is imported from here
(``from kvxfer.protocol import X``):

* ``kvxfer.protocol.base``: the ``_Msg`` base and the shared field types (``NonNeg``,
  ``ReqId``, ``Token``, ``EngineId``...), ``DTYPE_SIZES``
* ``kvxfer.protocol.layout``: ``KVLayout`` and what a registration describes (memory
  references, regions, KV cache groups)
* ``kvxfer.protocol.engine``: engine <-> sidecar messages (``EngineRequest``, ``SidecarEvent``)
* ``kvxfer.protocol.peer``: sidecar <-> sidecar messages (the handshake, ``ReadNotice``)
* ``kvxfer.protocol.codec``: ``encode``, the decoders and ``DECODE_ERRORS``

This package does no I/O and must never import NIXL, ZMQ, torch or vLLM.
"""

from __future__ import annotations

import hashlib

from kvxfer.protocol.base import (
    DTYPE_SIZES,
    BlockIds,
    EngineId,
    NonNeg,
    Positive,
    ReqId,
    Token,
)
from kvxfer.protocol.codec import (
    DECODE_ERRORS,
    encode,
    engine_request_decoder,
    handshake_reply_decoder,
    handshake_request_decoder,
    read_notice_decoder,
    sidecar_event_decoder,
)
from kvxfer.protocol.engine import (
    Cancel,
    Done,
    EngineRequest,
    Error,
    Failed,
    Hold,
    HoldsCheck,
    KeepAlive,
    LayersDone,
    Ping,
    Pong,
    Recv,
    Registered,
    RegisterKV,
    Release,
    Released,
    SidecarEvent,
    Unregister,
)
from kvxfer.protocol.layout import (
    CudaIpcMemory,
    Fusion,
    KVGroup,
    KVLayout,
    KVRegion,
    MemoryRef,
    PoolMemory,
    ShmMemory,
    StatePart,
)
from kvxfer.protocol.peer import (
    Challenge,
    ChunkWatch,
    DigestItem,
    DigestRank,
    DigestReply,
    DigestRequest,
    HandshakeReply,
    HandshakeRequest,
    Hello,
    LayersAt,
    LayerWatch,
    LeaseRenew,
    LeaseState,
    RankInfo,
    ReadNotice,
    Refused,
    RemoteRegion,
    Staged,
    StageRank,
    StageRequest,
    Welcome,
)

# 2: KVLayout.fused (kv_parts == 1 blocks hold K and V; version 1 sidecars read half of them)
# 3: ranks keyed by (engine, DP, PP, TP): engine ids in registrations, holds, receives, rank
#    infos, notices and digests; KVLayout says which layers a pipeline stage holds
# 4: challenge-bound, canonically MAC'd handshake (Challenge; Hello.challenge/target; the
#    Welcome MAC covers the ranks); per-request capability tokens on holds, reads, notices,
#    renewals and digests
# 5: state layers (Mamba/GDN): KVLayout.state_regions/state_bytes/state_kind, num_layers may be
#    0; Recv.state_block_ids/remote_state_block_ids; digests of a rank's KV and state regions
# 6: staged reads: StageRequest / Staged on the handshake socket, Welcome.staging_bytes
#    (and, decodable by any 6: Failed.tp_rank/pp_rank, appended; Welcome.lease_words_addr/
#    lease_words_slots and LeaseState.published, appended: a 6 without them makes every read
#    wait for its claim)
#    (and, push mode, decodable by any 6 that knows it: Hold.streamed, Recv.streamed and
#    Welcome.layer_streams appended; LayersDone (engine -> sidecar) and LayerWatch/LayersAt
#    (peer) added; a decode sends LayerWatch only to a prefill whose Welcome says layer_streams)
#    (and Cancel, engine -> sidecar, added: a 6 that does not know it answers Error unknown_message,
#    and the load runs to its end as before)
#    (and push mode of models of several KV cache groups, decodable by any 6: Hold.groups/
#    num_tokens, Recv.groups/state_groups/num_tokens, LayersAt.groups/num_tokens and
#    Welcome.grouped_streams and Pong.grouped_streams appended (a connector claims a grouped push
#    load only from a sidecar whose Pong says so); a decode follows a grouped request only at a prefill
#    whose Welcome says grouped_streams, else the load fails incompatible and is recomputed)
#    (and push of prompts computed in chunks, decodable by any 6: Hold.partial/extends,
#    LayersDone.blocks, LayersAt.partial/complete/version, Pong.chunk_streams and
#    Welcome.chunk_streams appended; ChunkWatch (peer) added, sent only to a prefill whose
#    Welcome says chunk_streams; an older reader of a partial hold reads nothing wrong: it
#    sees no layer ready until the last chunk, and a list that grew fails it incompatible)
#    (and push of prompts of several KV cache groups computed in chunks, decodable by any 6:
#    Pong.grouped_chunks appended; a partial Hold then names its groups (Hold.groups, a window's
#    and a state's list empty until the last chunk); a decode that reads no grouped chunks waits
#    for the last chunk, as before)
#    (and, with a secret, the Welcome MAC covering lease_words_*, layer/grouped/chunk_streams for
#    a dialer whose Hello.nonce starts "w1." (kvxfer.auth.welcome_cover): any 6 accepts that
#    nonce, a listener that does not know it signs the first fields only, and a dialer accepts
#    either; the nonce is under the Hello's MAC, so the ask cannot be stripped on the way)
#    (and state between different TP sizes, decodable by any 6: KVLayout.state_parts, and
#    Hello.compat_tp / Welcome.compat_tp appended: two engines whose state layouts say how they
#    split shake hands when their TP-independent hashes match, whatever their compat_hash; a 6
#    that does not know them compares compat_hash alone, as before)
#    (and, decodable by any 6: Recv.remote_block_size (a decode sidecar that does not know it
#    reads lists paired by token as its ratio pairs them: right); LayersAt.token (a push hold's
#    read token; a decode that does not know it claims with the transfer id, is never told a
#    word is published, and is proved by a claim after the landing); ReadNotice.reader_engine
#    and Welcome.reader_engines (readers told apart by decode engine; a decode names a staging
#    slot's readers "pp/tp@engine" only at a prefill whose Welcome says so) appended)
#    (and, with a secret, the Welcome MAC covering compat_tp and reader_engines and the Hello's
#    compat_tp for a dialer whose nonce starts "w2." (cover 2, kvxfer.auth.welcome_cover); a
#    listener of cover 1 signs cover 1, which such a dialer still accepts)
#    (and HoldsCheck, engine -> sidecar, added, with Released.reason "unknown" (its only answer)
#    and Pong.holds_check appended: a worker asks only a sidecar whose Pong says so)
PROTOCOL_VERSION = 6


def compat_hash(layout: KVLayout | None) -> str:
    """Compatibility hash checked at handshake before any payload is decoded."""
    sig = (PROTOCOL_VERSION, layout.model_signature() if layout is not None else None)
    return hashlib.sha256(repr(sig).encode()).hexdigest()[:16]


def compat_tp_hash(layout: KVLayout | None) -> str:
    """The hash of what two engines must share whatever their TP sizes (``KVLayout.
    tp_signature``), for layouts whose ``compat_hash`` depends on the TP size (state layers
    that say how they split); "" for every other layout (their compat_hash already does not)."""
    if layout is None or not layout.state_parts:
        return ""
    sig = (PROTOCOL_VERSION, "tp", layout.tp_signature())
    return hashlib.sha256(repr(sig).encode()).hexdigest()[:16]


def hashes_match(ours: str, ours_tp: str, theirs: str, theirs_tp: str) -> bool:
    """Whether a handshake's two sides may exchange KV: the same compat_hash, or (state layouts
    of different TP sizes) the same TP-independent hash."""
    return ours == theirs or bool(ours_tp) and ours_tp == theirs_tp


__all__ = [
    "DECODE_ERRORS",
    "DTYPE_SIZES",
    "PROTOCOL_VERSION",
    "BlockIds",
    "Cancel",
    "Challenge",
    "CudaIpcMemory",
    "DigestItem",
    "DigestRank",
    "DigestReply",
    "DigestRequest",
    "Done",
    "EngineId",
    "EngineRequest",
    "Error",
    "Failed",
    "Fusion",
    "HandshakeReply",
    "HandshakeRequest",
    "Hello",
    "Hold",
    "HoldsCheck",
    "KVGroup",
    "KVLayout",
    "KVRegion",
    "KeepAlive",
    "ChunkWatch",
    "LayerWatch",
    "LayersAt",
    "LayersDone",
    "LeaseRenew",
    "LeaseState",
    "MemoryRef",
    "NonNeg",
    "Ping",
    "PoolMemory",
    "Pong",
    "Positive",
    "RankInfo",
    "ReadNotice",
    "Recv",
    "Refused",
    "RegisterKV",
    "Registered",
    "Release",
    "Released",
    "RemoteRegion",
    "StageRank",
    "StageRequest",
    "Staged",
    "ReqId",
    "ShmMemory",
    "SidecarEvent",
    "StatePart",
    "Token",
    "Unregister",
    "Welcome",
    "compat_hash",
    "compat_tp_hash",
    "hashes_match",
    "encode",
    "engine_request_decoder",
    "handshake_reply_decoder",
    "handshake_request_decoder",
    "read_notice_decoder",
    "sidecar_event_decoder",
]
