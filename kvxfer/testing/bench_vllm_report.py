"""What ``make bench-vllm`` reports beyond its per-rate table: TTFT by prompt length (#36).
Runs are duck-typed (``bench_vllm.Run``: ``system`` and ``results``, each with ``ttft_s``,
``prompt_len`` and ``error``)."""

from __future__ import annotations

from typing import Any


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def by_length(runs: list[Any], edges: list[int]) -> dict[str, dict[str, dict[str, Any]]]:
    """TTFT p50 / p99 per system and prompt length bucket (``edges``: ascending bucket starts,
    every round and rate pooled): #36's table by prompt length."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        for r in run.results.values():
            if r.error or r.prompt_len < edges[0]:
                continue
            i = max(k for k, e in enumerate(edges) if r.prompt_len >= e)
            label = f"{edges[i]}-{edges[i + 1] - 1}" if i + 1 < len(edges) else f"{edges[i]}+"
            out.setdefault(run.system, {}).setdefault(label, {"ttft": []})["ttft"].append(r.ttft_s)
    for cells in out.values():
        for cell in cells.values():
            ttft = cell.pop("ttft")
            cell.update(n=len(ttft), ttft_p50_ms=round(pct(ttft, 0.5) * 1e3, 1),
                        ttft_p99_ms=round(pct(ttft, 0.99) * 1e3, 1))
    return out


def print_by_length(rows: dict[str, dict[str, dict[str, Any]]], edges: list[int],
                    labels: dict[str, str]) -> None:
    buckets = [f"{a}-{b - 1}" for a, b in zip(edges, edges[1:], strict=False)] + [f"{edges[-1]}+"]
    print("TTFT p50 / p99 ms by prompt length (words; every rate and round pooled; n requests):")
    print(f"  {'system':>18} " + " ".join(f"{lab:>22}" for lab in buckets))
    for system, cells in rows.items():
        vals = [f"{c['ttft_p50_ms']:.1f} / {c['ttft_p99_ms']:.1f} (n={c['n']})" if (c := cells.get(lab))
                else "-" for lab in buckets]
        print(f"  {labels[system]:>18} " + " ".join(f"{v:>22}" for v in vals))
