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

State groups (vLLM's ``MambaSpec``: Mamba, Mamba2, Gated DeltaNet / linear attention, short
conv) hold one request's conv and SSM/recurrent state in one block per request, not KV per
token. The state after ``n`` tokens cannot be rewound, so, as vLLM's NixlConnector does, the
prefill computes ``n - 1`` prompt tokens (``backoff`` 1), the decode loads that state and
computes the last token itself. A state group's list is cut to its state-bearing block (the
last one before any speculative scratch blocks, vLLM's ``clip_ssm_state_blocks``); its
pairs travel apart from the attention pairs (``Recv.state_block_ids``) and move in the
state regions only, whole, between equal TP sizes (heterogeneous TP with state is refused
when the two sidecars plan the read). A model of state layers only (pure Mamba2) moves its
state alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.pairing import Pairs, held_blocks, pair_groups
from kvxfer.protocol import KVGroup

__all__ = ["Group", "Groups", "Pairs", "UnsupportedModel", "held_blocks", "pair_groups", "push_pairs"]


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
    kind: str  # "full" | "sliding_window" | "mla" | "chunked_local" | "state"
    block_size: int
    window: int = 0  # tokens (sliding window), 0: none
    layers: tuple[str, ...] = ()
    state_bytes: int = 0  # state groups: bytes of one request's state per layer
    spec_blocks: int = 0  # state groups: speculative scratch blocks after the state block
    state_kind: str = ""  # state groups: what the state is (e.g. "mamba2: conv (3, 544) ...")
    chunk: int = 0  # chunked local attention: tokens per chunk
    kept: bool = True  # vLLM keeps every block of a running request (a FullAttentionSpec; MLA is one)
    # state groups: vLLM's mamba_type name, its state shapes (per block, this rank's) and item sizes
    mamba_type: str = ""
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_itemsizes: tuple[int, ...] = ()
    state_dtypes: tuple[str, ...] = ()
    # sliding window: tokens vLLM keeps before the window as well (``extra_retained_tokens``:
    # multi-module MTP's lookahead less one); the window's blocks a transfer carries include them
    retained: int = 0

    def skipped(self, tokens: int) -> int:
        """Tokens vLLM no longer keeps once ``tokens`` are computed (its managers'
        ``get_num_skipped_tokens``)."""
        if self.kind == "sliding_window":
            return max(0, tokens - self.window + 1 - self.retained)
        if self.kind == "chunked_local" and self.chunk:
            return tokens // self.chunk * self.chunk
        return 0

    @property
    def window_blocks(self) -> int:
        """Blocks a transfer carries for this group (0: all of the request's)."""
        # (vLLM keeps cdiv(window - 1 + retained, block) + 1 at most: every kept block is carried,
        # or one it keeps is never written here nor zeroed, and enters its prefix cache: a review)
        return _cdiv(self.window + self.retained, self.block_size) + 1 if self.window else 0

    @property
    def is_state(self) -> bool:
        return self.kind == "state"


def _state_group(specs: list[Any], layers: Sequence[str]) -> Group:
    s = specs[0]
    shown = ", ".join(list(layers)[:3]) + (", ..." if len(layers) > 3 else "")
    if not _is(s, "MambaSpec"):
        raise UnsupportedModel(
            f"kvxfer cannot move this model's KV cache: layers {shown} are {type(s).__name__}, neither "
            "attention KV nor Mamba/linear-attention state; not supported")
    sizes = {int(getattr(k, "state_content_size_bytes", 0) or 0) for k in specs}
    if len(sizes) != 1 or not sizes.issubset({n for n in sizes if n > 0}):
        raise UnsupportedModel(f"kvxfer cannot move this model's state: layers {shown} hold states of "
                               f"different sizes {sorted(sizes)}")
    mtype = getattr(getattr(s, "mamba_type", None), "name", "") or str(getattr(s, "mamba_type", "mamba"))
    parts = " + ".join(f"{tuple(sh)} {str(dt).removeprefix('torch.')}"
                       for sh, dt in zip(getattr(s, "shapes", ()), getattr(s, "dtypes", ()), strict=False))
    return Group("state", int(s.block_size), 0, tuple(layers), state_bytes=sizes.pop(),
                 spec_blocks=int(getattr(s, "num_speculative_blocks", 0) or 0),
                 state_kind=f"{mtype.lower()}: {parts}" if parts else mtype.lower(),
                 kept=False,  # (kept, but its state rewritten at every step)
                 mamba_type=mtype.lower(), **_split_of(specs))


