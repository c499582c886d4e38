"""Heterogeneous TP, replicated KV, MLA and block-size ratios end to end: two real
sidecars, one engine process per side holding one registered cache per rank, real NIXL,
every byte of every decode rank checked against the global (token, head) pattern."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvxfer.testing.demo import DemoOptions, run_demo
from kvxfer.testing.kept import KeptSidecars

PAIRS = [(1, 1), (1, 2), (2, 4), (4, 2), (8, 2), (2, 8)]
CASES = [(p, d, max(p, d)) for p, d in PAIRS] + [  # heads >= TP on both sides
    (p, d, min(p, d)) for p, d in PAIRS if max(p, d) > 1  # heads < TP on the larger side
]


def small(**kw: object) -> DemoOptions:
    base = {"requests": 3, "layers": 2, "blocks_per_request": 2, "head_dim": 16, "block_size": 8}
    return DemoOptions(**(base | kw))  # type: ignore[arg-type]


def check(res: dict) -> None:
    assert res["problems"] == []
    assert res["verified"] is True
    assert res["released"] == {"read": 4}  # 3 requests + warm-up, each released exactly once


@pytest.mark.parametrize(("ptp", "dtp", "heads"), CASES)
def test_tp_pairs(ptp: int, dtp: int, heads: int, kept: KeptSidecars) -> None:
    res = run_demo(small(prefill_tp=ptp, decode_tp=dtp, heads=heads, head_layout="HND"), kept=kept)
    check(res)
    assert res["bytes"] == 3 * small(decode_tp=dtp, heads=heads).request_bytes()


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 4), (4, 2)])
def test_mla(ptp: int, dtp: int, kept: KeptSidecars) -> None:
    check(run_demo(small(prefill_tp=ptp, decode_tp=dtp, mla=True), kept=kept))


@pytest.mark.parametrize(("pbs", "dbs", "layout"), [(8, 16, "NHD"), (16, 8, "HND")])
def test_block_size_ratio(pbs: int, dbs: int, layout: str, kept: KeptSidecars) -> None:
    check(run_demo(small(prefill_tp=2, decode_tp=4, heads=8, prefill_block_size=pbs,
                         decode_block_size=dbs, blocks_per_request=4, head_layout=layout), kept=kept))


def test_nhd_head_slices_cost_one_descriptor_per_token() -> None:
    nhd = run_demo(small(prefill_tp=1, decode_tp=2, heads=4, head_layout="NHD"))
    hnd = run_demo(small(prefill_tp=1, decode_tp=2, heads=4, head_layout="HND"))
    check(nhd)
    check(hnd)
    # per decode rank: 2 blocks x 2 layers x K/V; NHD needs one run per token (8 per block)
    assert hnd["descriptors_per_request"] == 2 * (2 * 2 * 2)
    assert nhd["descriptors_per_request"] == 2 * (2 * 2 * 2) * 8


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 4), (4, 2)])
def test_demo_cli_heterogeneous_tp(ptp: int, dtp: int) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer", "demo", "--prefill-tp", str(ptp), "--decode-tp", str(dtp),
         "--requests", "4", "--layers", "4", "--blocks-per-request", "4", "--json"],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert (res["verified"], res["prefill_tp"], res["decode_tp"]) == (True, ptp, dtp)
    assert res["descriptors_per_request"] > 0


def test_impossible_block_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="whole decode blocks"):
        run_demo(small(prefill_block_size=8, decode_block_size=32, blocks_per_request=3))
