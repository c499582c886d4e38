"""``make gpu-check`` on a machine without a GPU: the kit (``kvxfer.testing.gpu_check``) in
dry-run mode, end to end, so that it works the first time it meets a GPU. What this shows:
every stage runs as its own process and ends with a recorded status, a stage that hangs is
killed at its deadline with everything it started and the next stages still run, a failing
stage leaves its stderr in the report, a second call skips what is done and retries what
failed, and a call that runs out of budget leaves the rest for the next. The transfer code
runs on host memory (numpy and torch tensors) through real NIXL and real sidecars, and the
VMM code against the fake driver of ``tests/fake_cuda.py``. What it cannot show: anything
about a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxfer.testing.gpu_check import STAGES
from kvxfer.testing.gpu_install import plan, slim_wheel
from kvxfer.testing.gpu_lanes import parse_proto_info
from kvxfer.testing.gpu_xfer import LAYOUTS, copy_blocks, fill, verify

REPO = Path(__file__).resolve().parents[1]
STATUSES = {"ok", "dry", "unavailable", "failed", "timeout", "pending"}


def kit(results: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OUT", None)
    cmd = [sys.executable, "-m", "kvxfer.testing.gpu_check", "--dry-run", "--results", str(results), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
                          check=False)


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One whole dry run, with one stage made to hang and one to fail."""
    d = tmp_path_factory.mktemp("gpu-check")
    p = kit(d / "results", "--out", str(d / "out"), "--inject-hang", "tests-vmm", "--stage-timeout",
            "tests-vmm=3", "--inject-fail", "kvxfer-bench")
    assert (d / "out" / "gpu_latest.json").exists(), p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((d / "out" / "gpu_latest.json").read_text())
    return {"dir": d, "proc": p, "doc": doc, "text": (d / "out" / "gpu_latest.txt").read_text()}


def test_every_stage_ends_with_a_status_and_the_summary_names_each(first: dict[str, Any]) -> None:
    doc, text = first["doc"], first["text"]
    assert first["proc"].returncode == 1  # (a stage failed in this call)
    assert doc["dry_run"]
    assert "DRY RUN" in text
    assert list(doc["stages"]) == [s.name for s in STAGES]
    for name, st in doc["stages"].items():
        assert st["status"] in STATUSES, (name, st)
        assert any(line.split()[:2] == [name, st["status"]] for line in text.splitlines()), name
        if name not in ("tests-vmm", "kvxfer-bench"):
            assert st["status"] in ("ok", "dry", "unavailable"), (name, st.get("reason"),
                                                                  st.get("stderr_tail"))
    assert sorted(os.listdir(first["dir"] / "out")) == ["gpu-check.tar.gz", "gpu_latest.json",
                                                        "gpu_latest.txt"]


def test_the_dry_run_measures_what_it_can_and_says_what_it_could_not(first: dict[str, Any]) -> None:
    st = {n: s for n, s in first["doc"]["stages"].items()}
    assert st["install"]["status"] == "dry"
    assert st["install"]["result"]["commands"]
    pools = st["env-cuda"]["result"]["pools"]  # the fake driver: no IMEX channel, so no fabric handle
    assert pools["vmm_fd"]["allowed_handle_types"] == ["POSIX_FILE_DESCRIPTOR"]
    assert pools["vmm_fabric"]["status"] == "unavailable"
    assert st["tests-ipc"]["status"] == "dry"
    assert {t["outcome"] for t in st["tests-ipc"]["result"]["tests"]} == {"skipped"}
    lanes = st["lanes"]["result"]["kinds"]["dram"]
    assert lanes["read_verified"]
    assert lanes["write_verified"]
    assert lanes["lanes"]["read"]
    assert lanes["lanes"]["write"]
    rows = st["bench-ipc"]["result"]["rows"]
    assert {r["layout"] for r in rows} == set(LAYOUTS)
    for r in rows:  # (every repeat was verified byte for byte, or the stage would have failed)
        for k in ("kvxfer_gbps", "raw_nixl_gbps", "copy_gbps", "staged_gbps"):
            assert r[k] > 0, (k, r)
        assert r["kvxfer_descriptors"] > 0, r
    # (whether kvxfer's column measured staged reads: its sidecars' metrics, in the summary too)
    for k in st["bench-ipc"]["result"]["kvxfer"]:
        assert "staged_receives{how=\"direct\"}" in k["staging"]["decode"], k["staging"]
        assert k["staging"]["prefill"]["staging_arenas_missing"] == 0, k["staging"]
        assert "staged_gather_seconds" in k["staging"]["prefill"], k["staging"]
    assert "staging (metrics, decode / prefill)" in "\n".join(st["bench-ipc"]["result"]["summary_lines"])
    assert st["bench-vmm_fd"]["status"] == "dry"
    assert st["bench-vmm_fabric"]["status"] == "unavailable"
    assert all("error" not in c for c in st["knobs"]["result"]["cells"])
    assert st["pd-throughput"]["result"]["json"]["verified"]


