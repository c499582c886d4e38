"""The measuring stages of ``make gpu-check`` (``kvxfer.testing.gpu_check``): ``lanes``,
``bench-<kind>`` and ``knobs``, built on ``kvxfer.testing.gpu_xfer`` (memory, pattern),
``gpu_pair`` (raw NIXL) and ``gpu_lanes`` (the lanes stage's per-kind process).

* ``raw_sweep``: raw NIXL READs between two engine processes (``gpu_pair.Pair``), the
  same-device gather/scatter copy and the staged variant (gather into a contiguous buffer on
  the sender's own CUDA stream, one transfer, scatter on the receiver's), per layout and
  size; the first transfer with a cold peer, then warm.
* ``kvxfer_sweep``: the same blocks through two real ``kvxfer serve`` processes and
  synthetic engines, Recv sent -> Done received, cold then warm.
* ``stage_*``: the stages, each returning one JSON-able dict with ``summary_lines``, and
  ``emit``-ting what it has so far (a stage killed at its deadline still leaves numbers).

Every repeat is verified (every byte of the destination against the source's pattern).
Written on a machine without a GPU: the dry run moves host memory through the same code.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from kvxfer.testing.gpu_lanes import parse_proto_info
from kvxfer.testing.gpu_pair import Pair
from kvxfer.testing.gpu_tables import bench_rows, descriptor_cost_dominates, staging_line, table_lines
from kvxfer.testing.gpu_xfer import (
    BLOCK,
    LAYOUTS,
    REGIONS,
    XFER_TIMEOUT_S,
    Unavailable,
    _ordinal,
    block_ids,
    fill,
    too_slow,
    verify,
    vmm_allocation,
    wipe,
)

# --------------------------------------------------------------------------- raw NIXL


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def raw_sweep(kind: str, sizes: list[int], repeats: int, *, device: str, mode: str = "peer", threads: int = 2,
              env: dict[str, str] | None = None, layouts: tuple[str, ...] = LAYOUTS, staging: bool = True,
              copy: bool = True, emit: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Raw NIXL READs (agents in the two engine processes), the same-device copy and the
    staged variant, per layout and size, every repeat verified. ``sizes`` in 2 MiB blocks."""
    nb = max(sizes) + 2
    out: dict[str, Any] = {"kind": kind, "rows": []}
    src_ids, dst_ids = block_ids(nb, 1), block_ids(nb, 2)
    with Pair(kind, nb, device=device, mode=mode, threads=threads, env=env,
              stage_blocks=max(sizes) if staging else 0) as pair:
        out["memory"] = {"target": pair.hello[0]["info"], "initiator": pair.hello[1]["info"]}
        pair.target("fill", 1)
        # first transfer: a cold peer (UCX endpoint wire-up inside it), then warm
        cold = pair.initiator("xfer", "READ", "LBNHC", src_ids[:1], dst_ids[:1])
        warm = [pair.initiator("xfer", "READ", "LBNHC", src_ids[:1], dst_ids[:1]) for _ in range(3)]
        out["first_transfer_ms"] = {"cold": round(cold * 1e3, 3), "warm": _ms(warm)}
        if pair.initiator("verify", 1, src_ids[:1], dst_ids[:1], "LBNHC"):
            raise RuntimeError("raw NIXL: the first block arrived wrong")
        for layout in layouts:
            last: tuple[int, float] | None = None
            for n in sizes:
                s, d = src_ids[:n], dst_ids[:n]
                row: dict[str, Any] = {"layout": layout, "blocks": n, "bytes": n * BLOCK,
                                       "descriptors": n * (1 if layout == "BLNHC" else REGIONS)}
                if too_slow(last, n * BLOCK, row):
                    out["rows"].append(row)
                    continue
                ts = []
                for _ in range(repeats):
                    pair.initiator("wipe")
                    ts.append(pair.initiator("xfer", "READ", layout, s, d))
                    bad = pair.initiator("verify", 1, s, d, layout)
                    if bad:
                        raise RuntimeError(f"raw NIXL READ {layout} {n} blocks: {bad} bytes wrong")
                row["raw_nixl_gbps"], row["raw_nixl_ms"] = _gbps(n * BLOCK, ts), _ms(ts)
                last = (n * BLOCK, statistics.median(ts))
                if copy:
                    cs = []
                    for _ in range(repeats):
                        pair.initiator("wipe")
                        cs.append(pair.initiator("copy", 3, layout, s, d))
                        if pair.initiator("verify", 3, s, d, layout):
                            raise RuntimeError(f"copy {layout} {n} blocks: bytes wrong")
                    row["copy_gbps"], row["copy_ms"] = _gbps(n * BLOCK, cs), _ms(cs)
                if staging:
                    row.update(_staged(pair, layout, s, d, repeats))
                out["rows"].append(row)
                if emit:
                    emit(out)
    return out


