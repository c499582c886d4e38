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

Pure planning (``digest_items``) and host-memory digests need no torch (the sidecar never
imports it for DRAM: 2-3 s on first use); VRAM digests import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.protocol import DigestItem
from kvxfer.topology import BlockPairing, RankPlan

_C1 = 0x9E3779B97F4A7C15 - (1 << 64)  # as signed int64
_C2 = 0x632BE59BD9B4E019
_MASK = (1 << 64) - 1


def digest_items(
    plans: Sequence[RankPlan], pairing: BlockPairing, local_blocks: Sequence[int],
    remote_blocks: Sequence[int], state_blocks: tuple[Sequence[int], Sequence[int]] = ((), ()),
) -> dict[tuple[int, int, bool], tuple[list[DigestItem], list[DigestItem], RankPlan]]:
    """(remote pp, remote tp, state plan?) -> (items over the local blocks, the same items over
    the remote blocks, the plan: its region slices say which regions each side digests).
    State plans digest the state block pairs (``state_blocks``: local, remote) whole."""
    pairs = pairing.pairs(len(local_blocks), len(remote_blocks))
    out: dict[tuple[int, int, bool], tuple[list[DigestItem], list[DigestItem], RankPlan]] = {}
    for plan in plans:
        lb, rb = (state_blocks if plan.state else (local_blocks, remote_blocks))
        ps = [(i, i, 0) for i in range(len(lb))] if plan.state else pairs
        local: list[DigestItem] = []
        remote: list[DigestItem] = []
        for q, segs in enumerate(plan.segments):
            sel = [(li, ri) for li, ri, qq in ps if qq == q]
            if not sel or not segs:
                continue
            local.append(DigestItem(blocks=[lb[a] for a, _ in sel],
                                    runs=[[s.local_off, s.length] for s in segs]))
            remote.append(DigestItem(blocks=[rb[b] for _, b in sel],
                                     runs=[[s.remote_off, s.length] for s in segs]))
        if local:
            out[(plan.remote_pp, plan.remote_rank, plan.state)] = (local, remote, plan)
    return out


def digest(region_views: Sequence[Any], items: Sequence[DigestItem]) -> str:
    """Digest of ``items`` over ``region_views``: uint8 ``[num_blocks, block_len]`` numpy
    arrays (host memory: no torch import in the sidecar) or torch tensors (VRAM); both give
    the same value for the same bytes (wrapping 64-bit arithmetic, order-independent). Torch
    sums stay on their device until the end: one ``.item()`` a digest, and one index copy
    (pinned) an item, where each region had both (on an H200 a check cost ~38 ms, whatever
    its size, for 64 regions)."""
    acc = 0
    pos = 0
    sums: dict[Any, Any] = {}  # device -> its running int64 sum (a 0-dim tensor)
    for item in items:
        rows: dict[Any, Any] = {}  # device -> the item's block ids there (one copy to it)
        for view in region_views:
            if isinstance(view, np.ndarray):
                words = _words(view, item)
                acc = (acc + _weighted_sum(words, pos)) & _MASK
            else:
                if view.device not in rows:
                    rows[view.device] = _rows(item, view.device)
                words = _tensor_words(view, item, rows[view.device])
                part = _tensor_weighted_sum(words, pos)
                sums[view.device] = part if view.device not in sums else sums[view.device] + part
            pos += int(words.shape[0])
    for total in sums.values():
        acc = (acc + int(total.item())) & _MASK
    return f"{acc:016x}:{pos}"


def _words(view: np.ndarray, item: DigestItem) -> np.ndarray:
    """The item's bytes of one host region as 64-bit words (zero-padded to a multiple of 8)."""
    data = view[np.asarray(item.blocks, dtype=np.int64)]
    if not (len(item.runs) == 1 and item.runs[0][0] == 0 and item.runs[0][1] == view.shape[1]):
        data = np.concatenate([data[:, off:off + n] for off, n in item.runs], axis=1)
    flat = np.ascontiguousarray(data).reshape(-1)
    if flat.size % 8:
        flat = np.concatenate([flat, np.zeros(8 - flat.size % 8, dtype=np.uint8)])
    return flat.view(np.uint64)


def _rows(item: DigestItem, device: Any) -> Any:
    import torch

    rows = torch.as_tensor(list(item.blocks), dtype=torch.long)
    return rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows


def _tensor_words(view: Any, item: DigestItem, rows: Any) -> Any:
    """The same of one torch region (VRAM), on its device; nothing waits for it."""
    import torch

    data = view.index_select(0, rows)
    if not (len(item.runs) == 1 and item.runs[0][0] == 0 and item.runs[0][1] == view.shape[1]):
        data = torch.cat([data[:, off:off + n] for off, n in item.runs], dim=1)
    flat = data.reshape(-1)
    if flat.numel() % 8:
        flat = torch.cat([flat, flat.new_zeros(8 - flat.numel() % 8)])
    return flat.view(torch.int64)


def _weighted_sum(words: np.ndarray, pos: int) -> int:
    """sum(word * odd position-dependent weight) mod 2**64."""
    n = int(words.shape[0])
    with np.errstate(over="ignore"):
        w = np.arange(pos, pos + n, dtype=np.uint64)
        w *= np.uint64(_C1 & _MASK)
        w += np.uint64(_C2)
        w |= np.uint64(1)
        w *= words
        return int(w.sum(dtype=np.uint64))


def _tensor_weighted_sum(words: Any, pos: int) -> Any:
    """The same on a torch tensor, as a 0-dim int64 tensor on its device (wrapping)."""
    import torch

    w = torch.arange(pos, pos + int(words.shape[0]), dtype=torch.int64, device=words.device)
    w.mul_(_C1).add_(_C2).bitwise_or_(1)
    return w.mul_(words).sum()


def region_view(
    base: Any, base_addr: int, addr: int, num_blocks: int, block_len: int, block_stride: int
) -> Any:
    """uint8 ``[num_blocks, block_len]`` view of a region inside mapped memory (a numpy array
    over host memory or a torch tensor over VRAM starting at ``base_addr``)."""
    if isinstance(base, np.ndarray):
        return np.lib.stride_tricks.as_strided(base[addr - base_addr:], (num_blocks, block_len),
                                               (block_stride, 1), writeable=False)
    offset = base.storage_offset() + addr - base_addr
    return base.as_strided((num_blocks, block_len), (block_stride, 1), offset)
