"""The engine worker <-> its sidecar conversation (ZMQ DEALER -> ROUTER on ``ipc://``):
``EngineRequest`` one way, ``SidecarEvent`` the other.

No I/O; never imports NIXL, ZMQ, torch or vLLM (see ``kvxfer.protocol``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from kvxfer.protocol.base import BlockIds, EngineId, GroupBlockIds, NonNeg, Positive, ReqId, Token, _Msg
from kvxfer.protocol.layout import KVGroup, KVLayout, KVRegion, MemoryRef

# --------------------------------------------------------------------------- engine -> sidecar


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
    # Push mode (kvxfer.sidecar.layer_stream): held as soon as the blocks are allocated, before
    # their KV is computed; the workers report each layer (``LayersDone``) and a decode's
    # ``LayerWatch`` reads the layers computed so far while the prefill goes on.
    streamed: bool = False
    # Push mode, a model of several KV cache groups (or a windowed or state group): the
    # engine's block list per group, positions kept (0: vLLM's null block; ``block_ids`` are
    # their distinct real blocks), and the prompt tokens it computes. A decode pairs its own
    # lists with these (``kvxfer.pairing``). None: one group, ``block_ids`` in order.
    groups: GroupBlockIds | None = None
    num_tokens: NonNeg = 0
    # Push mode, a prompt computed in chunks: ``partial``, more of its blocks will be held
    # (each chunk's, as vLLM allocates them); ``extends``, this Hold extends the streamed hold
    # of this id (``block_ids``: the whole list so far, starting with the one held).
    partial: bool = False
    extends: bool = False


class LayersDone(_Msg, tag="layers"):
    """Prefill side, push mode: this worker rank computed the first ``layers`` layers of its
    pipeline stage for these held requests (counted from the stage's first layer; a lower
    count than one reported before changes nothing)."""

    req_ids: Annotated[list[ReqId], Meta(max_length=4096)]
    layers: NonNeg
    tp_rank: NonNeg = 0
    pp_rank: NonNeg = 0
    engine_id: EngineId = ""
    # a chunk of a prompt computed in chunks: every layer of the held request's first
    # ``blocks`` blocks is computed (``layers`` 0)
    blocks: NonNeg = 0


class Release(_Msg, tag="release"):
    """Prefill side: the engine dropped the request (abort); release now."""

    req_id: ReqId
    engine_id: EngineId = ""


class Cancel(_Msg, tag="cancel"):
    """Decode side: the engine dropped the request (an abort) while its load may still run:
    stop every rank's receive of it now. Reads in flight are settled first (nothing lands
    after the answer), then each rank gets ``Failed`` ``cancelled`` and the prefill is told
    (its lease released ``aborted``). A request with no receive here changes nothing."""

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
    # Push mode: the prefill is still computing (the router sent the request to both at once):
    # the prefill's blocks, token and generation come from its sidecar's answers to this
    # sidecar's ``LayerWatch``es (``remote_block_ids`` and the remote state ids may be empty;
    # ``remote_req_id`` is the shared transfer id), and its layers are read as they are computed.
    streamed: bool = False
    # Push mode, several KV cache groups: this engine's block list per group (``block_ids``:
    # its attention groups' real blocks, flat; no state ids yet), which of them are state
    # groups, and the prompt tokens it loads. Paired with the prefill's lists
    # (``LayersAt.groups``) once its sidecar names them; a prefill that computed another
    # number of tokens is not read (the pairs, or the state, would be another prompt's).
    groups: GroupBlockIds | None = None
    state_groups: Annotated[list[bool], Meta(max_length=64)] | None = None
    num_tokens: NonNeg = 0
    # The prefill's block size (tokens) the two lists were paired for: when the block sizes
    # differ, a decode block holds several prefill blocks or the reverse, and the lists cover
    # the same tokens (kvxfer.pairing.pair_sizes). 0: not said, the lists pair one to one; a
    # sidecar that finds the sizes differ, or another size than said, refuses the receive.
    remote_block_size: NonNeg = 0

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


class HoldsCheck(_Msg, tag="holds_check"):
    """A worker's holds whose lease ran past the deadline it knows and whose ``Released`` has
    not come: the sidecar answers ``Released(reason="unknown")`` for each it does not hold
    (its Hold never reached it, or its Released was lost on the way), and nothing for one it
    holds (a decode extended it: its Released comes when it ends). Asked only of a sidecar
    whose ``Pong`` says ``holds_check``."""

    engine_id: str
    req_ids: Annotated[list[ReqId], Meta(max_length=4096)]  # the lease names (a push hold's transfer id)


EngineRequest = (RegisterKV | Unregister | Hold | Release | Recv | Ping | KeepAlive | LayersDone | Cancel
                 | HoldsCheck)


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
    # which rank's receive (the scheduler gets the Failed of a rank not registered yet, e.g.
    # right after a sidecar restart, and passes it to that rank's worker); -1: not said (a
    # sidecar from before these fields)
    tp_rank: Annotated[int, Meta(ge=-1)] = -1
    pp_rank: Annotated[int, Meta(ge=-1)] = -1


class Released(_Msg, tag="released"):
    req_id: str
    reason: Literal["read", "expired", "aborted", "unknown"]  # unknown: the answer to a HoldsCheck
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
    grouped_streams: bool = False  # it follows push loads of several KV cache groups (Recv.groups)
    chunk_streams: bool = False  # it holds a prompt computed in chunks chunk by chunk (Hold.partial)
    # ... and so with several KV cache groups (Hold.groups on a partial hold: the full-attention
    # groups' lists grow chunk by chunk, a window's and a state's come with the last)
    grouped_chunks: bool = False
    holds_check: bool = False  # it answers HoldsCheck


SidecarEvent = Registered | Done | Failed | Released | Error | Pong