def _staged(pair: Pair, layout: str, s: list[int], d: list[int], repeats: int) -> dict[str, Any]:
    """The staged variant of one raw cell: gather, one READ, scatter; every repeat verified."""
    tot, parts = [], []
    for _ in range(repeats):
        pair.initiator("wipe")
        t0 = time.perf_counter()
        g = pair.target("gather", layout, s)
        r, sc = pair.initiator("staged_read", layout, d)
        tot.append(time.perf_counter() - t0)
        parts.append((g, r, sc))
        if pair.initiator("verify", 1, s, d, layout):
            raise RuntimeError(f"staged {layout} {len(s)} blocks: bytes wrong")
    return {"staged_gbps": _gbps(len(s) * BLOCK, tot), "staged_ms": _ms(tot),
            "staged_parts_ms": {k: _ms([p[i] for p in parts])
                                for i, k in enumerate(("gather", "read", "scatter"))}}


# --------------------------------------------------------------------------- kvxfer through its sidecars


def _kv_layout(nb: int) -> Any:
    from kvxfer.testing.engine import make_layout

    return make_layout(layers=32, num_blocks=nb, block_size=16, heads=8, head_dim=128,
                       head_layout="NHD")


def outer_regions(layout: Any) -> list[Any]:
    """The regions of a block-outermost cache (as ``kvxfer.memory`` registers a host one)."""
    from kvxfer.protocol import KVRegion

    bl = layout.region_block_len
    return [KVRegion(memory=0, offset=i * bl, block_len=bl, block_stride=layout.num_regions * bl)
            for i in range(layout.num_regions)]


class _OuterCudaKV:
    """A block-outermost KV cache in VRAM for ``SyntheticEngine`` (its CudaKV is layer-outermost
    only): ``[num_blocks, layers, K/V, block_len]``, registered as vLLM's BL* layouts are."""

    def __init__(self, layout: Any, device: str, pools: Any) -> None:
        import torch

        from kvxfer.memory import dense_bytes, gpu_pool_tensor

        self.layout = layout
        self.nbytes = dense_bytes(layout)
        self.pool = None
        self._pools = pools
        if pools is not None:
            self.pool, self.tensor = gpu_pool_tensor(pools, self.nbytes, "kv outer", _ordinal(device))
        else:
            self.tensor = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)

    def blocks(self) -> Any:
        lay = self.layout
        return self.tensor.view(lay.num_blocks, lay.num_layers, lay.kv_parts, lay.region_block_len
                                ).permute(1, 2, 0, 3)

    def register_message(self) -> Any:
        from kvxfer.memory import cuda_ipc_memory
        from kvxfer.protocol import PoolMemory, RegisterKV

        mem = (PoolMemory(pool=self.pool.id, size=self.nbytes) if self.pool is not None
               else cuda_ipc_memory(self.tensor))
        return RegisterKV(layout=self.layout, memory=[mem], regions=outer_regions(self.layout))

    def close(self) -> None:
        self.tensor = None
        if self.pool is not None:
            self._pools.free(self.pool)
            self.pool = None


