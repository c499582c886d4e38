"""``kvxfer bench``: kvxfer against raw NIXL and against memcpy, side by side, one run.

Every size is measured by the three methods in turn, repeat after repeat, so drift hits
all of them alike:

* **kvxfer** — engine -> sidecar -> NIXL -> sidecar -> engine: the decode engine sends
  ``Recv`` and the clock stops when ``Done`` arrives (two real ``kvxfer serve`` processes).
* **raw NIXL** — what an in-engine connector does: this process's agent READs the same
  descriptors (strided lists, same block ids) from a second process's agent that maps the
  prefill engine's memory, in one transfer, polling until done. Both agents are configured
  as the sidecars are (progress thread off, ``--nixl-threads``), so the ratio is the cost
  (or gain) of the sidecar alone. (The sidecar splits large reads into chunks in flight at
  once, which UCX's worker threads copy in parallel; one raw request runs on one.)
* **memcpy** — a gather/scatter copy of exactly those blocks inside one process: the
  machine's limit for this access pattern.

Plus: the per-step cost of the connector's calls with 0/16/256 requests in flight, time
to first transfer with a cold and a warm peer, 1..64 concurrent requests, 1..4 decode
engines pulling from one prefill, descriptor preparation for 10k/100k blocks, and what an
integrity check (``--verify-sample``) adds to a verified receive. The sidecars of the main
comparison run with ``--verify-sample 0``; the verification cost is measured apart, with
two decode sidecars (verifying every read, and never) pulling alternately from one prefill.

``--device`` picks where the KV caches live: ``cpu`` (shared host memory), ``cuda[:N]``
(VRAM, registered with the sidecars over CUDA IPC; the raw-NIXL target opens the same IPC
handle, memcpy is a gather/scatter on the GPU), or ``auto`` (the GPU when torch sees one).

This module runs the bench and is ``kvxfer bench``'s entry point; the pieces live beside it:
``bench_targets`` (the geometry, raw NIXL, memcpy), ``bench_measure`` (one function per
measurement) and ``bench_report`` (the machine, the table, the plot).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

from kvxfer.client import RemoteBlocks
from kvxfer.config import Config
from kvxfer.sidecar.nixl_agent import cuda_ucx_defaults
from kvxfer.testing.bench_channel import engine_channel
from kvxfer.testing.bench_measure import (
    _concurrency,
    _desc_prep,
    _fan_in,
    _first_transfer,
    _fixed_cost,
    _layouts,
    _size_row,
    _step_overhead,
    _verify_cost,
    _wait,
)
from kvxfer.testing.bench_report import _machine, plot, print_table
from kvxfer.testing.bench_targets import BENCH_LAYOUTS, RawNixl, _layout
from kvxfer.testing.engine import SyntheticEngine
from kvxfer.testing.procs import SidecarFactory


def resolve_device(device: str) -> str:
    """``auto``: the first GPU when torch sees one, else ``cpu``."""
    if device != "auto":
        return device
    try:
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def run_bench(quick: bool = False, mode: str = "peer", device: str = "cpu",
              nixl_threads: int = Config.nixl_threads, kv_layout: str = "LBNHC") -> dict[str, Any]:
    device = resolve_device(device)
    cuda = device.startswith("cuda")
    if cuda:  # the raw-NIXL agents run with what the sidecars set with --cuda
        cuda_ucx_defaults(os.environ)
    if kv_layout not in BENCH_LAYOUTS:
        raise ValueError(f"--kv-layout must be one of {', '.join(BENCH_LAYOUTS)}, not {kv_layout!r}")
    outer = kv_layout.startswith("BL")
    if outer and cuda:
        raise ValueError("block-outermost layouts are benchmarked in host memory only")
    out: dict[str, Any] = {"machine": _machine(device), "ucx_error_mode": mode, "nixl_threads": nixl_threads,
                           "quick": quick, "kv_layout": kv_layout,
                           "device": device, "memory": "VRAM (CUDA IPC)" if cuda else "shared host memory",
                           "layout": f"{kv_layout}: 32 layers x K/V x 16 tokens x 8 heads x 128 x bf16 "
                                     "(2 MiB/block, " + ("one 2 MiB run per block" if outer
                                                         else "32 KiB descriptors")
                                     + "), random non-contiguous blocks"}
    base = ["--ucx-error-mode", mode, "--cuda", "on" if cuda else "off", "--nixl-threads", str(nixl_threads)]
    serve = [*base, "--verify-sample", "0"]
    with SidecarFactory() as f:
        out.update(_main_comparison(f, serve, quick, mode, nixl_threads, device, kv_layout))
        if not cuda:
            out["layouts"] = _layouts(f, serve, 3 if quick else 5)
        out["step_overhead"] = _step_overhead(f, [0, 16] if quick else [0, 16, 256])
        out["engine_channel"] = engine_channel(f.start("bench-chan", *serve).endpoint, 200 if quick else 2000)
        out["fan_in"] = _fan_in(f, [1, 2] if quick else [1, 2, 4], serve, device)
        out["verify_cost"] = _verify_cost(f, [1, 8] if quick else [1, 8, 32], 3 if quick else 7, base,
                                          device)
    out["descriptor_prep_ms"] = _desc_prep([10_000] if quick else [10_000, 100_000], mode)
    _summarize(out)
    return out


def _main_comparison(f: SidecarFactory, serve: list[str], quick: bool, mode: str, nixl_threads: int,
                     device: str, kv_layout: str) -> dict[str, Any]:
    """kvxfer, raw NIXL and memcpy per size on one prefill/decode pair of sidecars, then the
    fixed cost, the first transfer and concurrency on the same pair."""
    sizes = [1, 8, 32] if quick else [1, 8, 32, 128, 256]
    repeats = 3 if quick else 5
    nb = max(sizes) * 2 + 2
    outer = kv_layout.startswith("BL")
    lay = _layout(nb, kv_layout)
    out: dict[str, Any] = {}
    ps, ds = f.start("bench-p", *serve), f.start("bench-d", *serve)
    p = SyntheticEngine(lay, ps.endpoint, seed=1, device=device, block_outer=outer)
    d = SyntheticEngine(lay, ds.endpoint, seed=2, device=device, block_outer=outer)
    raw = None
    try:
        reg = p.start()
        d.start()
        rem = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, [])
        pb_all, db_all = p.allocate(nb - 2), d.allocate(nb - 2)  # shuffled: non-contiguous
        p.fill("bench", pb_all)
        raw = RawNixl(p.kv, d.kv, mode, nixl_threads)
        d.client.recv("warmup", [], rem)
        _wait(d, 1)
        out["sizes"] = [_size_row(p, d, raw, reg, pb_all[:n], db_all[:n], n, repeats) for n in sizes]
        out["fixed_cost_us"] = _fixed_cost(p, d, raw, reg, pb_all, db_all, 10 if quick else 40)
        out["fixed_cost_us_p50"] = out["fixed_cost_us"]["p50"]
        out["first_transfer_ms_cold"], out["first_transfer_ms_warm"] = _first_transfer(
            ds.control, d, p, rem, pb_all, db_all)
        out["concurrency"] = _concurrency(p, d, reg, pb_all, db_all, [1, 8] if quick else [1, 8, 32, 64])
    finally:
        if raw is not None:
            raw.close()
        p.close()
        d.close()
    return out


def _summarize(out: dict[str, Any]) -> None:
    """The headline numbers: throughput ratios of the large sizes, the busiest step overhead."""
    large = [r for r in out["sizes"] if r["bytes"] >= 16 << 20]
    huge = [r for r in out["sizes"] if r["bytes"] >= 256 << 20] or out["sizes"][-1:]
    out["throughput_ratio_vs_raw_nixl"] = statistics.median(r["ratio_vs_raw_nixl"] for r in large)
    out["throughput_ratio_vs_memcpy"] = statistics.median(r["ratio_vs_memcpy"] for r in huge)
    top = out["step_overhead"][-1]
    out["step_overhead_us_p50"], out["step_overhead_us_p99"] = top["p50_us"], top["p99_us"]


def main(args: Any) -> int:
    res = run_bench(quick=args.quick, mode=args.ucx_error_mode, device=args.device,
                    nixl_threads=args.nixl_threads, kv_layout=args.kv_layout)
    print_table(res)
    if args.plot:
        plot(res, args.plot)
        print(f"  plot: {args.plot}")
    if args.json:
        print(json.dumps(res))
    return 0
