"""The sidecar's heap is frozen once it settled (``kvxfer.gc_heap``): a full collection walks
what was made since, not the ~200,000 objects of its imports (torch's among them), which cost
the event loop 95-170 ms a walk on this machine; every collection is timed (``kvxfer_gc_*``)."""

from __future__ import annotations

import gc
import time

from kvxfer.gc_heap import GcCollector, GcPauses
from kvxfer.testing.demo import DemoOptions, run_demo
from kvxfer.testing.kept import KeptSidecars


def test_every_collection_is_counted_and_timed_by_generation() -> None:
    pauses = GcPauses()
    gc.callbacks.append(pauses.callback)
    try:
        gc.collect(1)
        gc.collect(2)
    finally:
        gc.callbacks.remove(pauses.callback)
    assert pauses.collections[1] >= 1, pauses
    assert pauses.collections[2] >= 1, pauses
    assert pauses.seconds[2] > 0.0
    assert pauses.worst_s >= pauses.seconds[2] / pauses.collections[2]
    # a "stop" with no "start" on that thread (installed mid-collection) is not counted
    young = pauses.collections[0]
    pauses.callback("stop", {"generation": 0})
    assert pauses.collections[0] == young
    names = {m.name: m for m in GcCollector(pauses).collect()}
    assert set(names) == {"kvxfer_gc_collections", "kvxfer_gc_pause_seconds", "kvxfer_gc_pause_worst_seconds",
                          "kvxfer_gc_frozen_objects", "kvxfer_gc_old_objects"}
    by_gen = {s.labels["generation"]: s.value for s in names["kvxfer_gc_collections"].samples
              if s.name.endswith("_total")}
    assert by_gen == {"0": young, "1": pauses.collections[1], "2": pauses.collections[2]}


def test_a_staging_sidecar_freezes_its_imports_and_keeps_its_oldest_generation_small() -> None:
    """Staged reads (a 2 -> 4 NHD request is) make both sidecars import torch in the background;
    once moved, every byte checked, each sidecar settles its heap again at an idle moment: torch
    frozen and almost nothing in the generation a full collection walks. (Without the settle
    after the import: ~60,000 frozen and ~140,000 walked; without any: none frozen.)"""
    opts = DemoOptions(requests=64, in_flight=8, layers=8, blocks_per_request=8, block_size=16, heads=8,
                       head_dim=64, prefill_tp=2, decode_tp=4, kv_layout="LBNHC", timeout_s=60.0,
                       extra_serve_args=("--staging-mib", "16"))
    kept = KeptSidecars()
    try:
        res = run_demo(opts, kept=kept)
        assert res["verified"], res["problems"]
        staged = res["metrics"]["decode"]['kvxfer_staged_receives{how="slot"}']
        assert staged == 64 * 4 + 4, res["metrics"]  # (every rank's receive staged, warm-up included)
        (pair,) = kept.pairs()
        for sc in pair:  # (idle now: the second settle comes within its poll once the import ended)
            end = time.monotonic() + 60
            while (m := sc.scrape())["kvxfer_gc_frozen_objects"] <= 100_000 and time.monotonic() < end:
                time.sleep(0.1)
            assert m["kvxfer_gc_frozen_objects"] > 100_000, (sc.name, m)
            assert m["kvxfer_gc_old_objects"] < 20_000, (sc.name, m)
            assert "heap settled (after the staging copies' import)" in sc.log(), sc.log()[-3000:]
    finally:
        kept.close()