def _engine(layout: str, nb: int, endpoint: str, seed: int, kind: str, device: str) -> Any:
    from kvxfer.testing.engine import SyntheticEngine

    lay = _kv_layout(nb)
    outer = layout == "BLNHC"
    if kind == "dram":
        return SyntheticEngine(lay, endpoint, seed=seed, block_outer=outer)
    gm = "ipc" if kind == "ipc" else "vmm"
    eng = SyntheticEngine(lay, endpoint, seed=seed, device=device, gpu_memory=gm)
    if outer:
        eng.kv.close()
        eng.kv = _OuterCudaKV(lay, device, eng.pools)
    return eng


def _flat(eng: Any) -> Any:
    kv = eng.kv
    return kv.data if hasattr(kv, "data") else kv.tensor.reshape(-1)  # (contiguous: a view)


def kvxfer_sweep(kind: str, layout: str, sizes: list[int], repeats: int, *, device: str, mode: str = "peer",
                 threads: int = 2, chunk_mib: int = 64, env: dict[str, str] | None = None,
                 vram_staging_mib: int | None = None,
                 emit: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """kvxfer's READs through two ``kvxfer serve`` processes, Recv sent -> Done received, the
    first with a cold peer (handshake and wire-up), then warm; every repeat verified.
    ``vram_staging_mib``: the sidecars' VRAM arenas (None: their default; 0: read directly)."""
    from kvxfer.testing.procs import SidecarFactory, free_port

    nb = max(sizes) + 2
    cuda = kind != "dram"
    serve = ["--ucx-error-mode", mode, "--cuda", "on" if cuda else "off", "--nixl-threads", str(threads),
             "--chunk-mib", str(chunk_mib), "--verify-sample", "0"]
    if vram_staging_mib is not None:
        serve += ["--vram-staging-mib", str(vram_staging_mib)]
    out: dict[str, Any] = {"kind": kind, "layout": layout, "serve": serve, "env": env or {}, "rows": []}
    with SidecarFactory() as f:
        ps = f.start("gc-p", *serve, env=env, metrics_port=free_port())
        ds = f.start("gc-d", *serve, env=env, metrics_port=free_port())
        p = d = None
        try:
            p = _engine(layout, nb, ps.endpoint, 1, kind, device)
            d = _engine(layout, nb, ds.endpoint, 2, kind, device)
            warm: dict[str, Any] = {}  # (the metrics once the first reads were done: the sizes' own)
            _kvxfer_reads(p, d, ds, nb, layout, sizes, repeats, out, emit,
                          lambda: warm.update(_staging_seen(ps, ds)))
            out["staging"], out["staging_warm"] = _staging_seen(ps, ds), warm
            log = ds.log() + ps.log()
            out["pool_handles"] = ("posix_fd only (fabric refused)" if "no fabric handles here" in log
                                   else "as the driver allowed" if kind.startswith("vmm") else "")
        finally:
            for e in (p, d):
                if e is not None:
                    e.close()
    return out


def _staging_seen(ps: Any, ds: Any) -> dict[str, Any]:
    """How the sidecars staged (their metrics): whether kvxfer's column measured staged reads
    (the 2026-11-28 H200 run's arenas all failed, and its numbers were the direct path's)."""
    seen: dict[str, Any] = {}
    for side, sc in (("prefill", ps), ("decode", ds)):
        try:
            got = sc.scrape()
        except OSError as e:
            seen[side] = {"error": str(e)}
            continue
        seen[side] = {k.removeprefix("kvxfer_"): v for k, v in got.items()
                      if k.startswith(("kvxfer_staged_", "kvxfer_staging_arena"))}
    return seen


def _kvxfer_reads(p: Any, d: Any, ds: Any, nb: int, layout: str, sizes: list[int], repeats: int,
                  out: dict[str, Any], emit: Callable[[dict[str, Any]], None] | None,
                  warm_done: Callable[[], None] = lambda: None) -> None:
    """``kvxfer_sweep``'s measurements: the prefill engine ``p`` and the decode engine ``d``
    (its sidecar ``ds``) started, then the cold and warm first transfers and each size, into
    ``out``."""
    from kvxfer.client import RemoteBlocks

    reg = p.start()
    d.start()
    src, dst = _flat(p), _flat(d)
    fill(src, 1)
    pb, db = p.allocate(nb - 1), d.allocate(nb - 1)  # shuffled: non-contiguous
    # (the engine's block ids index the same [blocks] axis the pattern was written over)

    def read(name: str, s: list[int], dd: list[int]) -> float:
        wipe(dst)
        p.client.hold(name, s, lease_s=120)
        t0 = time.perf_counter()
        rem = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, s)
        d.client.recv(name, dd, rem)
        got = d.client.wait_until(lambda a: bool(a.done or a.failed), XFER_TIMEOUT_S)
        took = time.perf_counter() - t0
        if got.failed or not got.done:
            why = (f"failed: {got.failed[0].code} {got.failed[0].reason}" if got.failed
                   else f"no Done in {XFER_TIMEOUT_S:.0f} s")
            raise RuntimeError(f"kvxfer read {name} ({len(s)} blocks) {why}\n"
                               f"decode sidecar log: {ds.log()[-1500:]}")
        bad = verify(dst, 1, s, dd, nb, layout)
        if bad:
            raise RuntimeError(f"kvxfer read {name}: {bad} bytes wrong")
        descs[:] = [got.done[0].descriptors]
        return took

    descs = [0]

    cold = read("cold", pb[:1], db[:1])
    warm = [read(f"warm{i}", pb[:1], db[:1]) for i in range(3)]
    out["first_transfer_ms"] = {"cold": round(cold * 1e3, 3), "warm": _ms(warm)}
    warm_done()
    last: tuple[int, float] | None = None
    for n in sizes:
        row: dict[str, Any] = {"layout": layout, "blocks": n, "bytes": n * BLOCK}
        if not too_slow(last, n * BLOCK, row):
            ts = [read(f"s{n}-{r}", pb[:n], db[:n]) for r in range(repeats)]
            row.update(kvxfer_gbps=_gbps(n * BLOCK, ts), kvxfer_ms=_ms(ts), kvxfer_descriptors=descs[0])
            last = (n * BLOCK, statistics.median(ts))
        out["rows"].append(row)
        if emit:
            emit(out)


