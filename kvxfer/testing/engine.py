"""A synthetic engine worker: a vLLM-shaped paged KV cache in shared memory, driven
through ``SidecarClient`` exactly as a worker would drive it."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.client import SidecarClient
from kvxfer.memory import CudaKV, SharedKV
from kvxfer.protocol import KVLayout, Registered
from kvxfer.testing.pattern import request_pattern


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
) -> KVLayout:
    """A vLLM-like layout; with ``mla`` one latent of ``head_dim`` replicated on every rank."""
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
    )


class SyntheticEngine:
    """One worker rank. Block 0 is reserved, like vLLM's null block.

    ``device="cpu"`` keeps the cache in shared host memory; ``"cuda:N"`` in GPU memory
    handed to the sidecar over CUDA IPC.
    """

    def __init__(self, layout: KVLayout, endpoint: str, *, seed: int = 0, device: str = "cpu") -> None:
        self.layout = layout
        self.device = device
        self.kv: SharedKV | CudaKV = (
            SharedKV.create(layout) if device == "cpu" else CudaKV.create(layout, device)
        )
        self.client = SidecarClient(endpoint)
        self._free = list(range(1, layout.num_blocks))
        random.Random(seed).shuffle(self._free)  # non-contiguous block ids, as in a busy engine
        self.registered: Registered | None = None

    def start(self, timeout: float = 60.0) -> Registered:
        self.client.ping(timeout)
        self.registered = self.client.register(self.kv.register_message(), timeout)
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
        self.kv.blocks()[:, :, self._index(blocks), :] = self._expected(req_id, len(blocks))
        self._sync()

    def verify(self, req_id: str, blocks: Sequence[int]) -> bool:
        got = self.kv.blocks()[:, :, self._index(blocks), :]
        want = self._expected(req_id, len(blocks))
        if self.device == "cpu":
            return bool(np.array_equal(got, want))
        return bool((got == want).all().item())

    def wipe(self, blocks: Sequence[int]) -> None:
        self.kv.blocks()[:, :, self._index(blocks), :] = 0
        self._sync()

    def _sync(self) -> None:
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.client.close()
        self.kv.close()
