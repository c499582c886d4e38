"""`kvxfer bench --quick` as a smoke test: it runs end to end and reports every field.
No thresholds here: performance is measured by the benchmark, never asserted in tests."""

from __future__ import annotations

import json
import subprocess
import sys

FIELDS = ("throughput_ratio_vs_raw_nixl", "throughput_ratio_vs_memcpy", "step_overhead_us_p50",
          "step_overhead_us_p99", "first_transfer_ms_cold", "first_transfer_ms_warm", "sizes",
          "verify_cost", "fixed_cost_us_p50", "fixed_cost_us")


def test_bench_quick_reports_every_field() -> None:
    out = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--quick", "--json"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for key in FIELDS:
        assert key in res, key
    assert [r["blocks"] for r in res["sizes"]] == [1, 8, 32]
    for r in res["sizes"]:
        assert r["kvxfer_gbps"] > 0
        assert r["raw_nixl_gbps"] > 0
        assert r["memcpy_gbps"] > 0
    assert [s["inflight"] for s in res["step_overhead"]] == [0, 16]
    assert res["descriptor_prep_ms"][0]["descriptors"] == 10_000 * 64
    # random block ids in the layer-outer layout: one descriptor per (layer, K/V, block)
    assert [r["descriptors"] for r in res["sizes"]] == [64, 8 * 64, 32 * 64]
    assert res["fixed_cost_us"]["kvxfer_p50_us"] > 0
    assert res["fixed_cost_us"]["raw_nixl_p50_us"] > 0
    assert res["fixed_cost_us_p50"] == res["fixed_cost_us"]["p50"]
    # the per-hop trace of the fixed cost: every hop of the hot path, from the engine's send
    # of Recv to its receipt of Done (each the median time since the hop before it)
    hops = res["fixed_cost_us"]["hops_us"]
    assert {"sidecar", "accepted", "planned", "claim_sent", "nixl_thread", "posted", "landed", "loop",
            "claimed", "reply", "engine_done"} <= set(hops), hops
    assert all(v >= 0 for v in hops.values()), hops
    if res["device"] == "cpu":  # descriptors per 16 MiB request, per layout and block ids
        per = {(x["kv_layout"], x["block_ids"]): x["descriptors"] for x in res["layouts"]}
        assert per == {("LBNHC", "random"): 512, ("LBNHC", "consecutive"): 64,
                       ("BLHNC", "random"): 8, ("BLHNC", "consecutive"): 8}
    assert [v["blocks"] for v in res["verify_cost"]] == [1, 8]
    assert all(v["on_ms"] > 0 and v["off_ms"] > 0 for v in res["verify_cost"])
    assert "raw NIXL" in out.stdout  # the human table
    assert "integrity check" in out.stdout
    import torch

    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert res["device"] == want  # --device auto
