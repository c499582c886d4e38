"""Describe vLLM's per-layer KV tensors as a kvxfer registration. vLLM-free; torch only.

Each layer tensor has a block dimension (size ``num_blocks``); a dimension of size 2
right before it is the K/V split (FlashAttention's ``[2, num_blocks, ...]``), otherwise
a block holds everything (``[num_blocks, ...]``: the CPU backend's fused buffer,
FlashInfer's ``[num_blocks, 2, ...]``, MLA). Everything after the block dimension must be
contiguous: that is one block's bytes, the unit NIXL moves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import KVLayout, KVRegion, MemoryRef, RegisterKV

# tensor -> (memory it lives in, a key naming that memory, byte offset of tensor in it)
MemoryOf = Callable[[Any], tuple[MemoryRef, object, int]]


def _layer_regions(name: str, t: Any, num_blocks: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(kv_parts, [(byte offset from tensor start, block_len, block_stride)])."""
    shape, stride, item = tuple(t.shape), tuple(t.stride()), t.element_size()
    try:
        bdim = shape.index(num_blocks)
    except ValueError:
        raise RequestError(
            ErrorCode.INVALID_LAYOUT, f"layer {name}: no dimension of size num_blocks={num_blocks} in {shape}"
        ) from None
    inner = shape[bdim + 1 :]
    expect = 1
    for size, st in zip(reversed(inner), reversed(stride[bdim + 1 :]), strict=True):
        if size > 1 and st != expect:
            raise RequestError(ErrorCode.INVALID_LAYOUT, f"layer {name}: a block is not contiguous")
        expect *= size
    block_len = math.prod(inner) * item
    block_stride = stride[bdim] * item
    if bdim >= 1 and shape[bdim - 1] == 2:
        kv_stride = stride[bdim - 1] * item
        return 2, [(p * kv_stride, block_len, block_stride) for p in range(2)]
    return 1, [(0, block_len, block_stride)]


def registration_from_tensors(
    kv_caches: dict[str, Any],
    *,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    local_kv_heads: int,
    head_dim: int,
    tp_rank: int,
    tp_size: int,
    mla: bool,
    memory_of: MemoryOf,
) -> RegisterKV:
    memory: list[MemoryRef] = []
    index: dict[object, int] = {}
    regions: list[KVRegion] = []
    parts_seen: set[int] = set()
    dtypes: set[str] = set()
    for name, t in kv_caches.items():
        ref, key, base = memory_of(t)
        if key not in index:
            index[key] = len(memory)
            memory.append(ref)
        parts, layer = _layer_regions(name, t, num_blocks)
        parts_seen.add(parts)
        dtypes.add(str(t.dtype).removeprefix("torch."))
        regions += [
            KVRegion(memory=index[key], offset=base + off, block_len=blen, block_stride=bstride)
            for off, blen, bstride in layer
        ]
    if len(parts_seen) != 1 or len(dtypes) != 1:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "layers disagree on K/V split or dtype")
    layout = KVLayout(
        num_layers=len(kv_caches),
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        local_kv_heads=local_kv_heads,
        head_dim=head_dim,
        dtype=dtypes.pop(),
        kv_parts=parts_seen.pop(),
        mla=mla,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    return RegisterKV(layout=layout, memory=memory, regions=regions)
