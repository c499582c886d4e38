"""What an operator sees of a running daemon: JSON log lines, a log level changed with SIGHUP,
no raw UCX lines at the default level, build info in /metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvxfer.testing.procs import free_port


def serve(tmp: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "kvxfer", "serve", "--engine-socket", f"ipc://{tmp}/e.sock",
           "--control-target", f"unix://{tmp}/c.sock", "--handshake-port", "0", *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVXFER_", "UCX_", "NIXL_"))}
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=clean | (env or {}))


def wait_ready(proc: subprocess.Popen[str], lines: list[str]) -> None:
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if "ready:" in line:
            return
    raise AssertionError(f"not ready: {lines}")


def finish(proc: subprocess.Popen[str], lines: list[str]) -> None:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    lines += err.splitlines()


def test_json_logs_and_a_log_level_changed_with_sighup(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text('log_level = "WARNING"\n')
    proc = serve(tmp_path, "--config", str(cfg), "--log-format", "json", "--metrics-port", "0")
    lines: list[str] = []
    try:
        wait_ready(proc, lines)
        cfg.write_text('log_level = "DEBUG"\n')
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        cfg.write_text('log_level = "LOUD"\n')  # a bad reload keeps the daemon and its level
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None
    finally:
        finish(proc, lines)
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert {"time", "level", "logger", "message"} <= set(records[0])
    assert "ready:" in records[0]["message"]
    assert any(r["message"] == "SIGHUP: log level now DEBUG" for r in records), records
    bad = [r for r in records if r["message"].startswith("SIGHUP: configuration not reloaded")]
    assert bad, records
    assert bad[0]["level"] == "ERROR"
    assert "log_level must be one of" in bad[0]["message"]


def test_no_raw_ucx_lines_at_the_default_level_and_build_info(tmp_path: Path) -> None:
    """UCX prints DIAG lines at every exit (and dozens when a peer leaves) at its own default
    level; the sidecar keeps UCX at errors below its DEBUG."""
    port = free_port()
    proc = serve(tmp_path, "--metrics-port", str(port))
    lines: list[str] = []
    try:
        wait_ready(proc, lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        finish(proc, lines)
    assert not [line for line in lines if " UCX " in line], lines
    info = next(line for line in metrics.splitlines() if line.startswith("kvxfer_build_info{"))
    for label in ("version=", "nixl=", "python="):
        assert label in info, info
    assert info.endswith(" 1.0")


def test_handshakes_are_logged_with_the_peer_and_counted() -> None:
    from kvxfer.client import SidecarClient
    from kvxfer.testing.engine import SyntheticEngine, make_layout
    from kvxfer.testing.procs import SidecarFactory
    from tests.conftest import pull

    with SidecarFactory() as f:
        ps = f.start("p", metrics_port=free_port())
        ds = f.start("d")
        lay = make_layout(layers=1, num_blocks=8, heads=1, head_dim=8)
        d = SyntheticEngine(lay, ds.endpoint)
        p = SyntheticEngine(lay, ps.endpoint)
        probe = SidecarClient(ps.endpoint)
        try:
            d.start()
            reg = d.registered
            assert reg is not None
            pong = probe.ping(30)  # (answers once the prefill sidecar is up)
            hs = f"{pong.handshake_host}:{pong.handshake_port}"

            def connect() -> subprocess.CompletedProcess[str]:
                return subprocess.run([sys.executable, "-m", "kvxfer", "peers", "connect", hs, "--target",
                                       ds.control], capture_output=True, text=True, timeout=60, check=False)

            assert connect().returncode != 0  # the prefill has no engine yet: refused
            p.start()
            ok = connect()
            assert ok.returncode == 0, ok.stderr
            log = ps.log()
            refused = next(line for line in log.splitlines() if "handshake refused" in line)
            assert "from 127.0.0.1, " in refused, refused  # the peer's address
            assert f"of engine {reg.engine_id!r}" in refused, refused
            assert "no KV cache registered yet" in refused
            accepted = next(line for line in log.splitlines() if "accepted" in line)
            assert "handshake from 127.0.0.1 (" in accepted, accepted
            m = ps.scrape()
            assert m["kvxfer_handshakes_accepted_total"] == 1
            assert m['kvxfer_handshakes_refused_total{code="not_registered"}'] == 1
            # reads served, by the reading engine (the read notice reaches the prefill just after
            # the decode's Done)
            pull(p, d, "served", 3)
            key = f'kvxfer_served_reads_total{{peer="{reg.engine_id}"}}'
            deadline = time.monotonic() + 10
            while key not in m and time.monotonic() < deadline:
                time.sleep(0.05)
                m = ps.scrape()
            assert m[key] == 1
            assert m[f'kvxfer_served_blocks_total{{peer="{reg.engine_id}"}}'] == 3
        finally:
            probe.close()
            p.close()
            d.close()


def test_a_resume_during_a_drains_cancels_leaves_the_holds_taken_since() -> None:
    """A drain that timed out cancels what is left, then releases every hold; an operator's
    Resume while it cancelled let engines hold again, and those new holds were then released
    too (their decodes found them gone and recomputed; found by a review). The parts stood in
    for: the drain's own logic."""
    import asyncio
    import types
    from unittest import mock

    from kvxfer.sidecar.lifecycle import Lifecycle
    from kvxfer.sidecar.operations import Operations

    released: list[str] = []
    held = ["old"]

    class Holds:
        def __len__(self) -> int:
            return len(held)

        def release_all(self) -> int:
            n = len(held)
            released.extend(held)
            held.clear()
            return n

    async def run() -> bool:
        gate, entered = asyncio.Event(), asyncio.Event()

        class Receiver:
            recvs = {"k": object()}

            async def cancel(self, *a: object) -> int:
                entered.set()
                await gate.wait()
                Receiver.recvs = {}
                return 1

        lifecycle = Lifecycle()
        parts = types.SimpleNamespace(lifecycle=lifecycle, observer=mock.MagicMock(), receiver=Receiver(),
                                      holds=Holds(), idle=asyncio.Event())
        ops = Operations(parts)  # type: ignore[arg-type]
        drain = asyncio.ensure_future(ops.drain(0.01))
        await entered.wait()
        assert await ops.resume()  # the operator resumes while the drain cancels
        held.append("new-after-resume")  # an engine's Hold taken after the resume
        gate.set()
        await drain
        return lifecycle.draining

    draining = asyncio.run(run())
    assert "new-after-resume" not in released, f"released after the resume: {released}"
    assert not draining
