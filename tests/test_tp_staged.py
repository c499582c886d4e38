"""Staged reads (#35) end to end: two real sidecars, real NIXL, the prefill sidecar copying
held blocks into its staging arena, the decode reading that slot into its own and scattering
it into its blocks; every byte of every decode rank checked against the global (token, head)
pattern, for every prefill TP x decode TP pair in {1, 2, 4, 8}, in NHD (a head slice is one
run per token), HND and block-outermost layouts, with replicated heads and MLA.

A staged read posts one descriptor per 2 MiB of the slot, so a request whose ranks each
receive less than that shows exactly ``decode_tp`` descriptors: that is how these tests
know the staged path ran (the direct read of the same request posts hundreds)."""

from __future__ import annotations

import pytest

from kvxfer.testing.demo import DemoOptions, run_demo
from kvxfer.testing.kept import KeptSidecars

TPS = (1, 2, 4, 8)
# (an arena on; small requests, so staging is forced: a quick matrix)
STAGE_ALL = ("--staging-mib", "64", "--stage-min-descs", "1", "--stage-below-kib", "1024")


def staged(**kw: object) -> DemoOptions:
    base = {"requests": 3, "in_flight": 3, "layers": 2, "blocks_per_request": 4, "heads": 8, "head_dim": 16,
            "block_size": 16, "kv_layout": "LBNHC", "extra_serve_args": STAGE_ALL, "timeout_s": 30.0}
    return DemoOptions(**(base | kw))  # type: ignore[arg-type]


def run_staged(opts: DemoOptions, kept: KeptSidecars | None, slots_per_rank: int = 1) -> dict:  # type: ignore[type-arg]
    res = run_demo(opts, kept=kept)
    assert res["problems"] == [], res["problems"]
    assert res["verified"] is True  # every byte of every decode rank
    assert res["released"] == {"read": opts.requests + 1}  # each hold released once, by its reads
    assert res["descriptors_per_request"] == opts.decode_tp * slots_per_rank, "not staged: a slot a rank"
    return res


@pytest.mark.parametrize("dtp", TPS)
@pytest.mark.parametrize("ptp", TPS)
def test_every_tp_pair_staged_in_nhd(ptp: int, dtp: int, kept: KeptSidecars) -> None:
    run_staged(staged(prefill_tp=ptp, decode_tp=dtp), kept)


@pytest.mark.parametrize(("layout", "ptp", "dtp"), [
    ("LBHNC", 2, 4), ("BLHNC", 1, 8), ("BLNHC", 8, 2),
])
def test_other_layouts_staged(layout: str, ptp: int, dtp: int, kept: KeptSidecars) -> None:
    run_staged(staged(prefill_tp=ptp, decode_tp=dtp, kv_layout=layout), kept)


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 4), (8, 2)])
def test_replicated_heads_staged(ptp: int, dtp: int, kept: KeptSidecars) -> None:
    """2 KV heads: TP 4 and 8 hold copies of one head on several ranks."""
    run_staged(staged(prefill_tp=ptp, decode_tp=dtp, heads=2), kept)


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 4)])
def test_mla_staged(ptp: int, dtp: int, kept: KeptSidecars) -> None:
    run_staged(staged(prefill_tp=ptp, decode_tp=dtp, mla=True, kv_layout="mla", head_dim=64), kept)


def test_staging_off_reads_directly() -> None:
    """The same request with staging off (either side) takes the direct path, bytes equal."""
    for args in (("--staging-mib", "64", "--stage-below-kib", "0"), ("--staging-mib", "0")):
        res = run_demo(staged(prefill_tp=1, decode_tp=2, extra_serve_args=args))
        assert res["problems"] == []
        assert res["verified"] is True
        assert res["descriptors_per_request"] > 2 * 64, args  # per token: far more than one per rank


def test_ranks_whose_runs_exceed_one_stage_request_are_staged_in_several(kept: KeptSidecars) -> None:
    """2 KV heads read by 4 decode ranks in NHD: each rank's head is one run per token and
    layer on the prefill (16,384 runs here, 256 KiB of [address, length]), the four ranks'
    1 MiB, over the 512 KiB one StageRequest may carry: the request is staged in two (it
    used to be read directly, in 65,536 descriptors: the TP matrix's slowest cell)."""
    from kvxfer.sidecar.staged_reads import MAX_RUNS_BYTES

    opts = staged(prefill_tp=1, decode_tp=4, heads=2, layers=8, blocks_per_request=128, requests=2,
                  in_flight=2)
    runs_per_rank = opts.layers * opts.blocks_per_request * opts.block_size  # (at least)
    assert runs_per_rank * 16 <= MAX_RUNS_BYTES < 4 * runs_per_rank * 16
    run_staged(opts, kept)


@pytest.mark.parametrize(("layout", "ptp", "dtp"), [("LBNHC", 2, 4), ("BLNHC", 1, 1), ("LBHNC", 4, 2)])
def test_vram_stagings_copies_end_to_end_on_host_memory(layout: str, ptp: int, dtp: int, kept: KeptSidecars,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies of VRAM staging (torch ``index_select`` / ``index_copy_`` per stretch of runs,
    on the arena's CUDA stream: ``nixl_copies.copy_runs``) and the routes to them (the
    prefill's gather into the arena of the ranks' device, the decode's scatter after the slot
    landed) are the host path's too under ``KVXFER_TEST_TORCH_COPIES=1``: the same StageRequest,
    slots and one-descriptor-per-2-MiB read, on CPU tensors over host memory. What no CPU can
    run (the arenas in VRAM, their streams, cuda_ipc) is ``tests/test_gpu.py``'s."""
    monkeypatch.setenv("KVXFER_TEST_TORCH_COPIES", "1")
    run_staged(staged(prefill_tp=ptp, decode_tp=dtp, kv_layout=layout), kept)


@pytest.mark.parametrize("torch_copies", [False, True], ids=["host-copies", "torch-copies"])
def test_a_read_too_large_for_the_arena_is_staged_in_windows(torch_copies: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decode rank's part (8 MiB) is larger than its share of a 4 MiB arena: it used to be
    read directly (on a GPU, ~100x slower than staged: README "GPU paths"); it is now read in
    windows of 1 MiB through one slot, one StageRequest and one read each, the last one the
    receive's own read. Every byte checked; the sidecars' metrics say how it went."""
    if torch_copies:  # (the copies VRAM staging uses, on host memory)
        monkeypatch.setenv("KVXFER_TEST_TORCH_COPIES", "1")
    # (one request at a time: its two ranks' 1 MiB slots, and the last request's until their
    # final notices reach the prefill, fit its 4 MiB; more at once could find it full)
    opts = staged(prefill_tp=1, decode_tp=2, layers=8, blocks_per_request=32, head_dim=128, requests=2,
                  in_flight=1, extra_serve_args=("--staging-mib", "4", "--stage-min-descs", "1",
                                                 "--stage-below-kib", "1024"))
    # (8 MiB a rank in 1 MiB windows, one descriptor each; fresh sidecars: their metrics are this run's)
    res = run_staged(opts, None, slots_per_rank=8)
    got = res["metrics"]["decode"]
    assert got['kvxfer_staged_receives{how="windows"}'] == (opts.requests + 1) * opts.decode_tp, got
    assert got['kvxfer_staged_receives{how="slot"}'] == 0, got
    assert got['kvxfer_staged_receives{how="direct"}'] == 0, got
    assert got["kvxfer_staging_arena_bytes"] == 4 << 20, got  # (--staging-mib 4: the host arena)
    assert got["kvxfer_staging_arenas_missing"] == 0, got