# --------------------------------------------------------------------------- stages


def stage_bench(kind: str, dry: bool, device: str, emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Raw NIXL, copy, staging and kvxfer for one memory kind; 2 MiB .. 1 GiB, both layouts."""
    if dry and kind != "ipc":
        return _dry_vmm(kind)
    raw_mem, kx_mem = ("torch_cpu", "dram") if dry else (kind, kind)
    sizes = [1] if dry else [1, 4, 16, 64, 256, 512]
    repeats = 1 if dry else 3
    res: dict[str, Any] = {"kind": kind, "memory": raw_mem, "sizes_mib": [n * 2 for n in sizes],
                           "repeats": repeats}
    if dry:
        res["stand_in"] = ("host memory (dry run: no GPU here): raw NIXL on torch tensors, kvxfer on its "
                           "shared host memory; the GPU kinds run the same code on VRAM")
    res["raw"], res["kvxfer"] = {}, []

    def publish() -> None:  # what there is so far (a stage killed at its deadline leaves it)
        res["rows"] = bench_rows(res["raw"], res["kvxfer"])
        emit(res)

    def raw_progress(r: dict[str, Any]) -> None:
        res["raw"] = r
        publish()

    try:
        res["raw"] = raw_sweep(raw_mem, sizes, repeats, device=device, emit=raw_progress)
    except Unavailable as e:
        return {"status": "unavailable", "reason": str(e), "kind": kind}
    except Exception as e:  # (kvxfer's numbers are still worth having)
        res["raw"]["error"] = f"{type(e).__name__}: {e}"[:3000]
    for layout in LAYOUTS:
        cur: dict[str, Any] = {"layout": layout, "rows": []}
        res["kvxfer"].append(cur)

        def progress(r: dict[str, Any], cur: dict[str, Any] = cur) -> None:
            cur.update(r)
            publish()

        try:
            cur.update(kvxfer_sweep(kx_mem, layout, sizes, repeats, device=device, emit=progress))
        except Exception as e:  # one layout failing still leaves the other's numbers
            cur["error"] = f"{type(e).__name__}: {e}"[:3000]
        publish()
    rows = res["rows"] = bench_rows(res["raw"], res["kvxfer"])
    res["per_descriptor_cost_dominates"] = descriptor_cost_dominates(rows)
    first = {"raw_nixl": res["raw"].get("first_transfer_ms"),
             **{f"kvxfer_{k['layout']}": k.get("first_transfer_ms") for k in res["kvxfer"]}}
    res["first_transfer_ms"] = first
    errors = [f"kvxfer {k['layout']}: {k['error'][:300]}" for k in res["kvxfer"] if k.get("error")]
    if res["raw"].get("error"):
        errors.insert(0, f"raw NIXL: {res['raw']['error'][:300]}")
    lines = [f"  memory {raw_mem}: " + json.dumps(res["raw"].get("memory", {}))[:300], *table_lines(rows),
             "  first transfer ms (cold/warm): " + ", ".join(
                 f"{k} {v['cold']}/{v['warm']}" for k, v in first.items() if v),
             f"  per-descriptor cost dominates (32 KiB vs 2 MiB descriptors, raw): "
             f"{res['per_descriptor_cost_dominates']}", *(staging_line(k) for k in res["kvxfer"]), *errors]
    res["summary_lines"] = lines
    if errors:
        res["status"] = "failed"
        res["reason"] = "; ".join(errors)[:500]
    return res


def _dry_vmm(kind: str) -> dict[str, Any]:
    """A dry run's VMM stage: the allocation path against the fake driver (fabric refused,
    as on a machine without an IMEX channel); the transfers are the ipc stage's code."""
    from kvxfer.testing.gpu_probe import dry_driver

    try:
        v, fd, size, info = vmm_allocation(kind, 8 * BLOCK, 0, dry_driver(fabric_permitted=False))
    except Unavailable as e:
        return {"status": "unavailable", "reason": f"{e} (fake driver)", "kind": kind}
    os.close(fd)
    return {"status": "dry", "kind": kind, "allocation": info,
            "summary_lines": [f"  fake driver: {kind} allocation {info['handles']}, {size} bytes; "
                              "transfers not run (no GPU): the ipc stage ran their code on DRAM"]}