def _split_of(specs: list[Any]) -> dict[str, Any]:
    """The state shapes and item sizes the parts are derived from (kvxfer.connector.state_parts),
    when every layer's state is alike and split over TP ranks; else none (equal TP only)."""
    kinds = {(str(getattr(k, "mamba_type", "")),
              tuple(tuple(int(d) for d in sh) for sh in getattr(k, "shapes", ())),
              tuple(int(getattr(d, "itemsize", 0) or 0) for d in getattr(k, "dtypes", ())),
              tuple(str(d).removeprefix("torch.") for d in getattr(k, "dtypes", ())),
              bool(getattr(k, "tp_replicated", False))) for k in specs}
    if len(kinds) != 1:
        return {}
    _, shapes, itemsizes, dtypes, replicated = kinds.pop()
    return {} if replicated else {"state_shapes": shapes, "state_itemsizes": itemsizes,
                                  "state_dtypes": dtypes}


def _group_of(spec: Any, layers: Sequence[str]) -> Group:
    specs = _kinds(spec)
    state = [s for s in specs if not _is(s, "AttentionSpec")]
    if state:
        if len(state) != len(specs):
            raise UnsupportedModel("kvxfer cannot move this model's KV cache: a KV cache group mixes "
                                   "attention and state layers")
        return _state_group(state, layers)
    s = specs[0]
    if _is(s, "SlidingWindowSpec"):
        return Group("sliding_window", int(s.block_size), int(s.sliding_window), tuple(layers), kept=False,
                     retained=int(getattr(s, "extra_retained_tokens", 0) or 0))
    if _is(s, "ChunkedLocalAttentionSpec"):
        return Group("chunked_local", int(s.block_size), 0, tuple(layers),  # moved in full
                     chunk=int(getattr(s, "attention_chunk_size", 0) or 0), kept=False)
    kept = _is(s, "FullAttentionSpec")  # (else an attention kind this module does not know: moved
    # whole, as full attention is, but never held before the prompt ends: vLLM may free its blocks)
    if _is(s, "MLAAttentionSpec"):
        return Group("mla", int(s.block_size), 0, tuple(layers), kept=kept)
    return Group("full", int(s.block_size), 0, tuple(layers), kept=kept)


