"""Whole pipeline: two ``kvxfer serve`` processes, two synthetic engine processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kvxfer.client import SidecarClient
from kvxfer.testing.demo import DemoOptions, _summarise, run_demo
from kvxfer.testing.procs import SidecarFactory
from tests.conftest import PD


def test_64_requests_between_engine_processes() -> None:
    res = run_demo(DemoOptions(requests=64, layers=4, blocks_per_request=4, heads=4, head_dim=64))
    assert res["problems"] == []
    assert res["verified"] is True
    assert res["requests"] == 64
    assert res["bytes"] == 64 * 4 * (4 * 2 * 16 * 4 * 64 * 2)
    assert res["released"] == {"read": 65}  # 64 + the warm-up request
    # /metrics scraped at the end of the run, as Prometheus would see it
    dec, pre = res["metrics"]["decode"], res["metrics"]["prefill"]
    assert dec['kvxfer_transfers_total{result="ok"}'] == 65
    assert dec["kvxfer_transfer_duration_seconds_count"] == 65
    assert dec["kvxfer_transferred_bytes_total"] == res["bytes"] + res["request_bytes"]  # + warm-up
    assert dec['kvxfer_handshakes_total{result="ok"}'] == 1
    assert pre['kvxfer_leases_released_total{reason="read"}'] == 65


@pytest.mark.slow
def test_one_request_of_256_mib() -> None:
    opts = DemoOptions(requests=1, layers=32, blocks_per_request=128)  # 2 MiB per block
    assert opts.request_bytes() == 256 << 20
    res = run_demo(opts)
    assert res["problems"] == []
    assert res["verified"] is True
    assert res["bytes"] == 256 << 20


def test_demo_cli_json_contract() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer", "demo", "--requests", "3", "--layers", "2",
         "--blocks-per-request", "2", "--heads", "2", "--head-dim", "32", "--json",
         "--ucx-error-mode", "none"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("verified", "requests", "bytes", "seconds", "gbps", "prefill_tp", "decode_tp"):
        assert key in res
    assert res["verified"] is True
    assert (res["requests"], res["prefill_tp"], res["decode_tp"]) == (3, 1, 1)
    assert res["bytes"] == 3 * 2 * (2 * 2 * 16 * 2 * 32 * 2)
    assert res["gbps"] > 0
    assert "verify  every byte of every block: OK" in out.stdout


def test_verifier_catches_one_flipped_byte(pd: PD) -> None:
    blocks = pd.d.allocate(2)
    pd.d.fill("flip", blocks)
    assert pd.d.verify("flip", blocks)
    view = pd.d.kv.blocks()
    view[1, 1, blocks[1], 17] ^= 0x01
    assert not pd.d.verify("flip", blocks)
    pd.d.free(blocks)


def test_summary_is_not_verified_when_decode_reports_bad_bytes() -> None:
    opts = DemoOptions(requests=1, layers=1, blocks_per_request=1, heads=1, head_dim=8)
    good = {"prefill": {"released": {"read": 2}, "errors": []},
            "decode": {"done": 1, "failed": {}, "bad": [], "verified_requests": 2, "seconds": 1.0}}
    assert _summarise(opts, good, [])["verified"] is True
    bad = {**good, "decode": {**good["decode"], "bad": ["req-0"], "verified_requests": 1}}
    res = _summarise(opts, bad, [])
    assert res["verified"] is False
    assert res["problems"] == ["request req-0: bytes differ"]
    unreleased = {**good, "prefill": {"released": {"expired": 2}, "errors": []}}
    assert _summarise(opts, unreleased, [])["verified"] is False


def test_blocks_are_recycled_through_pools_sized_to_what_is_in_flight() -> None:
    """20 requests through pools that hold 4 (and the warm-up): 5 rounds, each round's blocks
    freed by both engines once its holds are released and reused by the next; every byte of
    every request verified in the blocks it landed in (a recycled block that was not written
    again still holds another request's pattern and fails)."""
    opts = DemoOptions(requests=20, in_flight=4, layers=2, blocks_per_request=3, heads=2, head_dim=32)
    assert opts.layout("decode").num_blocks == (4 + 1) * 3 + 1
    res = run_demo(opts)
    assert res["problems"] == []
    assert res["verified"] is True
    assert (res["requests"], res["rounds"], res["in_flight"]) == (20, 5, 4)
    assert res["released"] == {"read": 21}
    assert res["pool_bytes"] < 2 * 21 * res["request_bytes"] / 3  # far less than all requests at once


def test_pools_larger_than_the_machine_are_refused_before_anything_starts() -> None:
    big = DemoOptions(requests=2000, blocks_per_request=64, in_flight=0)
    with pytest.raises(MemoryError) as ei:
        big.check_memory(available=22 << 30)
    msg = str(ei.value)
    assert "500.25 GiB" in msg  # what it needs
    assert "22.00 GiB available" in msg  # what there is
    assert "--in-flight 64 fits" in msg  # and what would, with a quarter to spare:
    fits = DemoOptions(requests=2000, blocks_per_request=64, in_flight=64)
    fits.check_memory(available=int(0.75 * (22 << 30)))
    out = subprocess.run([sys.executable, "-m", "kvxfer", "demo", "--requests", "100000",
                          "--blocks-per-request", "64", "--in-flight", "0"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2
    assert "the KV pools need" in out.stderr
    assert "moved" not in out.stdout  # nothing ran


def test_a_ucx_that_cannot_run_the_error_mode_is_a_clear_refusal(sidecars: SidecarFactory) -> None:
    """``--ucx-error-mode peer`` with no transport that reports a peer's failure (``UCX_TLS=^tcp``
    here; an H200 run of tests/test_gpu.py met it on 2026-11-28): NIXL says only
    NIXL_ERR_BACKEND, and the sidecar died with a traceback while its engine waited 60 s for a
    ping. It now exits 2 at once, saying which setting and why; mode 'none' starts."""
    sc = sidecars.start("ucx-peer-no-tcp", "--ucx-error-mode", "peer", env={"UCX_TLS": "^tcp"})
    assert sc.proc.wait(60) == 2
    assert "error mode 'peer' needs a transport" in sc.log()
    assert "UCX_TLS=^tcp" in sc.log()
    assert "Traceback" not in sc.log()
    ok = sidecars.start("ucx-none-no-tcp", "--ucx-error-mode", "none", env={"UCX_TLS": "^tcp"})
    client = SidecarClient(ok.endpoint)
    try:
        client.ping(30)
    finally:
        client.close()


def test_a_sidecar_a_crashed_driver_started_stops_with_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A demo or test driver that dies without closing its SidecarFactory (a crash, SIGKILL)
    used to leave its sidecars running for good (48 of them once, here). They now stop with
    it (PR_SET_PDEATHSIG through ``KVXFER_PARENT_PID``)."""
    import os
    import time

    script = tmp_path / "driver.py"
    script.write_text(
        "import os, sys\n"
        "from kvxfer.client import SidecarClient\n"
        "from kvxfer.testing.procs import SidecarFactory\n"
        "f = SidecarFactory()\n"
        "sc = f.start('orphan')\n"
        "c = SidecarClient(sc.endpoint)\n"
        "c.ping(30)\n"
        "print(sc.proc.pid, f.dir, flush=True)\n"
        "os._exit(1)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         check=False)
    pid, workdir = int(out.stdout.split()[0]), out.stdout.split()[1]

    def running() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    end = time.monotonic() + 30
    while running() and time.monotonic() < end:
        time.sleep(0.1)
    outlived = running()
    if outlived:
        os.kill(pid, 9)
    shutil.rmtree(workdir, ignore_errors=True)  # (the driver never closed its factory)
    assert not outlived, "the sidecar outlived the process that started it"


def test_wait_any_drains_whichever_rank_answered_first() -> None:
    """The demo's decode engine waits on all its ranks at once: an event for the second rank
    is seen as it arrives, not once a wait on the first rank times out (which the demo's
    clock used to count: up to 0.5 s / ranks per wait, at every TP above 1)."""
    import os
    import tempfile
    import time

    import zmq

    from kvxfer.client import SidecarClient
    from kvxfer.protocol import Pong, encode

    with tempfile.TemporaryDirectory(prefix="kvx", dir="/tmp") as d, \
            zmq.Context.instance().socket(zmq.ROUTER) as router:
        endpoint = f"ipc://{d}/s"
        router.bind(endpoint)
        clients = [SidecarClient(endpoint) for _ in range(2)]
        try:
            for c in clients:
                c.heartbeat()  # the router learns both identities
            seen = {router.recv_multipart()[0] for _ in clients}
            second = f"w{os.getpid()}-{id(clients[1]):x}".encode()
            assert second in seen
            router.send_multipart([second, encode(Pong(seq=7, engine_id="e", version=1, handshake_host="h",
                                                       handshake_port=1))])
            t0 = time.monotonic()
            got = SidecarClient.wait_any(clients, 30.0)
            assert time.monotonic() - t0 < 15  # not the whole wait
            assert got[0].pongs == []
            assert [p.seq for p in got[1].pongs] == [7]
        finally:
            for c in clients:
                c.close()
