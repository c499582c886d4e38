"""Connection storms on every listener of a running sidecar (#40, door 6).

A storm is 10,000 connections to one listener, each completing its connect (TCP handshake,
or a place in the unix socket's backlog), opened in waves of 1,000 held at once and then
closed without a byte sent: what a port scanner, a load balancer's health checks gone wrong
or a buggy client does. Three rounds of one storm on each listener of a prefill and a decode
sidecar (handshake, engine socket, memory channel, gRPC control, gRPC health, /metrics);
after each round, engines register within 5 s and a transfer verifies its bytes; across the
three rounds each sidecar's RSS may grow 32 MiB at most. Before #40 the gRPC servers grew
15-24 MiB per storm (45-72 MiB in three: still caught; five rounds cost CI 20 s more) and
the /metrics server kept a thread per idle connection (it never
finished a storm in five minutes).
"""

from __future__ import annotations

import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port
from tests.conftest import pull

STORM = 10_000
WAVE = 1_000
ROUNDS = 3
RSS_BUDGET_MIB = 32
LAYOUT = make_layout(layers=2, num_blocks=64, heads=2, head_dim=32)


@dataclass
class Target:
    family: int
    kind: int
    addr: str | tuple[str, int]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        line = next(x for x in fh if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def storm(t: Target, total: int = STORM, wave: int = WAVE) -> int:
    """Open ``total`` connections to ``t`` in waves of ``wave`` held at once; the number that
    did not connect within 5 s."""
    failed = 0
    for _ in range(total // wave):
        held = []
        for _ in range(wave):
            s = socket.socket(t.family, t.kind)
            if t.family == socket.AF_UNIX:  # (a blocking connect waits for room in the backlog)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 5, 0))
            else:
                s.settimeout(5)
            try:
                s.connect(t.addr)
                held.append(s)
            except OSError:
                failed += 1
                s.close()
        for s in held:
            s.close()
    return failed


def targets(sc: SidecarProc, handshake_port: int, health_port: int) -> dict[str, Target]:
    sock = sc.endpoint.removeprefix("ipc://")
    tcp, unix = (socket.AF_INET, socket.SOCK_STREAM), (socket.AF_UNIX, socket.SOCK_STREAM)
    return {
        "handshake": Target(*tcp, ("127.0.0.1", handshake_port)),
        "engine": Target(*unix, sock),
        "memory": Target(socket.AF_UNIX, socket.SOCK_SEQPACKET, sock + ".mem"),
        "control": Target(*unix, sc.control.removeprefix("unix://")),
        "health": Target(*tcp, ("127.0.0.1", health_port)),
        "metrics": Target(*tcp, ("127.0.0.1", sc.metrics_port)),
    }


@pytest.fixture
def more_files() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * WAVE + 256:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is too low for waves of {WAVE}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("more_files")
def test_storms_on_every_listener_cost_no_memory_and_no_service(factory: SidecarFactory) -> None:
    sides = {}
    for name in ("prefill", "decode"):
        health = free_port()
        # (no staging arena: the torch import it starts in the background would land in the
        # first rounds' RSS; storms never reach a staged read)
        sc = factory.start(name, "--health-target", f"127.0.0.1:{health}", "--staging-mib", "0",
                           metrics_port=free_port())
        sides[name] = (sc, health)
    p = SyntheticEngine(LAYOUT, sides["prefill"][0].endpoint, seed=1)
    d = SyntheticEngine(LAYOUT, sides["decode"][0].endpoint, seed=2)
    p.start()  # (registered all along: its pools and its connections must outlive every storm)
    d.start()
    _, db, got = pull(p, d, "before", 4)
    assert got.done
    assert d.verify("before", db)
    hs = {"prefill": p.registered.handshake_port, "decode": d.registered.handshake_port}  # type: ignore[union-attr]
    d.close()
    aims = {name: targets(sc, hs[name], health) for name, (sc, health) in sides.items()}
    pids = {name: sc.proc.pid for name, (sc, _) in sides.items()}
    base = {name: rss_mib(pid) for name, pid in pids.items()}
    rows = ["RSS MiB at start: " + ", ".join(f"{n} {v:.1f}" for n, v in base.items())]
    for rnd in range(ROUNDS):
        for listener in aims["prefill"]:
            failed: dict[str, int] = {}

            def run(name: str, target: Target, failed: dict[str, int] = failed) -> None:
                failed[name] = storm(target)

            t0 = time.monotonic()
            threads = [threading.Thread(target=run, args=(n, aims[n][listener])) for n in aims]  # (both)
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            took = time.monotonic() - t0
            rows.append(f"round {rnd + 1} {listener:9s} {took:5.1f}s " + ", ".join(
                f"{n} {rss_mib(pid):6.1f} MiB ({failed[n]} not connected)" for n, pid in pids.items()))
            assert not any(failed.values()), rows[-1]
        start = time.monotonic()  # a new decode engine registers and a transfer verifies, within 5 s
        d = SyntheticEngine(LAYOUT, sides["decode"][0].endpoint, seed=2)  # (its pool: the memory channel)
        try:
            d.start(5)
            _, db, got = pull(p, d, f"after-{rnd}", 4, timeout=5)
            took = time.monotonic() - start
            rows.append(f"round {rnd + 1} an engine registered and a transfer verified in {took:.2f}s")
            assert got.done, (got, rows)
            assert d.verify(f"after-{rnd}", db)
            assert took < 5, rows
        finally:
            d.close()
    p.close()
    growth = {name: rss_mib(pid) - base[name] for name, pid in pids.items()}
    rows.append(f"RSS growth over {ROUNDS} rounds: "
                + ", ".join(f"{n} {g:+.1f} MiB" for n, g in growth.items()))
    print("\n".join(rows))
    assert all(g <= RSS_BUDGET_MIB for g in growth.values()), rows
    for name, (sc, _) in sides.items():  # the caps were hit, counted and said
        metrics = sc.scrape()
        assert metrics.get('kvxfer_connections_refused_total{listener="memory"}', 0) > 0, name
        assert metrics.get('kvxfer_connections_refused_total{listener="metrics"}', 0) > 0, name
        assert "closed, it holds its maximum" in sc.log(), name
        assert os.path.exists(sc.endpoint.removeprefix("ipc://") + ".mem")