def test_a_hanging_stage_is_killed_at_its_deadline_with_its_children_and_the_next_stages_run(
        first: dict[str, Any]) -> None:
    st = first["doc"]["stages"]
    hung = st["tests-vmm"]
    assert hung["status"] == "timeout"
    assert "killed" in hung["reason"]
    assert 3 <= hung["seconds"] < 20
    assert "hanging" in hung["stdout_tail"]
    child = int((first["dir"] / "results" / "logs" / "tests-vmm.hang-child.pid").read_text())
    try:
        state = Path(f"/proc/{child}/stat").read_text().split()[2]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), f"the hanging stage's child {child} is still running ({state})"
    assert st["lanes"]["status"] == "ok"
    assert st["lanes"]["started"] > hung["started"]
    assert "tests-vmm" in first["text"]
    assert "timeout" in first["text"]


def test_a_failing_stage_is_recorded_with_its_stderr(first: dict[str, Any]) -> None:
    bad = first["doc"]["stages"]["kvxfer-bench"]
    assert bad["status"] == "failed"
    assert bad["returncode"] == 1
    assert "the injected failure" in bad["stderr_tail"]
    assert "the injected failure" in first["text"]
    assert first["doc"]["stages"]["pd-throughput"]["status"] == "ok"


def test_a_second_call_skips_what_is_done_and_retries_what_failed(first: dict[str, Any]) -> None:
    d = first["dir"]
    p = kit(d / "results", "--out", str(d / "out2"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    calls = json.loads((d / "results" / "calls.json").read_text())
    assert [c["number"] for c in calls] == [1, 2]
    assert calls[1]["ran"] == ["tests-vmm", "kvxfer-bench"]
    assert len(calls[1]["skipped"]) == len(STAGES) - 2
    doc = json.loads((d / "out2" / "gpu_latest.json").read_text())
    assert doc["complete"]
    assert doc["stages"]["tests-vmm"]["status"] == "dry"
    assert doc["stages"]["env"]["started"] == first["doc"]["stages"]["env"]["started"]  # not run again


def test_a_call_out_of_budget_leaves_the_rest_for_the_next(tmp_path: Path) -> None:
    p = kit(tmp_path, "--only", "env,install", "--budget-s", "0")
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "gpu_latest.json").read_text())
    assert doc["call"]["deferred"] == ["env", "install"]
    assert doc["call"]["ran"] == []
    assert doc["stages"]["env"]["status"] == "pending"
    assert not doc["complete"]
    assert "run again" in doc["next"]
    p = kit(tmp_path, "--only", "env", "--budget-s", "60")
    doc = json.loads((tmp_path / "gpu_latest.json").read_text())
    assert doc["stages"]["env"]["status"] == "ok"
    assert doc["stages"]["install"]["status"] == "pending"


# --------------------------------------------------------------------------- the pieces


UCX_SAMPLE = """\
[1795572467.2] [vm:9279 :0]   | gc-initiator intra-node cfg#1                                    |
[1795572467.3] [vm:9278 :0]   | gc-target intra-node cfg#1                                       |
[1795572467.2] [vm:9279 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795572467.3] [vm:9278 :0]   | remote memory write by ucp_put* from host memory to host         |
[1795572467.2] [vm:9279 :0]   +--------+-------------+-------------------------------------------+
[1795572467.2] [vm:9279 :0]   | Range  | Description |                  Config                   |
[1795572467.3] [vm:9278 :0]   | 0..inf | zero-copy   | tcp/lo                                    |
[1795572467.2] [vm:9279 :0]   | 0..inf | zero-copy   | cma/memory                                |
[1795572467.4] [gpu:77 :0]   | gc-initiator intra-node cfg#2                                  |
[1795572467.4] [gpu:77 :0]   | remote memory write by ucp_put* from cuda memory to cuda       |
[1795572467.4] [gpu:77 :0]   | 0..8k   | copy-in     | cuda_copy/cuda                           |
[1795572467.4] [gpu:77 :0]   | 8k..inf | zero-copy   | cuda_ipc/cuda                            |
"""


