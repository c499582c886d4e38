"""A decode's load: which of its new blocks receive which of the prefill's (pull: both lists
from ``kv_transfer_params``; push: its sidecar pairs them). Pure; the scheduler side asks
``unpaired`` before it claims the tokens and ``pair_load`` once vLLM gave it blocks."""

from __future__ import annotations

from collections.abc import Sequence

from kvxfer.client import RemoteBlocks
from kvxfer.connector.groups import Pairs, pair_groups, push_pairs
from kvxfer.pairing import cut_to_load, pair_sizes, sizes_unpaired


def unpaired(remote: RemoteBlocks, block_size: int, first: int, groups: int) -> str:
    """Why a load from token ``first`` on could not pair this engine's blocks (``groups``: its
    KV cache groups that move, 1 for a model of one) with the prefill's: another number of
    groups (known from the params alone: claimed, the load failed after allocation, and under
    vLLM's default failure policy the request failed: a review), or block sizes that cannot be
    paired by token (``sizes_unpaired``; "" also when the prefill did not say its size)."""
    theirs = len(remote.groups) or 1
    if not remote.streamed and theirs != groups:
        return f"the prefill holds {theirs} KV cache groups, this engine {groups}: not the same model"
    if not (remote.block_size and block_size):
        return ""
    return sizes_unpaired(block_size, remote.block_size, first, groups > 1 or bool(remote.groups))


def pair_load(mine: list[list[int]], remote: RemoteBlocks, state_groups: Sequence[bool] | None,
              block_size: int, end: int, external: int) -> Pairs:
    """A load's block pairs: this engine's new blocks (``mine``, one list per KV cache group;
    ``state_groups`` None for a single-group model) with the prefill's. One list per group on
    both sides, paired group by group at the tail (a decode list longer than the prefill's
    would shift every block: wrong KV, refused); blocks of another size than the prefill's
    (``remote.block_size``) by token (``pair_sizes``: one group only); push mode's by its
    sidecar (``push_pairs``). ``end``: the prompt tokens loaded, ``external`` of them read.
    ValueError: the prompt is computed here."""
    hybrid = state_groups is not None
    if remote.streamed:
        return push_pairs(mine, state_groups or ())
    if remote.block_size != block_size:
        if why := unpaired(remote, block_size, end - external, len(mine)):
            raise ValueError(why)
        return pair_sizes(mine[0], list(remote.block_ids), end - external, end, block_size, remote.block_size)
    theirs = cut_to_load([list(g) for g in remote.groups] if remote.groups else [list(remote.block_ids)],
                         hybrid, end, block_size)
    return pair_groups(mine, theirs, state_groups or ())
