"""Deterministic KV byte patterns, so the decode side can check every byte it received.

Each byte depends on (request, layer, K/V part, block position in the request, head,
token, byte within the head), so a block, head, layer or token that lands in the wrong
place — or a request's blocks swapped with another's — shows up as a mismatch.
"""

from __future__ import annotations

import zlib

import numpy as np

from kvxfer.memory import region_block_len
from kvxfer.protocol import KVLayout

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _within_block(layout: KVLayout) -> np.ndarray:
    """Per-byte offsets inside one block, mixing in head and token position (uint8)."""
    head_bytes = layout.head_dim * layout.itemsize
    tok = np.arange(layout.block_size, dtype=np.uint32)[:, None, None]
    head = np.arange(layout.local_kv_heads, dtype=np.uint32)[None, :, None]
    byte = np.arange(head_bytes, dtype=np.uint32)[None, None, :]
    if layout.head_layout == "HND":
        tok, head = tok.transpose(1, 0, 2), head.transpose(1, 0, 2)
    first_head = layout.tp_rank * layout.local_kv_heads
    val = (head + first_head) * 97 + tok * 31 + byte
    return (val & 0xFF).astype(np.uint8).reshape(-1)


def request_pattern(layout: KVLayout, req_id: str, n_blocks: int) -> np.ndarray:
    """uint8 ``[num_layers, kv_parts, n_blocks, block_len]`` for a request's blocks."""
    seed = np.uint64(zlib.crc32(req_id.encode()))
    lay = np.arange(layout.num_layers, dtype=np.uint64)[:, None, None]
    part = np.arange(layout.kv_parts, dtype=np.uint64)[None, :, None]
    blk = np.arange(n_blocks, dtype=np.uint64)[None, None, :]
    with np.errstate(over="ignore"):
        key = seed * np.uint64(0x9E3779B97F4A7C15) + lay * np.uint64(1_000_003)
        key = key + part * np.uint64(7_919) + blk * np.uint64(104_729)
        base = (_mix(key & _MASK) & np.uint64(0xFF)).astype(np.uint8)
    within = _within_block(layout)
    assert within.size == region_block_len(layout)
    return base[..., None] + within[None, None, None, :]