def test_proto_info_gives_each_operation_its_lanes_per_process() -> None:
    got = parse_proto_info(UCX_SAMPLE)  # (two processes print at once: lines are grouped by pid)
    assert got["read"] == ["cma"]
    assert got["write"] == ["cuda_copy", "cuda_ipc"]  # the initiator's tables; the target's tcp is its own
    tables = {(t["pid"], t["op"]) for t in got["tables"]}
    assert tables == {("9279", "read"), ("9278", "write"), ("77", "write")}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_verification_catches_a_block_in_the_wrong_place(layout: str, lib: str) -> None:
    nb, block = 6, 2 << 20
    if lib == "torch":
        torch = pytest.importorskip("torch")
        src, dst = torch.zeros(nb * block, dtype=torch.uint8), torch.zeros(nb * block, dtype=torch.uint8)
    else:
        src, dst = np.zeros(nb * block, np.uint8), np.zeros(nb * block, np.uint8)
    fill(src, 7)
    s, d = [3, 1, 4], [2, 5, 1]
    copy_blocks(src, dst, s, d, nb, layout)
    assert verify(dst, 7, s, d, nb, layout) == 0
    assert verify(dst, 7, s, [5, 2, 1], nb, layout) > 0  # two blocks swapped
    assert verify(dst, 8, s, d, nb, layout) > 0  # another source
    if lib == "torch":  # the GPU path's pattern is the host path's
        ref = np.zeros(nb * block, np.uint8)
        fill(ref, 7)
        assert np.array_equal(src.numpy(), ref)


def test_the_block_outermost_vram_cache_registers_as_kvxfer_registers_a_host_one() -> None:
    from kvxfer.memory import _dense_registration
    from kvxfer.protocol import ShmMemory
    from kvxfer.testing.engine import make_layout
    from kvxfer.testing.gpu_bench import outer_regions

    lay = make_layout(layers=32, num_blocks=10, block_size=16, heads=8, head_dim=128)
    host = _dense_registration(lay, ShmMemory(path="/x", size=1), block_outer=True)
    assert outer_regions(lay) == host.regions


def test_the_install_plan_takes_what_is_installed_and_names_what_is_missing(tmp_path: Path) -> None:
    got = plan(str(REPO), 13, str(tmp_path))
    missing = [r for r in got["requirements"] if r["source"] == "MISSING"]
    assert all(r["requirement"] in got["missing"] for r in missing)
    assert any(r["source"] == "installed" for r in got["requirements"])  # (this venv has numpy, pyzmq...)
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    (tmp_path / f"nixl_cu13-1.5.1-{py}-{py}-manylinux_2_28_x86_64.whl").write_bytes(b"")
    (tmp_path / "nixl_cu12-1.5.1-cp399-cp399-manylinux_2_28_x86_64.whl").write_bytes(b"")
    got = plan(str(REPO), 13, str(tmp_path))
    nixl = next(r for r in got["requirements"] if r["requirement"].startswith("nixl-cu13"))
    assert nixl["source"] in ("installed", "wheel")
    assert not any(m.startswith("nixl") for m in got["missing"])
    cu12 = plan(str(REPO), 12, str(tmp_path))["requirements"]
    assert not [r for r in cu12 if r["wheel"]]  # (that wheel is for another Python)


def test_a_slimmed_nixl_wheel_keeps_everything_but_nixl_ep(tmp_path: Path) -> None:
    whl = tmp_path / "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    files = {"nixl_cu13/__init__.py": b"x", "nixl_ep_cu13/big.so": b"0" * 50_000,
             "nixl_cu13.libs/libucp.so": b"u"}
    record = "".join(f"{n},sha256=abc,1\n" for n in files) + "nixl_cu13-1.5.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for n, b in files.items():
            z.writestr(n, b)
        z.writestr("nixl_cu13-1.5.1.dist-info/RECORD", record)
    before, after = slim_wheel(str(whl))
    assert after < before
    with zipfile.ZipFile(whl) as z:
        assert sorted(z.namelist()) == ["nixl_cu13-1.5.1.dist-info/RECORD", "nixl_cu13.libs/libucp.so",
                                        "nixl_cu13/__init__.py"]
        assert "nixl_ep" not in z.read("nixl_cu13-1.5.1.dist-info/RECORD").decode()