@dataclass(frozen=True)
class Groups:
    """The transferable groups of an engine's KV cache (``ids``: their indices in vLLM's
    ``kv_cache_groups``; ``total``: how many groups vLLM has in all)."""

    groups: tuple[Group, ...]
    ids: tuple[int, ...]
    total: int

    @classmethod
    def from_config(cls, kv_cache_config: Any) -> Groups:
        """From vLLM's ``KVCacheConfig``; ``UnsupportedModel`` (at engine start-up) for what
        cannot be moved, naming the layers and why."""
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
        if len(ids) > 64:  # (a message carries at most 64 lists: GroupBlockIds)
            raise UnsupportedModel(f"kvxfer cannot move a KV cache of {len(ids)} groups (64 at most)")
        groups = tuple(_group_of(all_groups[i].kv_cache_spec, list(all_groups[i].layer_names)) for i in ids)
        specs = [k for i in ids for k in _kinds(all_groups[i].kv_cache_spec) if _is(k, "AttentionSpec")]
        shapes = {(int(k.block_size), getattr(k, "num_kv_heads", None), getattr(k, "head_size", None),
                   str(getattr(k, "dtype", ""))) for k in specs}
        if len({g.state_bytes for g in groups if g.is_state}) > 1:
            raise UnsupportedModel("kvxfer cannot move this model's state: its state groups differ in size")
        if len(shapes) > 1:  # (block, heads, head size, dtype): one region geometry for all groups
            raise UnsupportedModel(f"kvxfer cannot move this model's KV cache: its groups' KV differs "
                                   f"in shape {sorted(map(str, shapes))}")
        return cls(groups, tuple(ids), len(all_groups))

    @property
    def backoff(self) -> int:
        """Prompt tokens the prefill leaves to the decode (see the module's doc)."""
        return 1 if any(g.kind in ("sliding_window", "chunked_local", "state") for g in self.groups) else 0

    @property
    def grouped(self) -> bool:
        """Block ids travel as one list per group (several groups, a windowed or a state one)."""
        return self.total > 1 or bool(self.backoff)

    @property
    def state(self) -> tuple[bool, ...]:
        """Per transferable group: a state group (its pairs move in the state regions)."""
        return tuple(g.is_state for g in self.groups)

    def at_finish(self, block_ids: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
        """vLLM's per-group lists (all groups) as they will be when its prefill has computed
        ``tokens`` prompt tokens and ends, for push mode, which holds them before: each
        attention group cut to the prompt's blocks (never a lookahead block), the blocks vLLM
        then frees (``remove_skipped_blocks``: outside the window of the next token, left of
        its local chunk) nulled, and ``clip``ped as ``request_finished``'s lists are."""
        kinds = dict(zip(self.ids, self.groups, strict=True))
        out = []
        for i, blocks in enumerate(block_ids):
            g = kinds.get(i)
            lst = list(blocks)
            if g is not None and not g.is_state:
                lst = lst[:_cdiv(tokens, g.block_size)]
                skip = min(g.skipped(tokens) // g.block_size, len(lst))
                lst = [0] * skip + lst[skip:]
            out.append(lst)
        return self.clip(out)

    def chunk_groups(self, block_ids: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
        """Push of a prompt computed in chunks: what an earlier chunk holds of vLLM's lists (all
        groups) so far, per transferable group: a full-attention (or MLA) group's blocks, cut
        to the prompt's, which vLLM keeps until the request ends; nothing of the others (a
        window's blocks vLLM frees as the prompt moves on, a state is whole only at the end:
        both come with the last chunk, ``at_finish``)."""
        return [list(block_ids[i])[:_cdiv(tokens, g.block_size)] if g.kind in ("full", "mla") and g.kept
                else [] for g, i in zip(self.groups, self.ids, strict=True)]

    @property
    def attention_block_size(self) -> int:
        """Tokens per block of the attention groups (one size: ``from_config`` checks)."""
        return next((g.block_size for g in self.groups if not g.is_state), 1)

    @property
    def state_group(self) -> Group | None:
        return next((g for g in self.groups if g.is_state), None)

    def clip(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """vLLM's per-group block lists (all groups) -> the transferable groups' lists, each
        sliding-window group cut to the blocks of its window (the tail), each state group to
        its state-bearing block (the last before the speculative scratch blocks)."""
        if len(block_ids) != self.total:
            raise ValueError(f"{len(block_ids)} block lists for {self.total} KV cache groups")
        out = []
        for g, i in zip(self.groups, self.ids, strict=True):
            blocks = list(block_ids[i])
            n = g.window_blocks
            if g.is_state and blocks:
                scratch = min(g.spec_blocks, len(blocks) - 1)
                blocks = (blocks[:-scratch] if scratch else blocks)[-1:]
            out.append(blocks[-n:] if n and len(blocks) > n else blocks)
        return out

    def registered(self) -> list[KVGroup]:
        """The groups as the sidecar shows them (``kvxfer status``)."""
        return [KVGroup(kind=g.kind, block_size=g.block_size, layers=len(g.layers), window=g.window,
                        state_bytes=g.state_bytes, state_kind=g.state_kind[:256]) for g in self.groups]

    def describe(self) -> str:
        return ", ".join(f"{g.kind}" + (f"(window {g.window})" if g.window else "")
                         + (f"({g.state_kind}; {g.state_bytes} B)" if g.is_state else "")
                         + f" x{len(g.layers)}"
                         for g in self.groups)


def push_pairs(local: Sequence[Sequence[int]], state: Sequence[bool] = ()) -> Pairs:
    """Push mode: the decode's blocks alone, its attention groups' real blocks flat (its sidecar
    learns the prefill's from the prefill's sidecar and pairs them: with one group, the suffix
    of the prefill's; with several, group by group as ``pair_groups`` does, the state too)."""
    return Pairs([b for i, g in enumerate(local) if not (i < len(state) and state[i]) for b in g if b],
                 [], [], [])