KNOBS: list[tuple[str, dict[str, str], dict[str, int]]] = [
    ("baseline", {}, {}),
    ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}, {}),
    ("UCX_MEMTYPE_CACHE=y", {"UCX_MEMTYPE_CACHE": "y"}, {}),
    ("nixl threads 0", {}, {"threads": 0}),
    ("nixl threads 4", {}, {"threads": 4}),
    ("chunk 16 MiB", {}, {"chunk_mib": 16}),
    ("chunk 256 MiB", {}, {"chunk_mib": 256}),
    ("VRAM staging off", {}, {"vram_staging_mib": 0}),  # (every read direct, as before 2026-11-28)
    ("VRAM staging 64 MiB", {}, {"vram_staging_mib": 64}),  # (512 MiB in 16 windows of 32 MiB)
]
KVXFER_ONLY = {"chunk_mib", "vram_staging_mib"}  # knobs raw NIXL has no counterpart of


def _by_size(rows: list[dict[str, Any]], key: str) -> dict[int, Any]:
    """MiB -> the value of ``key``, or "skipped" for a size not measured (one repeat would
    take too long: ``too_slow``)."""
    return {r["bytes"] >> 20: r.get(key, "skipped") for r in rows}


def stage_knobs(dry: bool, device: str, emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """One knob at a time from kvxfer's defaults (2 NIXL threads, 64 MiB chunks, the memtype
    cache off), kvxfer and raw NIXL, 32 KiB descriptors, 32 MiB and 512 MiB."""
    kinds = ["dram"] if dry else ["ipc", "vmm_fd"]
    knobs = KNOBS[:2] if dry else KNOBS
    sizes = [1] if dry else [16, 256]
    repeats = 1 if dry else 3
    res: dict[str, Any] = {"kinds": kinds, "sizes_mib": [n * 2 for n in sizes], "cells": []}
    if dry:
        res["stand_in"] = "DRAM (dry run), two knobs; on a GPU: ipc and vmm_fd, every knob"
    for kind in kinds:
        for name, env, opts in knobs:
            threads, chunk = opts.get("threads", 2), opts.get("chunk_mib", 64)
            cell: dict[str, Any] = {"kind": kind, "knob": name, "env": env, "threads": threads,
                                    "chunk_mib": chunk}
            try:
                if not KVXFER_ONLY & opts.keys():
                    raw = raw_sweep(kind, sizes, repeats, device=device, threads=threads, env=env,
                                    layouts=("LBNHC",), staging=False, copy=False)
                    cell["raw_nixl_gbps"] = _by_size(raw["rows"], "raw_nixl_gbps")
                k = kvxfer_sweep(kind, "LBNHC", sizes, repeats, device=device, threads=threads,
                                 chunk_mib=chunk, env=env, vram_staging_mib=opts.get("vram_staging_mib"))
                cell["kvxfer_gbps"] = _by_size(k["rows"], "kvxfer_gbps")
            except Exception as e:  # a knob that breaks a lane is a finding, not the stage's end
                cell["error"] = f"{type(e).__name__}: {e}"[:1500]
            res["cells"].append(cell)
            res["summary_lines"] = [  # (after each cell: a stage cut at its deadline keeps them)
                f"  {c['kind']:<7} {c['knob']:<32} kvxfer {c.get('kvxfer_gbps', '-')} "
                f"raw {c.get('raw_nixl_gbps', '-')}"
                + (f"  ERROR {c['error'][:120]}" if c.get("error") else "") for c in res["cells"]]
            emit(res)
    return res


def stage_lanes(dry: bool, device: str, emit: Callable[[dict[str, Any]], None],
                per_kind_timeout: float = 90.0) -> dict[str, Any]:
    """Per memory kind, in a process of its own (own deadline, own output): the lanes UCX
    picks for a READ and a WRITE (UCX_PROTO_INFO=y), and that both moved the right bytes."""
    kinds = ["dram"] if dry else ["ipc", "ipc_imported", "vmm_fd", "vmm_fabric"]
    res: dict[str, Any] = {"kinds": {}}
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info", "PYTHONUNBUFFERED": "1"}
    for kind in kinds:
        cmd = [sys.executable, "-m", "kvxfer.testing.gpu_lanes", "lanes-one", kind, "--device", device]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=per_kind_timeout, env=env,
                               check=False)
            text = p.stdout + "\n" + p.stderr
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("GPU-CHECK-RESULT ")]
            one: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1]) if lines else {
                "status": "failed", "reason": f"exit code {p.returncode}", "stderr_tail": p.stderr[-2000:]}
        except subprocess.TimeoutExpired as e:
            raw = e.stdout or ""
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            one = {"status": "timeout", "reason": f"no answer in {per_kind_timeout:.0f} s"}
        one["seconds"] = round(time.monotonic() - t0, 1)
        one["lanes"] = parse_proto_info(text)
        one["proto_info_lines"] = [ln[-220:] for ln in text.splitlines() if "|" in ln][:80]
        res["kinds"][kind] = one
        emit(res)
    res["summary_lines"] = [
        f"  {k:<13} {v.get('status', 'ok'):<11} READ via {','.join(v['lanes']['read']) or '?'}; "
        f"WRITE via {','.join(v['lanes']['write']) or '?'}"
        + (f"; verified R={v['read_verified']} W={v.get('write_verified')}" if "read_verified" in v else "")
        + (f"; 64 MiB READ {v['speed']['read_gbps']} GB/s, WRITE {v['speed']['write_gbps']} GB/s"
           if v.get("speed") else "")
        + (f"  ({v.get('reason', '')[:100]})" if v.get("reason") else "")
        for k, v in res["kinds"].items()]
    bad = [k for k, v in res["kinds"].items() if v.get("status") in ("failed", "timeout")]
    if bad:
        res["status"] = "failed"
        res["reason"] = f"kinds that failed: {', '.join(bad)}"
    return res