def test_a_size_too_slow_to_finish_in_time_is_skipped_with_its_projection() -> None:
    """The first GPU run's READs crawled over tcp at 0.07 GB/s, and 512 MiB-1 GiB cells ate
    the call's budget: a size whose repeat would take longer than ``SLOW_S`` (projected from
    the size before) is skipped, and says why."""
    from kvxfer.testing.gpu_xfer import SLOW_S, too_slow

    row: dict[str, Any] = {}
    assert not too_slow(None, 1 << 30, row)  # nothing to project from
    assert not too_slow((32 << 20, 0.01), 1 << 30, row)  # 0.32 s projected
    assert not row
    assert too_slow((32 << 20, 0.48), 1 << 30, row)  # 0.07 GB/s: 15 s projected
    assert f"over {SLOW_S:.0f} s" in row["skipped"]
    assert "0.07 GB/s" in row["skipped"]
    # (the knobs stage read every size's number: the 2026-11-28 run's skipped 512 MiB cells
    # raised KeyError and lost the cell's measured 32 MiB number with them)
    from kvxfer.testing.gpu_bench import _by_size

    rows = [{"bytes": 32 << 20, "raw_nixl_gbps": 0.06}, {"bytes": 512 << 20, **row}]
    assert _by_size(rows, "raw_nixl_gbps") == {32: 0.06, 512: "skipped"}


def test_what_a_gpu_sidecar_sets_for_ucx_never_overrides_the_operator() -> None:
    from kvxfer.sidecar.nixl_agent import CUDA_UCX_DEFAULTS, cuda_ucx_defaults

    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    cuda_ucx_defaults(env)
    assert env == {**CUDA_UCX_DEFAULTS, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    assert CUDA_UCX_DEFAULTS["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"


def test_the_staging_line_gives_the_prefills_answer_cost_over_the_sizes_reads_only() -> None:
    """The summary's staging line divides the prefill's answer and gather seconds by its
    answers over the sized reads only: the metrics at the end less those after the cold and
    warm first reads (a cold answer, ~120 ms on a GPU, would swamp the mean of 22)."""
    from kvxfer.testing.gpu_tables import staging_line

    def prefill(n: float, answer: float, gather: float) -> dict[str, Any]:
        return {"prefill": {"staged_answers": n, "staged_answer_seconds": answer,
                            "staged_gather_seconds": gather}}

    k = {"layout": "LBNHC", "rows": [{"kvxfer_descriptors": 1}], "staging": prefill(22, 0.2, 0.1),
         "staging_warm": prefill(4, 0.146, 0.082)}
    got = staging_line(k)
    assert got.endswith("the prefill's answer 3.000 ms a slot, its gather 1.000 (sizes' 18 reads)"), got
    k["staging_warm"] = k["staging"]  # (no sized read staged: nothing to say)
    assert staging_line(k).endswith("descriptors a read [1]")


@pytest.mark.parametrize(("driver", "survives"), [("keeps", True), ("loses", False)])
def test_the_owner_exit_probe_tells_whether_ipc_memory_outlives_its_allocator(driver: str,
                                                                              survives: bool) -> None:
    """``env-cuda``'s question for the next GPU (``kvxfer.testing.gpu_owner``), its control flow
    run on a CPU: a spawned process allocates, fills and exports, this one opens and checks,
    the allocator exits with ``os._exit``, and this one reads and writes again. With a
    stand-in driver that keeps the memory the answer is yes; with one that loses it, no, with
    the driver's error."""
    import glob

    from kvxfer.testing.gpu_owner import owner_exit, summary

    got = owner_exit(0, f"tests.fake_ipc:{driver}")
    assert got["status"] == "ok", got
    assert got["read_before_exit"] is True, got
    assert got["owner_exit_code"] == 0, got
    assert got["survives_owner_exit"] is survives, got
    assert ("still readable and writable" in summary(got)) is survives
    if not survives:
        assert "CUDA_ERROR_INVALID_VALUE" in got["error_after_exit"], got
    assert got["close"] == "CUDA_SUCCESS", got
    assert not glob.glob("/dev/shm/kvxfer-fakeipc-*")
