"""A synthetic engine worker: a vLLM-shaped paged KV cache in shared memory, driven
through ``SidecarClient`` exactly as a worker would drive it."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from kvxfer.client import SidecarClient
from kvxfer.memory import SharedKV
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
) -> KVLayout:
    return KVLayout(
        num_layers=layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=heads,
        local_kv_heads=heads // tp_size,
        head_dim=head_dim,
        dtype=dtype,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


class SyntheticEngine:
    """One worker rank. Block 0 is reserved, like vLLM's null block."""

    def __init__(self, layout: KVLayout, endpoint: str, *, seed: int = 0) -> None:
        self.layout = layout
        self.kv = SharedKV.create(layout)
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

    def fill(self, req_id: str, blocks: Sequence[int]) -> None:
        self.kv.blocks()[:, :, np.asarray(blocks), :] = request_pattern(self.layout, req_id, len(blocks))

    def verify(self, req_id: str, blocks: Sequence[int]) -> bool:
        got = self.kv.blocks()[:, :, np.asarray(blocks), :]
        return bool(np.array_equal(got, request_pattern(self.layout, req_id, len(blocks))))

    def wipe(self, blocks: Sequence[int]) -> None:
        self.kv.blocks()[:, :, np.asarray(blocks), :] = 0

    def close(self) -> None:
        self.client.close()
        self.kv.close()
