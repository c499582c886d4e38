"""``kvxfer bench``'s report: the machine it ran on, the table it prints and the plot
(``--plot``)."""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np


def _machine(device: str = "cpu") -> dict[str, Any]:
    import importlib.metadata as md

    def ver(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "-"

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
           "nixl": ver("nixl-cu12") if ver("nixl-cu12") != "-" else ver("nixl-cu13"),
           "kvxfer": ver("kvxfer"), "numpy": np.__version__, "torch": ver("torch")}
    if device.startswith("cuda"):
        import torch

        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def print_table(res: dict[str, Any]) -> None:
    where = res["machine"].get("gpu") or f"{res['machine']['cpu']}, {res['machine']['cores']} cores"
    print(f"kvxfer bench ({'quick' if res['quick'] else 'full'}, UCX {res['ucx_error_mode']} mode, "
          f"{res['nixl_threads']} NIXL threads, "
          f"{res.get('memory', 'shared host memory')}) on {where}; {res['layout']}")
    print(f"  {'size':>9} {'descs':>7} {'kvxfer':>10} {'raw NIXL':>10} {'memcpy':>10} {'vs raw':>7} "
          f"{'vs memcpy':>9}")
    for r in res["sizes"]:
        print(f"  {r['bytes'] / (1 << 20):>6.0f} MiB {r['descriptors']:>7} {r['kvxfer_gbps']:>6.2f} GB/s "
              f"{r['raw_nixl_gbps']:>6.2f} GB/s {r['memcpy_gbps']:>6.2f} GB/s {r['ratio_vs_raw_nixl']:>7.2f} "
              f"{r['ratio_vs_memcpy']:>9.2f}")
    for r in res["sizes"]:
        if r.get("hops_us") and r["bytes"] == 16 << 20:  # (#38's 16 MiB target: where its time goes)
            print("  16 MiB per hop, p50 us: " + ", ".join(f"{k} {v}" for k, v in r["hops_us"].items()))
    print("  step overhead: " + ", ".join(
        f"{s['inflight']} in flight p50 {s['p50_us']} us p99 {s['p99_us']} us" for s in res["step_overhead"]))
    if res.get("engine_channel"):
        ch = res["engine_channel"]
        kv, bare, zq = ch["kvxfer"], ch["bare_pyzmq"], ch.get("kvxfer_zmq", {})
        print(f"  engine channel (a {ch['message_bytes']}-byte Ping, n={ch['n']}): one way p50 "
              f"{kv['one_way_p50_us']} us through the sidecar over its ring, {zq.get('one_way_p50_us')} us "
              f"over its ZMQ socket, {bare['one_way_p50_us']} us bare pyzmq (round trip p99 "
              f"{kv['rtt_p99_us']} / {zq.get('rtt_p99_us')} / {bare['rtt_p99_us']} us)")
    print(f"  first transfer (1 block): cold {res['first_transfer_ms_cold']} ms, "
          f"warm {res['first_transfer_ms_warm']} ms")
    fc = res["fixed_cost_us"]
    print(f"  fixed cost (warm 1-block read minus raw NIXL's, n={fc['n']}): p50 {fc['p50']} us, "
          f"p90 {fc['p90']} us (kvxfer {fc['kvxfer_p50_us']} us, raw NIXL {fc['raw_nixl_p50_us']} us)")
    if fc.get("hops_us"):
        print("    per hop, p50 us: " + ", ".join(f"{k} {v}" for k, v in fc["hops_us"].items()))
    for x in res.get("layouts", []):
        print(f"  layout {x['kv_layout']}, {x['block_ids']} block ids, 16 MiB: {x['descriptors']} "
              f"descriptors ({x['descriptors_unmerged']} unmerged), kvxfer {x['kvxfer_gbps']} GB/s, memcpy "
              f"{x['memcpy_gbps']} GB/s ({x['ratio_vs_memcpy']})")
    print("  concurrency (16 MiB each): " + ", ".join(
        f"{c['concurrent']}: {c['gbps']} GB/s" for c in res["concurrency"]))
    print("  decode engines pulling from one prefill: " + ", ".join(f"{c['decode_engines']}: {c['gbps']} GB/s"
                                                                    for c in res["fan_in"]))
    print("  integrity check (--verify-sample) per verified receive: " + ", ".join(
        f"{v['bytes'] / (1 << 20):.0f} MiB +{v['cost_ms']} ms ({v['cost_pct']}%)"
        for v in res["verify_cost"]))
    print("  descriptor prep: " + ", ".join(
        f"{x['blocks']} blocks ({x['descriptors']} descs): dlist {x['prep_dlist_ms']} ms, "
        f"make_prepped_xfer {x['make_prepped_xfer_ms']} ms" for x in res["descriptor_prep_ms"]))


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    mib = [r["bytes"] / (1 << 20) for r in res["sizes"]]
    for key, label in (("kvxfer_gbps", "kvxfer (sidecar)"), ("raw_nixl_gbps", "raw NIXL (in-engine)"),
                       ("memcpy_gbps", "memcpy (same blocks)")):
        a.plot(mib, [r[key] for r in res["sizes"]], marker="o", label=label)
    a.set_xscale("log", base=2)
    a.set_xlabel("request size (MiB)")
    a.set_ylabel("GB/s")
    a.set_title("Throughput vs request size")
    a.grid(alpha=0.3)
    a.legend()
    c = res["concurrency"]
    b.bar([str(x["concurrent"]) for x in c], [x["gbps"] for x in c])
    b.set_xlabel("concurrent 16 MiB requests")
    b.set_ylabel("GB/s")
    b.set_title(f"Concurrency; step overhead p50 {res['step_overhead_us_p50']} us")
    where = res["machine"].get("gpu") or f"{res['machine']['cpu']} ({res['machine']['cores']} cores)"
    fig.suptitle(f"kvxfer bench on {where}, {res.get('memory', 'shared host memory')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
