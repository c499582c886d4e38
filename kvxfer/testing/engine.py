"""A synthetic engine worker: a vLLM-shaped paged KV cache in shared memory, driven
through ``SidecarClient`` exactly as a worker would drive it."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvxfer.client import SidecarClient
from kvxfer.memory import CudaKV, SharedKV
from kvxfer.pool import PoolClient
from kvxfer.protocol import KVGroup, KVLayout, Registered, StatePart
from kvxfer.testing.pattern import request_pattern, state_pattern
from kvxfer.testing.vllm_layouts import Geometry

if TYPE_CHECKING:
    from kvxfer.testing.tensor_kv import TensorKV


def make_layout(
    *,
    layers: int = 4,
    num_blocks: int = 64,
    block_size: int = 16,
    heads: int = 8,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    head_layout: str = "NHD",
    model: str = "",
    state_layers: int = 0,
    state_bytes: int = 0,
    state_parts: tuple[StatePart, ...] = (),
    state_kind: str = "synthetic",
) -> KVLayout:
    """A vLLM-like layout; with ``mla`` one latent of ``head_dim`` replicated on every rank
    (``stage_layout`` cuts one pipeline stage out of it)."""
    if mla:
        heads = 1
    return KVLayout(
        num_layers=layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=heads,
        local_kv_heads=1 if mla else max(1, heads // tp_size),
        head_dim=head_dim,
        dtype=dtype,
        kv_parts=1 if mla else 2,
        mla=mla,
        head_layout=head_layout,  # type: ignore[arg-type]
        tp_rank=tp_rank,
        tp_size=tp_size,
        model=model,
        state_regions=state_layers,
        state_bytes=state_bytes if state_layers else 0,
        state_kind=state_kind if state_layers else "",
        state_parts=state_parts if state_layers else (),
    )


def stage_layout(layout: KVLayout, split: list[int], pp_rank: int) -> KVLayout:
    """Pipeline stage ``pp_rank`` of a model of ``layout``'s layers split as ``split`` (layers
    per stage, e.g. ``[3, 1]``)."""
    import msgspec

    assert sum(split) == layout.num_layers, "the split must cover every layer"
    return msgspec.structs.replace(layout, num_layers=split[pp_rank], pp_rank=pp_rank, pp_size=len(split),
                                   first_layer=sum(split[:pp_rank]), total_layers=layout.num_layers)


class SyntheticEngine:
    """One worker rank. Block 0 is reserved, like vLLM's null block.

    ``device="cpu"`` keeps the cache in shared host memory; ``"cuda:N"`` in GPU memory
    handed to the sidecar over CUDA IPC. ``kv_layout`` names one of vLLM's attention
    backend layouts (``kvxfer.testing.vllm_layouts.KINDS``): the cache is then allocated as
    that backend allocates it and registered through the connector's own code; ``layout``
    gives only the sizes, and becomes what the registration derived from the tensors.
    """

    def __init__(self, layout: KVLayout, endpoint: str, *, seed: int = 0, device: str = "cpu",
                 kv_layout: str = "", engine_id: str = "", dp_rank: int = 0,
                 gpu_memory: str = "ipc", contiguous: bool = False, block_outer: bool = False,
                 engine_channel: str = "") -> None:
        """``engine_channel``: "ring" or "zmq" (the connector's setting; "": $KVXFER_ENGINE_CHANNEL,
        else "ring")."""
        self.layout = layout
        self.engine_id = engine_id  # "": the sidecar's; else this rank's engine (a DP rank's "<id>_dp<k>")
        self.dp_rank = dp_rank
        self.device = device
        self.tensors: TensorKV | None = None
        # host memory comes from the sidecar's memory channel, as a connector's does
        # (a GPU engine too with gpu_memory="vmm": the sidecar's CUDA VMM pools)
        self.pools = (PoolClient.for_engine_socket(endpoint)
                      if device == "cpu" or gpu_memory == "vmm" else None)
        self._registration = None
        if kv_layout:
            if device != "cpu":
                raise ValueError("vLLM backend layouts are built in host memory here")
            from kvxfer.testing.tensor_kv import TensorKV
            self.tensors = TensorKV(kv_layout, Geometry(
                num_layers=layout.num_layers, num_blocks=layout.num_blocks, block_size=layout.block_size,
                num_kv_heads=layout.num_kv_heads, tp_rank=layout.tp_rank, tp_size=layout.tp_size,
                head_dim=layout.head_dim, dtype=layout.dtype), pools=self.pools)
            self._registration = self.tensors.register_message()
            self.layout = self._registration.layout
        self.kv: SharedKV | CudaKV | None = (
            None if self.tensors is not None
            else SharedKV.create(layout, self.pools, block_outer=block_outer) if device == "cpu"
            else CudaKV.create(layout, device, self.pools)
        )
        channel = engine_channel or os.environ.get("KVXFER_ENGINE_CHANNEL", "ring")
        self.client = SidecarClient(endpoint, ring=channel == "ring")
        self._free = list(range(1, layout.num_blocks))
        self.contiguous = contiguous  # hand out runs of consecutive ids (a fresh engine's allocator)
        if not contiguous:
            random.Random(seed).shuffle(self._free)  # non-contiguous block ids, as in a busy engine
        self.registered: Registered | None = None
        self.groups: list[KVGroup] | None = None  # vLLM's KV cache groups, as a connector tells them

    def start(self, timeout: float = 60.0) -> Registered:
        """Register (again: after a sidecar restart, its pools are handed back first, as a
        connector worker does, so the same memory is registered)."""
        self.client.ping(timeout)
        if self.registered is not None and self.pools is not None and self.pools.pools:
            self.pools.readopt()
        msg = self._registration if self.kv is None else self.kv.register_message()
        msg = msgspec.structs.replace(msg, engine_id=self.engine_id, dp_rank=self.dp_rank, groups=self.groups)
        self.registered = self.client.register(msg, timeout)
        return self.registered

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} blocks requested, {len(self._free)} free")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)
        if self.contiguous:
            self._free.sort()

    def _index(self, blocks: Sequence[int]) -> Any:
        idx = np.asarray(blocks, dtype=np.int64)
        if self.device == "cpu":
            return idx
        import torch

        return torch.from_numpy(idx).to(self.device)

    def _expected(self, req_id: str, n: int) -> Any:
        pattern = request_pattern(self.layout, req_id, n)
        if self.device == "cpu":
            return pattern
        import torch

        return torch.from_numpy(pattern).to(self.device)

    def fill(self, req_id: str, blocks: Sequence[int]) -> None:
        if self.tensors is not None:
            return self.tensors.fill(req_id, blocks)
        assert self.kv is not None
        self.kv.blocks()[:, :, self._index(blocks), :] = self._expected(req_id, len(blocks))
        self._sync()

    def fill_layers(self, req_id: str, blocks: Sequence[int], layers: range) -> None:
        """Write request ``req_id``'s KV of these layers only (of this rank's stage, counted
        from its first): a prefill computing layer by layer (push mode)."""
        assert isinstance(self.kv, SharedKV), "host memory only"
        sel = slice(layers.start, layers.stop)
        self.kv.blocks()[sel, :, self._index(blocks), :] = self._expected(req_id, len(blocks))[sel]

    def verify_layers(self, req_id: str, blocks: Sequence[int], layers: range) -> bool:
        """These layers of ``blocks`` hold request ``req_id``'s KV (host memory only)."""
        assert isinstance(self.kv, SharedKV), "host memory only"
        sel = slice(layers.start, layers.stop)
        got = self.kv.blocks()[sel, :, self._index(blocks), :]
        return bool(np.array_equal(got, self._expected(req_id, len(blocks))[sel]))

    def verify(self, req_id: str, blocks: Sequence[int]) -> bool:
        if self.tensors is not None:
            return self.tensors.verify(req_id, blocks)
        assert self.kv is not None
        got = self.kv.blocks()[:, :, self._index(blocks), :]
        want = self._expected(req_id, len(blocks))
        if self.device == "cpu":
            return bool(np.array_equal(got, want))
        return bool((got == want).all().item())

    def _state_pattern(self, req_id: str, n: int) -> np.ndarray:
        return state_pattern(self.layout, req_id, n)

    def fill_state(self, req_id: str, blocks: Sequence[int]) -> None:
        """Write request ``req_id``'s state (every state layer) into ``blocks`` (CPU only)."""
        assert isinstance(self.kv, SharedKV)
        idx = np.asarray(blocks, dtype=np.int64)
        self.kv.state_blocks()[:, idx, :] = self._state_pattern(req_id, len(blocks))

    def verify_state(self, req_id: str, blocks: Sequence[int]) -> bool:
        assert isinstance(self.kv, SharedKV)
        got = self.kv.state_blocks()[:, np.asarray(blocks, dtype=np.int64), :]
        return bool(np.array_equal(got, self._state_pattern(req_id, len(blocks))))

    def wipe(self, blocks: Sequence[int]) -> None:
        if self.tensors is not None:
            return self.tensors.wipe(blocks)
        assert self.kv is not None
        self.kv.blocks()[:, :, self._index(blocks), :] = 0
        self._sync()

    def _sync(self) -> None:
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.client.close()
        if self.tensors is not None:
            self.tensors.close()
        if self.kv is not None:
            self.kv.close()
        if self.pools is not None:
            self.pools.close()
