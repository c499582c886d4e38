"""Deterministic KV byte patterns, so the decode side can check every byte it received.

Each byte is a function of (request, global layer, K/V part, token position in the request,
global KV head, byte within the head) — not of block ids, ranks or block sizes — so any
prefill/decode topology must reproduce the same bytes, and a block, head, layer or token
that lands in the wrong place, or a request's blocks swapped with another's, shows up.
"""

from __future__ import annotations

import hashlib
import zlib

import numpy as np

from kvxfer.protocol import KVLayout
from kvxfer.topology import heads_of, rank_heads


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def request_pattern(layout: KVLayout, req_id: str, n_blocks: int) -> np.ndarray:
    """uint8 ``[num_layers, kv_parts, n_blocks, block_len]`` for a request's first blocks."""
    u = np.uint64
    seed = u(zlib.crc32(req_id.encode()))
    heads = rank_heads(layout)
    lay = np.arange(layout.first_layer, layout.layers.stop, dtype=u)[:, None, None, None]  # global layers
    part = np.arange(layout.kv_parts, dtype=u)[None, :, None, None]
    pos = np.arange(n_blocks * layout.block_size, dtype=u)[None, None, :, None]
    head = np.arange(heads.start, heads.stop, dtype=u)[None, None, None, :]
    with np.errstate(over="ignore"):
        key = seed * u(0x9E3779B97F4A7C15) + lay * u(1_000_003) + part * u(7_919)
        key = key + pos * u(104_729) + head * u(15_485_863)
    base = (_mix(key) & u(0xFF)).astype(np.uint8)  # [L, P, tokens, heads]
    hd = layout.unit_bytes  # K then V when the content dimension holds both
    vals = base[..., None] + np.arange(hd, dtype=np.uint8)  # [L, P, tokens, heads, hd] (wraps)
    vals = vals.reshape(layout.num_layers, layout.kv_parts, n_blocks, layout.block_size, len(heads), hd)
    if layout.head_layout == "HND":
        vals = vals.transpose(0, 1, 2, 4, 3, 5)
    return np.ascontiguousarray(vals).reshape(layout.num_layers, layout.kv_parts, n_blocks, -1)


def state_pattern(layout: KVLayout, req_id: str, n_blocks: int) -> np.ndarray:
    """uint8 ``[state_regions, n_blocks, state_bytes]``: a request's state in ``n_blocks``
    blocks. With ``state_parts`` each part's bytes are this rank's units of one model-wide
    pattern (drawn per part whatever the TP size), so a decode rank of any TP size can check
    the state it read from prefill ranks of another; without, one pattern per request."""
    seed = int.from_bytes(hashlib.blake2b(f"state:{req_id}".encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    shape = (layout.state_regions, n_blocks)
    if not layout.state_parts:
        return rng.integers(0, 256, (*shape, layout.state_bytes), dtype=np.uint8)
    out = np.zeros((*shape, layout.state_bytes), dtype=np.uint8)
    for p in layout.state_parts:
        whole = rng.integers(0, 256, (*shape, p.count, p.units * p.unit_bytes), dtype=np.uint8)
        mine = heads_of(p.units, layout.tp_size, layout.tp_rank)
        n = len(mine) * p.unit_bytes
        for i in range(p.count):
            at = p.offset + i * p.stride
            out[:, :, at:at + n] = whole[:, :, i, mine.start * p.unit_bytes:mine.start * p.unit_bytes + n]
    return out
