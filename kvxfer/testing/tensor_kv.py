"""``TensorKV``: one rank's KV cache allocated as a vLLM attention backend allocates it
(``kvxfer.testing.vllm_layouts`` names the layouts), in the connector's shared pool,
registered through the connector's own ``registration_from_tensors``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvxfer.connector.layout import registration_from_tensors
from kvxfer.connector.shm_pool import SharedAllocator
from kvxfer.pool import PoolClient
from kvxfer.protocol import DTYPE_SIZES, RegisterKV
from kvxfer.testing.vllm_layouts import KINDS, VLLM_PERMUTATIONS, Geometry, logical_pattern


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # type: ignore[no-any-return]


class TensorKV:
    """One rank's KV cache as vLLM allocates it for ``kind``, in shared memory."""

    def __init__(self, kind: str, geo: Geometry, directory: str = "/dev/shm",
                 pools: PoolClient | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown KV layout {kind!r}; known: {', '.join(KINDS)}")
        self.kind, self.geo = kind, geo
        self.mla = kind == "mla"
        self.heads = range(0, 1) if self.mla else geo.local_heads
        self.pool = SharedAllocator(directory, min_bytes=1, pools=pools)
        with self.pool:
            self.layers = self._allocate()

    # ------------------------------------------------------------------ allocation

    def _allocate(self) -> list[torch.Tensor]:
        g, kind = self.geo, self.kind
        dt = _torch_dtype(g.dtype)
        L, N, bs, H, hd = g.num_layers, g.num_blocks, g.block_size, len(self.heads), g.head_dim
        if kind in VLLM_PERMUTATIONS:
            perm = VLLM_PERMUTATIONS[kind]
            logical = (L, N, H, bs, 2 * hd)
            phys = torch.zeros([logical[i] for i in perm], dtype=dt)
            inverse = [perm.index(i) for i in range(5)]
            view = phys.permute(*inverse)  # logical [L, B, H, N, C] with physical strides
            return [view[i] for i in range(L)]
        if kind == "flash_attn":
            return [torch.zeros(2, N, bs, H, hd, dtype=dt) for _ in range(L)]
        if kind in ("flashinfer_nhd", "triton"):
            return [torch.zeros(N, 2, bs, H, hd, dtype=dt) for _ in range(L)]
        if kind == "flashinfer_hnd":  # allocated HND, viewed with vLLM's logical NHD shape
            return [torch.zeros(N, 2, H, bs, hd, dtype=dt).permute(0, 1, 3, 2, 4) for _ in range(L)]
        if kind == "cpu":
            return [torch.zeros(N, H, bs, 2 * hd, dtype=dt) for _ in range(L)]
        phys = torch.zeros(L, N, 1, bs, hd, dtype=dt)  # mla: vLLM 0.33's LBHNC [B, 1, N, latent]
        return [phys[i] for i in range(L)]

    @property
    def parts(self) -> int:
        return 1 if self.mla else 2

    def _bytes(self, t: torch.Tensor) -> torch.Tensor:
        """uint8 view, the last dimension split into (elements, itemsize)."""
        item = DTYPE_SIZES[self.geo.dtype]
        return (t.view(torch.uint8) if t.dtype != torch.uint8 else t).unflatten(-1, (-1, item))

    def logical(self, layer: int, part: int) -> torch.Tensor:
        """uint8 view ``[num_blocks, block_size, heads, head_dim, itemsize]`` of one part."""
        g, t = self.geo, self.layers[layer]
        hd = g.head_dim
        if self.kind in VLLM_PERMUTATIONS:  # [B, H, N, C]: K = C[:hd], V = C[hd:]
            return self._bytes(t)[..., part * hd:(part + 1) * hd, :].permute(0, 2, 1, 3, 4)
        if self.kind == "flash_attn":
            return self._bytes(t[part])
        if self.kind in ("flashinfer_nhd", "triton", "flashinfer_hnd"):
            return self._bytes(t[:, part])
        if self.kind == "cpu":  # each head: K^T [hd, bs] then V [bs, hd]
            N, H, bs = g.num_blocks, len(self.heads), g.block_size
            half = self._bytes(t.reshape(N, H, 2 * bs * hd))[:, :, part * bs * hd:(part + 1) * bs * hd]
            if part == 0:  # element [d, token]
                return half.unflatten(2, (hd, bs)).permute(0, 3, 1, 2, 4)
            return half.unflatten(2, (bs, hd)).permute(0, 2, 1, 3, 4)
        return self._bytes(t).permute(0, 2, 1, 3, 4)  # mla: [N, bs, 1, latent, item]

    # ------------------------------------------------------------------ engine API

    def register_message(self) -> RegisterKV:
        g = self.geo
        names = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(self.layers)}

        def memory_of(t: torch.Tensor) -> Any:
            found = self.pool.lookup(t)
            if found is None:
                raise RuntimeError("KV tensor outside the shared pool")
            ref, offset = found
            return ref, ("mem", getattr(ref, "pool", "") or getattr(ref, "path", "")), offset

        return registration_from_tensors(
            names, num_blocks=g.num_blocks, block_size=g.block_size,
            num_kv_heads=1 if self.mla else g.num_kv_heads, local_kv_heads=len(self.heads),
            head_dim=g.head_dim, tp_rank=g.tp_rank, tp_size=g.tp_size, mla=self.mla,
            memory_of=memory_of, fused="kv_per_head" if self.kind == "cpu" else "kv_content",
        )

    def _expected(self, req_id: str, layer: int, part: int, n_blocks: int) -> torch.Tensor:
        g = self.geo
        item = DTYPE_SIZES[g.dtype]
        pat = logical_pattern(req_id, layer, part, 0, n_blocks * g.block_size, self.heads, g.head_dim * item)
        return torch.from_numpy(pat.reshape(n_blocks, g.block_size, len(self.heads), g.head_dim, item))

    def fill(self, req_id: str, blocks: Sequence[int]) -> None:
        idx = torch.as_tensor(list(blocks), dtype=torch.long)
        for layer in range(self.geo.num_layers):
            for part in range(self.parts):
                self.logical(layer, part)[idx] = self._expected(req_id, layer, part, len(blocks))

    def verify(self, req_id: str, blocks: Sequence[int]) -> bool:
        idx = torch.as_tensor(list(blocks), dtype=torch.long)
        for layer in range(self.geo.num_layers):
            for part in range(self.parts):
                got = self.logical(layer, part)[idx]
                if not torch.equal(got, self._expected(req_id, layer, part, len(blocks))):
                    return False
        return True

    def wipe(self, blocks: Sequence[int]) -> None:
        idx = torch.as_tensor(list(blocks), dtype=torch.long)
        for layer in range(self.geo.num_layers):
            for part in range(self.parts):
                self.logical(layer, part)[idx] = 0

    def close(self) -> None:
        self.layers = []
        self.pool.close()
