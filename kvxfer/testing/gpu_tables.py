"""The GPU benchmark's tables (``kvxfer.testing.gpu_bench``): raw NIXL and kvxfer rows joined,
their summary lines, and what they say."""

from __future__ import annotations

import json
from typing import Any

from kvxfer.testing.gpu_xfer import LAYOUTS


def bench_rows(raw: dict[str, Any], kx: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Raw and kvxfer rows joined by (layout, blocks), with the ratios."""
    by = {(r["layout"], r["blocks"]): dict(r) for r in raw.get("rows", [])}
    for k in kx:
        for r in k.get("rows", []):
            row = by.setdefault((r["layout"], r["blocks"]), {"layout": r["layout"], "blocks": r["blocks"],
                                                            "bytes": r["bytes"]})
            row.update(r)
    rows = sorted(by.values(), key=lambda r: (LAYOUTS.index(r["layout"]), r["blocks"]))
    for r in rows:
        if r.get("kvxfer_gbps") and r.get("raw_nixl_gbps"):
            r["kvxfer_vs_raw"] = round(r["kvxfer_gbps"] / r["raw_nixl_gbps"], 3)
        if r.get("kvxfer_gbps") and r.get("copy_gbps"):
            r["kvxfer_vs_copy"] = round(r["kvxfer_gbps"] / r["copy_gbps"], 3)
    return rows


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    def g(r: dict[str, Any], k: str) -> str:
        v = r.get(k)
        return f"{v:>8.2f}" if isinstance(v, int | float) else f"{'-':>8}"

    heads = ("kvxfer", "raw", "copy", "staged")
    out = [f"  {'layout':<6} {'size':>9} {'descs':>6} " + " ".join(f"{h:>8}" for h in heads) + "  GB/s"]
    for r in rows:
        out.append(f"  {r['layout']:<6} {r['bytes'] / (1 << 20):>5.0f} MiB {r.get('descriptors', 0):>6} "
                   f"{g(r, 'kvxfer_gbps')} {g(r, 'raw_nixl_gbps')} {g(r, 'copy_gbps')} {g(r, 'staged_gbps')}"
                   + (f"  (skipped: {r['skipped']})" if r.get("skipped") else ""))
    return out


def descriptor_cost_dominates(rows: list[dict[str, Any]]) -> bool | None:
    """Whether 32 KiB descriptors cost more than half the throughput of 2 MiB ones (raw
    NIXL, the largest size measured in both layouts)."""
    lb = {r["blocks"]: r for r in rows if r["layout"] == "LBNHC" and r.get("raw_nixl_gbps")}
    bl = {r["blocks"]: r for r in rows if r["layout"] == "BLNHC" and r.get("raw_nixl_gbps")}
    both = sorted(set(lb) & set(bl))
    if not both:
        return None
    n = both[-1]
    return lb[n]["raw_nixl_gbps"] < 0.5 * bl[n]["raw_nixl_gbps"]


def staging_line(k: dict[str, Any]) -> str:
    """The summary's line of one kvxfer sweep's staging: its sidecars' metrics, and each
    size's descriptors per read (staged: 2 MiB each on host memory, up to 64 MiB on VRAM)."""
    if not k.get("staging"):
        return f"  kvxfer {k['layout']} staging: not seen (the sweep failed first)"
    sides = " / ".join(json.dumps(k["staging"].get(s, {}), sort_keys=True) for s in ("decode", "prefill"))
    descs = [r.get("kvxfer_descriptors") for r in k.get("rows", [])]
    return (f"  kvxfer {k['layout']} staging (metrics, decode / prefill): {sides}; descriptors a read {descs}"
            f"{answer_cost(k)}")


def answer_cost(k: dict[str, Any]) -> str:
    """The prefill's mean staged answer and gather over the sizes' reads (its metrics at the
    end less those once the first, cold and warm, reads were done), or "" where not seen."""
    end, warm = k["staging"].get("prefill", {}), k.get("staging_warm", {}).get("prefill", {})
    if "error" in end or "error" in warm or not warm:  # (a scrape failed: the cold answer would count)
        return ""

    def delta(name: str) -> float:
        return float(end.get(name, 0)) - float(warm.get(name, 0))

    n = delta("staged_answers")
    if n <= 0:
        return ""
    answer, gather = (1e3 * delta(f"staged_{x}_seconds") / n for x in ("answer", "gather"))
    return f"; the prefill's answer {answer:.3f} ms a slot, its gather {gather:.3f} (sizes' {n:.0f} reads)"
