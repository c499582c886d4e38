"""Checks on what an engine or a peer describes, before anything is mapped or a descriptor
is built from it: ``validate_registration`` (an engine's ``RegisterKV``: regions against its
layout and memory sizes) and ``validate_rank_info`` (a peer's advertised rank, at the
handshake).

Pure: protocol messages in, ``RequestError`` out. No I/O (files are checked by
``kvxfer.sidecar.mapping.check_shm_files``), no NIXL, no asyncio, no state.
"""

from __future__ import annotations

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import DTYPE_SIZES, RankInfo, RegisterKV, compat_hash, compat_tp_hash, hashes_match
from kvxfer.topology import Incompatible, check_layout


def validate_registration(msg: RegisterKV) -> None:
    """Check a registration's regions against its layout and memory sizes, before mapping."""
    lay = msg.layout
    if lay.dtype not in DTYPE_SIZES:
        raise RequestError(ErrorCode.INVALID_LAYOUT, f"unknown dtype {lay.dtype!r}")
    if lay.tp_rank >= lay.tp_size:
        raise RequestError(ErrorCode.INVALID_LAYOUT, f"tp_rank {lay.tp_rank} >= tp_size {lay.tp_size}")
    if lay.local_kv_heads > lay.num_kv_heads:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "local_kv_heads > num_kv_heads")
    if len(msg.regions) != lay.total_regions:
        raise RequestError(
            ErrorCode.INVALID_LAYOUT,
            f"{len(msg.regions)} regions for {lay.num_layers} layers x {lay.kv_parts} parts"
            + (f" + {lay.state_regions} state regions" if lay.state_regions else ""),
        )
    if bool(lay.state_regions) != bool(lay.state_bytes):
        raise RequestError(ErrorCode.INVALID_LAYOUT, "state_regions and state_bytes go together")
    if not lay.num_layers and not lay.state_regions:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "a registration with neither KV nor state layers")
    if not msg.memory:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "no memory in registration")
    for i, r in enumerate(msg.regions):
        want = lay.region_len(i)
        if r.block_len != want:
            what = (f"{lay.block_size} tokens x {lay.local_kv_heads} heads x {lay.head_dim} x "
                    f"{lay.itemsize} B, kv_parts={lay.kv_parts}, mla={lay.mla}, fused={lay.fused!r}"
                    if i < lay.num_regions else f"state of {lay.state_bytes} B")
            raise RequestError(
                ErrorCode.INVALID_LAYOUT,
                f"region {i}: a block is {r.block_len} bytes in memory, but the layout ({what}) "
                f"describes {want}",
            )
        if r.memory >= len(msg.memory):
            raise RequestError(ErrorCode.INVALID_LAYOUT, f"region {i} names memory {r.memory}")
        if r.block_len > r.block_stride:
            raise RequestError(ErrorCode.INVALID_LAYOUT, f"region {i}: block_len > block_stride")
        end = r.offset + (lay.num_blocks - 1) * r.block_stride + r.block_len
        if end > msg.memory[r.memory].size:
            raise RequestError(
                ErrorCode.INVALID_LAYOUT,
                f"region {i} ends at byte {end}, memory {r.memory} has {msg.memory[r.memory].size}",
            )


def validate_rank_info(info: RankInfo, compat: str, ours: tuple[str, str] = ("", "")) -> None:
    """Check a peer's advertised rank before its metadata is loaded or any descriptor is
    built from it, the way a local registration is checked: a layout that hashes to the
    compatibility hash agreed at the handshake (``ours``: the dialer's hashes, which it must
    match as the handshake did: state layouts of another TP size by their TP-independent
    hash) and is self-consistent (ranks within sizes,
    heads as the TP split gives them, layers within the model), and regions that are blocks
    of exactly that geometry, not overlapping, within the address space. A peer holding the
    secret can still lie about *where* its blocks are; it then hands us its own bytes."""
    lay = info.layout
    who = f"peer rank pp{lay.pp_rank}/tp{lay.tp_rank}"
    if lay.dtype not in DTYPE_SIZES:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: unknown dtype {lay.dtype!r}")
    if lay.tp_rank >= lay.tp_size:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: tp_rank >= tp_size {lay.tp_size}")
    if lay.local_kv_heads > lay.num_kv_heads:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: {lay.local_kv_heads} local KV heads of "
                           f"{lay.num_kv_heads}")
    mine = compat_hash(lay)
    if mine != compat or (ours[0] and not hashes_match(*ours, mine, compat_tp_hash(lay))):
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: its layout ({lay.model_signature()}) does "
                           f"not hash to the handshake's compatibility hashes {compat}, {ours}")
    try:
        check_layout(lay)
    except Incompatible as e:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: {e}") from None
    if len(info.regions) != lay.total_regions:
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: {len(info.regions)} regions "
                           f"for {lay.num_layers} layers x {lay.kv_parts} parts + {lay.state_regions} state")
    if bool(lay.state_regions) != bool(lay.state_bytes):
        raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: state_regions and state_bytes go together")
    for i, r in enumerate(info.regions):
        if r.block_len != lay.region_len(i):
            raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: region {i} has {r.block_len}-byte "
                               f"blocks, its layout describes {lay.region_len(i)}")
        if r.block_stride < r.block_len:
            raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: region {i}'s blocks overlap "
                               f"(stride {r.block_stride} < {r.block_len} bytes)")
        if r.addr + (lay.num_blocks - 1) * r.block_stride + r.block_len > ADDRESS_LIMIT:
            raise RequestError(ErrorCode.INCOMPATIBLE, f"{who}: region {i} ends beyond the address space")


ADDRESS_LIMIT = 1 << 64
