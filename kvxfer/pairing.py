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
