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


def _layer_regions(
    name: str, t: Any, num_blocks: int
) -> tuple[int, str, list[tuple[int, int, int]]]:
    """(kv_parts, head layout, [(byte offset from tensor start, block_len, block_stride)]).

    The dims after the block dim may be permuted in memory (vLLM allocates HND caches as
    a permuted view of the logical ``[..., tokens, heads, dim]`` shape): a block must be
    contiguous in stride order, and that order tells NHD from HND.
    """
    shape, stride, item = tuple(t.shape), tuple(t.stride()), t.element_size()
    try:
        bdim = shape.index(num_blocks)
    except ValueError:
        raise RequestError(
            ErrorCode.INVALID_LAYOUT, f"layer {name}: no dimension of size num_blocks={num_blocks} in {shape}"
        ) from None
    inner = list(range(bdim + 1, len(shape)))
    order = sorted(inner, key=lambda d: (-stride[d], d))  # outermost first
    expect = 1
    for d in reversed(order):
        if shape[d] > 1 and stride[d] != expect:
            raise RequestError(ErrorCode.INVALID_LAYOUT, f"layer {name}: a block is not contiguous")
        expect *= shape[d]
    head_layout = "NHD"
    if len(inner) == 3 and order[:2] == [inner[1], inner[0]]:  # heads outside tokens
        head_layout = "HND"
    block_len = math.prod(shape[d] for d in inner) * item
    block_stride = stride[bdim] * item
    if bdim >= 1 and shape[bdim - 1] == 2:
        kv_stride = stride[bdim - 1] * item
        return 2, head_layout, [(p * kv_stride, block_len, block_stride) for p in range(2)]
    return 1, head_layout, [(0, block_len, block_stride)]


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
    layouts: set[str] = set()
    dtypes: set[str] = set()
    for name, t in kv_caches.items():
        ref, key, base = memory_of(t)
        if key not in index:
            index[key] = len(memory)
            memory.append(ref)
        parts, head_layout, layer = _layer_regions(name, t, num_blocks)
        parts_seen.add(parts)
        layouts.add(head_layout)
        dtypes.add(str(t.dtype).removeprefix("torch."))
        regions += [
            KVRegion(memory=index[key], offset=base + off, block_len=blen, block_stride=bstride)
            for off, blen, bstride in layer
        ]
    if len(parts_seen) != 1 or len(dtypes) != 1 or len(layouts) != 1:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "layers disagree on K/V split, layout or dtype")
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
        head_layout=layouts.pop(),  # type: ignore[arg-type]
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    return RegisterKV(layout=layout, memory=memory, regions=regions)
