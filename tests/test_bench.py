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
    ch = res["engine_channel"]  # (#38: through the sidecar beside a bare pyzmq echo)
    assert ch["n"] == 200
    assert ch["kvxfer"]["rtt_p50_us"] > 0  # (over the engine ring)
    assert ch["kvxfer_zmq"]["rtt_p50_us"] > 0
    assert ch["bare_pyzmq"]["rtt_p50_us"] > 0
    assert "engine channel" in out.stdout
    assert res["descriptor_prep_ms"][0]["descriptors"] == 10_000 * 64
    # random block ids in the layer-outer layout: one descriptor per (layer, K/V, block)
    assert [r["descriptors"] for r in res["sizes"]] == [64, 8 * 64, 32 * 64]
    assert res["fixed_cost_us"]["kvxfer_p50_us"] > 0
    assert res["fixed_cost_us"]["raw_nixl_p50_us"] > 0
    assert res["fixed_cost_us_p50"] == res["fixed_cost_us"]["p50"]
    # the per-hop trace of the fixed cost: every hop of the hot path, from the engine's send
    # of Recv to its receipt of Done (each the median time since the hop before it); the
    # claim's hops only when it went out and came back before the Done (it follows the post,
    # and a read its lease word proved does not wait for it)
    hops = res["fixed_cost_us"]["hops_us"]
    assert {"sidecar", "accepted", "planned", "nixl_thread", "posted", "landed", "loop", "reply",
            "engine_done"} <= set(hops), hops
    assert set(hops) <= {"sidecar", "accepted", "planned", "claim_sent", "nixl_thread", "planned_descs",
                         "posted", "data_done", "claimed", "landed", "loop", "reply", "engine_done",
                         "handshaked", "claim_shared", "stage_sent", "staged"}, hops
    assert all(v >= 0 for v in hops.values()), hops
    # the same trace for every size of the main comparison, printed for 16 MiB (#38's target)
    assert all({"sidecar", "posted", "reply", "engine_done"} <= set(r["hops_us"]) for r in res["sizes"]), res
    assert "16 MiB per hop" in out.stdout
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


def test_bench_tp_matrix_quick_verifies_every_cell() -> None:
    """`kvxfer bench --tp-matrix --quick`: both directions, every default layout, replicated KV
    heads and MLA, each cell's bytes verified and its ratios to 1 -> 1 and memcpy reported."""
    from kvxfer.testing.bench_tp import QUICK_CASES

    out = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--tp-matrix", "--quick", "--json"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    cells = res["cells"]
    want = [(m, lay, p, d) for m, lay, ps in QUICK_CASES for p, d in ps]
    assert [(c["model"], c["kv_layout"], c["prefill_tp"], c["decode_tp"]) for c in cells] == want
    assert res["verified"] is True
    assert all(c["verified"] and not c["problems"] for c in cells), [c["problems"] for c in cells]
    directions = {c["prefill_tp"] < c["decode_tp"] for c in cells if c["prefill_tp"] != c["decode_tp"]}
    assert directions == {True, False}
    for c in cells:
        assert len(c["round_gbps"]) == res["rounds"] == 2
        assert c["gbps"] > 0
        assert c["memcpy_gbps"] > 0
        assert c["descriptors_per_request"] > 0
        assert c["ratio_vs_memcpy"] == round(c["gbps"] / c["memcpy_gbps"], 3)
        ref = next(x for x in cells if (x["model"], x["kv_layout"], x["prefill_tp"], x["decode_tp"])
                   == (c["model"], c["kv_layout"], 1, 1))
        assert c["ratio_vs_1x1"] == round(c["gbps"] / ref["gbps"], 3)
        descs = c["descriptors_per_request"] / ref["descriptors_per_request"]
        assert c["descriptors_vs_1x1"] == round(descs, 3)
        assert c["request_bytes"] == ref["request_bytes"]  # the same request, whatever the TP
        assert c["request_ratio_vs_1x1"] == round(c["request_gbps"] / ref["request_gbps"], 3)
    # replicated KV lands more bytes on the decode ranks than the request holds: 2 KV heads on 4
    # decode ranks land each head twice; MLA's latent once per decode rank
    landed = {(c["model"], c["prefill_tp"], c["decode_tp"]):
              c["landed_bytes_per_request"] / c["request_bytes"] for c in cells}
    assert landed[("gqa2", 1, 4)] == 2
    assert landed[("gqa8", 2, 4)] == 1
    assert landed[("mla", 2, 1)] == 1
    # the goals are reported per cell that is not 1 -> 1 (quick requests are under 16 MiB: no
    # throughput goal, only the descriptor one)
    assert len(res["targets"]) == sum((c["prefill_tp"], c["decode_tp"]) != (1, 1) for c in cells)
    assert all(t.startswith(("met: ", "MISSED: ")) and "descriptors" in t for t in res["targets"])
    assert f"bytes verified in {len(want)} of {len(want)} cells" in out.stdout  # the human table
