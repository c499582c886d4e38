"""vLLM's KV cache groups as the connector moves them (hybrid models). vLLM-free: it reads
vLLM's ``KVCacheConfig`` by attribute, so it runs (and is tested) without vLLM.

With the hybrid KV cache manager on (the connector declares ``SupportsHMA``), vLLM keeps one
block table per *group* of layers: a sliding-window model has a full-attention group and one
or more sliding-window groups, all drawing block ids from one block pool, and every KV cache
tensor is shared by one layer of each group (block ``b`` of a tensor belongs to whichever
group allocated ``b``). So a request moves as one flat list of block pairs: group by group,
the decode's blocks of a group paired with the prefill's blocks of the same group, read
from every (distinct) tensor; a pair of groups lines up at the tail (the newest tokens),
and a pair with vLLM's null block (id 0) on either side is skipped.

Sliding-window groups move only the blocks inside the window, as vLLM's NixlConnector
does: ``cdiv(window, block_size) + 1`` blocks at the tail (one more than the window covers,
for a window that does not start on a block boundary).

With a windowed group the prefill stops one token short of the prompt (``backoff``) and
the decode loads the rest but that token: vLLM frees the blocks that fell out of the window
of the last *computed* token, and the decode recomputes the prompt's last token, whose
window reaches one position further back. Without it, a prompt of ``N`` tokens with
``N % block_size == (window - 1) % block_size`` lost the block holding position ``N - window``
on both sides (found by review, 7 of 30 such prompts gave other tokens than one engine).
NixlConnector backs off only for Mamba and bounded-replay windows.

Models with state layers (Mamba, Mamba2, Gated DeltaNet / linear attention: per-request
conv and SSM state, not paged KV) are refused when the engine starts, with a message that
says which layers and why; moving their state is not built yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class UnsupportedModel(ValueError):
    """The model's KV cache has layers kvxfer cannot move; raised at engine start-up."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kinds(spec: Any) -> list[Any]:
    """The per-layer specs behind a group's spec (vLLM's UniformTypeKVCacheSpecs wraps several)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) else [spec]


def _is(spec: Any, name: str) -> bool:
    return any(c.__name__ == name for c in type(spec).__mro__)


@dataclass(frozen=True)
class Group:
    kind: str  # "full" | "sliding_window" | "mla" | "chunked_local"
    block_size: int
    window: int = 0  # tokens (sliding window), 0: none
    layers: tuple[str, ...] = ()

    @property
    def window_blocks(self) -> int:
        """Blocks a transfer carries for this group (0: all of the request's)."""
        return _cdiv(self.window, self.block_size) + 1 if self.window else 0


def _group_of(spec: Any, layers: Sequence[str], pure_state: bool = False) -> Group:
    specs = _kinds(spec)
    state = [s for s in specs if not _is(s, "AttentionSpec")]
    if state:
        kind = type(state[0]).__name__
        shown = ", ".join(list(layers)[:3]) + (", ..." if len(layers) > 3 else "")
        what = ("Mamba/linear-attention state (per-request conv and SSM state, not paged KV)"
                if "Mamba" in kind else "not attention KV")
        instead = ("Serve it without P/D (vLLM's NixlConnector cannot move a model without "
                   "attention layers either)." if pure_state
                   else "Serve it with vLLM's NixlConnector, or without P/D.")
        raise UnsupportedModel(
            f"kvxfer cannot move this model's KV cache: layers {shown} are {kind}: {what}. "
            f"kvxfer moves attention KV (full, sliding-window, MLA) only; moving state is not built "
            f"yet. {instead}")
    s = specs[0]
    if _is(s, "SlidingWindowSpec"):
        return Group("sliding_window", int(s.block_size), int(s.sliding_window), tuple(layers))
    if _is(s, "ChunkedLocalAttentionSpec"):
        return Group("chunked_local", int(s.block_size), 0, tuple(layers))  # moved in full
    if _is(s, "MLAAttentionSpec"):
        return Group("mla", int(s.block_size), 0, tuple(layers))
    return Group("full", int(s.block_size), 0, tuple(layers))


@dataclass(frozen=True)
class Groups:
    """The transferable groups of an engine's KV cache (``ids``: their indices in vLLM's
    ``kv_cache_groups``; ``total``: how many groups vLLM has in all)."""

    groups: tuple[Group, ...]
    ids: tuple[int, ...]
    total: int

    @classmethod
    def from_config(cls, kv_cache_config: Any) -> Groups:
        """From vLLM's ``KVCacheConfig``; ``UnsupportedModel`` for state layers."""
        all_groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        ids = [i for i, g in enumerate(all_groups) if getattr(g, "enable_kv_transfer", True)]
        for i in ids:
            if getattr(all_groups[i], "host_resident", False):
                raise UnsupportedModel("kvxfer cannot move this model's KV cache: a KV cache group lives "
                                       "in a separate host pool (HiSparse); not supported")
            for k in _kinds(all_groups[i].kv_cache_spec):
                if getattr(k, "prefix_replay_tokens", 0):
                    raise UnsupportedModel("kvxfer cannot move this model's KV cache: a sliding window "
                                           "with bounded prefix replay is not supported yet")
        specs = [k for i in ids for k in _kinds(all_groups[i].kv_cache_spec)]
        pure_state = not any(_is(k, "AttentionSpec") for k in specs)
        groups = tuple(_group_of(all_groups[i].kv_cache_spec, list(all_groups[i].layer_names), pure_state)
                       for i in ids)
        shapes = {(int(k.block_size), getattr(k, "num_kv_heads", None), getattr(k, "head_size", None),
                   str(getattr(k, "dtype", ""))) for k in specs}
        if len(shapes) > 1:  # (block, heads, head size, dtype): one region geometry for all groups
            raise UnsupportedModel(f"kvxfer cannot move this model's KV cache: its groups' KV differs "
                                   f"in shape {sorted(map(str, shapes))}")
        return cls(groups, tuple(ids), len(all_groups))

    @property
    def backoff(self) -> int:
        """Prompt tokens the prefill leaves to the decode (see the module's doc)."""
        return 1 if any(g.kind in ("sliding_window", "chunked_local") for g in self.groups) else 0

    @property
    def grouped(self) -> bool:
        """Block ids travel as one list per group (several groups, or a windowed one)."""
        return self.total > 1 or bool(self.backoff)

    def clip(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """vLLM's per-group block lists (all groups) -> the transferable groups' lists, each
        sliding-window group cut to the blocks of its window (the tail)."""
        if len(block_ids) != self.total:
            raise ValueError(f"{len(block_ids)} block lists for {self.total} KV cache groups")
        out = []
        for g, i in zip(self.groups, self.ids, strict=True):
            blocks = list(block_ids[i])
            n = g.window_blocks
            out.append(blocks[-n:] if n and len(blocks) > n else blocks)
        return out

    def describe(self) -> str:
        return ", ".join(f"{g.kind}" + (f"(window {g.window})" if g.window else "") + f" x{len(g.layers)}"
                         for g in self.groups)


def pair_groups(local: Sequence[Sequence[int]],
                remote: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Per-group block lists of the decode (``local``) and the prefill (``remote``) -> one flat
    list each, pair by pair: each group lined up at the tail (the decode's list may be shorter:
    its prefix cache), pairs with a null block (0) on either side skipped. ``ValueError`` when
    the group counts differ or a decode list is longer than the prefill's."""
    if len(local) != len(remote):
        raise ValueError(f"the prefill has {len(remote)} KV cache groups, this engine {len(local)}: "
                         "not the same model")
    lflat: list[int] = []
    rflat: list[int] = []
    for i, (lg, rg) in enumerate(zip(local, remote, strict=True)):
        if len(lg) > len(rg):  # pairing would shift every block of the group: wrong KV
            raise ValueError(f"group {i}: {len(lg)} blocks to load, the prefill holds {len(rg)}")
        n = len(lg)
        for a, b in zip(list(lg)[len(lg) - n:], list(rg)[len(rg) - n:], strict=True):
            if a and b:
                lflat.append(a)
                rflat.append(b)
    return lflat, rflat


def held_blocks(groups: Sequence[Sequence[int]]) -> list[int]:
    """The distinct real blocks of all groups (what the prefill's lease holds)."""
    seen: dict[int, None] = {}
    for g in groups:
        for b in g:
            if b:
                seen.setdefault(b, None)
    return list(seen)
