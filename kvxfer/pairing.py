"""A request's block pairs across vLLM's KV cache groups: which of the decode's blocks receive
which of the prefill's (``kvxfer.connector.groups`` says how vLLM's groups hold a hybrid
model's KV and state). Pure: used by the decode's connector (pull: both lists come in
``kv_transfer_params``) and by the decode's sidecar (push: the prefill's lists come from its
sidecar, ``LayersAt.groups``, once it holds them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Pairs:
    """A request's block pairs: attention (``local``/``remote``) and state, flat."""

    local: list[int]
    remote: list[int]
    state_local: list[int]
    state_remote: list[int]


def pair_groups(local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]],
                state: Sequence[bool] = ()) -> Pairs:
    """Per-group block lists of the decode (``local``) and the prefill (``remote``) -> flat
    lists, pair by pair: each group lined up at the tail (the decode's list may be shorter:
    its prefix cache), pairs with a null block (0) on either side skipped; groups flagged in
    ``state`` go to the state lists. ``ValueError`` when the group counts differ or a decode
    list is longer than the prefill's."""
    if len(local) != len(remote):
        raise ValueError(f"the prefill has {len(remote)} KV cache groups, this engine {len(local)}: "
                         "not the same model")
    out = Pairs([], [], [], [])
    for i, (lg, rg) in enumerate(zip(local, remote, strict=True)):
        if len(lg) > len(rg):  # pairing would shift every block of the group: wrong KV
            raise ValueError(f"group {i}: {len(lg)} blocks to load, the prefill holds {len(rg)}")
        is_state = i < len(state) and state[i]
        if is_state and (len(lg) != len(rg) or not all(lg) or not all(rg)):
            # a state is one block, whole: without it the decode would run on another state
            raise ValueError(f"group {i} (state): blocks {list(lg)} to load from {list(rg)}")
        la, ra = (out.state_local, out.state_remote) if is_state else (out.local, out.remote)
        for a, b in zip(lg, list(rg)[len(rg) - len(lg):], strict=True):
            if a and not b:  # (a block this engine keeps, whose KV the prefill no longer has: it
                # would be neither written nor zeroed, and enter the prefix cache: a review)
                raise ValueError(f"group {i}: block {a} to load faces a block the prefill freed")
            if a and b:
                la.append(a)
                ra.append(b)
    return out


def held_blocks(groups: Sequence[Sequence[int]]) -> list[int]:
    """The distinct real blocks of all groups (what the prefill's lease holds)."""
    seen: dict[int, None] = {}
    for g in groups:
        for b in g:
            if b:
                seen.setdefault(b, None)
    return list(seen)


def cut_to_load(theirs: list[list[int]], grouped: bool, tokens: int, block_size: int) -> list[list[int]]:
    """The prefill's block list cut to the blocks of the ``tokens`` this engine loads (one KV
    cache group, position-indexed from the first token): a prefill that computed more (run for
    more than one token, or without the back-off) holds blocks past them, and lists lined up at
    the tail then paired every decode block with the prefill's next one: wrong KV, silently
    (found by a review). Several groups (``grouped``; windows, state) are left as they are."""
    if grouped or block_size <= 0 or tokens <= 0:
        return theirs
    keep = -(-tokens // block_size)
    return [g[:keep] for g in theirs]


def pair_sizes(local: Sequence[int], remote: Sequence[int], first: int, end: int, local_size: int,
               remote_size: int) -> Pairs:
    """One KV cache group whose blocks hold another number of tokens on each side: the decode's
    ``local`` blocks receive tokens ``[first, end)`` (``first``: its own cached prefix), the
    prefill's ``remote`` list starts at token 0. -> the decode's blocks of those tokens and the
    prefill's blocks of the same tokens, which its sidecar pairs by the ratio
    (``kvxfer.topology.BlockPairing``: a larger block holds ``ratio`` smaller ones, from its
    first token). ``ValueError`` when they cannot be paired that way: sizes of which neither
    divides the other, a cached prefix that ends inside a prefill block, too few blocks."""
    if why := sizes_unpaired(local_size, remote_size, first, False):
        raise ValueError(why)
    if not 0 <= first < end:
        raise ValueError(f"no tokens to load ({first}..{end})")
    want = -(-end // local_size) - first // local_size
    lo, hi = first // remote_size, -(-end // remote_size)
    if len(local) < want or len(remote) < hi:
        raise ValueError(f"tokens {first}..{end - 1}: {len(local)} blocks here (of {local_size}) for "
                         f"{want}, the prefill holds {len(remote)} (of {remote_size}) for {hi}")
    mine, theirs = list(local[:want]), list(remote[lo:hi])
    if not all(mine) or not all(theirs):  # (a null block in a full-attention list: not one group)
        raise ValueError(f"tokens {first}..{end - 1}: null blocks in {mine} / {theirs}")
    return Pairs(mine, theirs, [], [])


def sizes_unpaired(local_size: int, remote_size: int, first: int, grouped: bool) -> str:
    """Why a load of tokens from ``first`` on cannot be paired by token between blocks of
    these sizes ("": it can, or the sizes are equal). Known before any block is allocated,
    so that the connector computes such a prompt here rather than fail a load vLLM counts on
    (its default ``kv_load_failure_policy``, "fail", fails the request: found by a review)."""
    if local_size == remote_size:
        return ""
    big, small = max(local_size, remote_size), min(local_size, remote_size)
    if grouped:
        return (f"blocks of {local_size} tokens here, {remote_size} on the prefill, in a model of several "
                "KV cache groups: not supported")
    if small <= 0 or big % small:
        return (f"blocks of {local_size} tokens here, {remote_size} on the prefill: neither size divides "
                "the other")
    if first % local_size or first % remote_size:
        return (f"this engine's cached prefix ends at token {first}, inside a prefill block of {remote_size} "
                "tokens: the blocks cannot be paired")
    return ""
