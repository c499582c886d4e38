"""End-to-end integrity: one digest of the bytes a receive moved, computed on both sides.

No P/D connector we know of checks that the KV it delivered is the KV that was computed. For
a sampled receive (``--verify-sample``) the decode sidecar digests the bytes it wrote, asks
the prefill sidecar (which still holds the blocks under their lease) for the digest of the
bytes it served, and reports ``Done`` only when they agree; otherwise the load fails with
code ``integrity`` and vLLM recomputes.

Both sides walk the same structure: per remote rank, per sub-position ``q`` of the block
pairing, per region, the block list of that sub-position and the byte runs the plan copies
(local offsets on the decode, remote offsets on the prefill). A digest is a position-
weighted sum over 64-bit words, with wrapping (mod 2**64) arithmetic, so its value does not
depend on summation order: it is a torch reduction that runs the same on host memory and on
VRAM. It detects any single changed word (odd weights), moved or swapped runs (weights
depend on position) and missing bytes (the length is part of it); it is a check against
bugs and corruption, not a MAC.

Pure planning (``digest_items``) needs no torch; ``digest`` imports it when first used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvxfer.protocol import DigestItem
from kvxfer.topology import BlockPairing, RankPlan

_C1 = 0x9E3779B97F4A7C15 - (1 << 64)  # as signed int64
_C2 = 0x632BE59BD9B4E019
_MASK = (1 << 64) - 1


def digest_items(
    plans: Sequence[RankPlan], pairing: BlockPairing, local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
) -> dict[int, tuple[list[DigestItem], list[DigestItem]]]:
    """remote rank -> (items over the local blocks, the same items over the remote blocks)."""
    pairs = pairing.pairs(len(local_blocks), len(remote_blocks))
    out: dict[int, tuple[list[DigestItem], list[DigestItem]]] = {}
    for plan in plans:
        local: list[DigestItem] = []
        remote: list[DigestItem] = []
        for q, segs in enumerate(plan.segments):
            sel = [(li, ri) for li, ri, qq in pairs if qq == q]
            if not sel or not segs:
                continue
            local.append(DigestItem(blocks=[local_blocks[a] for a, _ in sel],
                                    runs=[[s.local_off, s.length] for s in segs]))
            remote.append(DigestItem(blocks=[remote_blocks[b] for _, b in sel],
                                     runs=[[s.remote_off, s.length] for s in segs]))
        out[plan.remote_rank] = (local, remote)
    return out


def digest(region_views: Sequence[Any], items: Sequence[DigestItem]) -> str:
    """Digest of ``items`` over ``region_views`` (uint8 tensors ``[num_blocks, block_len]``,
    one per region, on any device)."""
    import torch

    acc = 0
    pos = 0
    for item in items:
        if not region_views:
            break
        dev = region_views[0].device
        rows = torch.as_tensor(list(item.blocks), dtype=torch.long, device=dev)
        whole = len(item.runs) == 1 and item.runs[0][0] == 0 and item.runs[0][1] == region_views[0].shape[1]
        cols = None if whole else torch.cat(
            [torch.arange(off, off + n, device=dev) for off, n in item.runs])
        data = torch.stack([v.index_select(0, rows) for v in region_views])  # [regions, blocks, len]
        if cols is not None:
            data = data.index_select(2, cols)
        flat = data.reshape(-1)
        if flat.numel() % 8:
            flat = torch.cat([flat, flat.new_zeros(8 - flat.numel() % 8)])
        words = flat.view(torch.int64)
        w = torch.arange(pos, pos + words.numel(), dtype=torch.int64, device=dev)
        w.mul_(_C1).add_(_C2).bitwise_or_(1)  # odd, position-dependent weights
        acc = (acc + int(w.mul_(words).sum().item())) & _MASK
        pos += words.numel()
    return f"{acc:016x}:{pos}"


def region_view(
    base: Any, base_addr: int, addr: int, num_blocks: int, block_len: int, block_stride: int
) -> Any:
    """uint8 ``[num_blocks, block_len]`` view of a region inside a mapped memory tensor."""
    offset = base.storage_offset() + addr - base_addr
    return base.as_strided((num_blocks, block_len), (block_stride, 1), offset)
