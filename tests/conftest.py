"""Fixtures that start real ``kvxfer serve`` processes and in-process synthetic engines."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvxfer.auth import new_token
from kvxfer.client import Drained, RemoteBlocks
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.kept import KeptSidecars
from kvxfer.testing.procs import SidecarFactory, SidecarProc

# Every vLLM server the tests start skips torch.compile: 17 s to start instead of 40 on 2 cores
# (about a dozen starts in a full run); requests run ~40% slower, and no test here times them.
# `make bench-vllm` keeps vLLM's default (its numbers are vLLM's as operators run it).
os.environ.setdefault("KVXFER_VLLM_SERVE_ARGS", "-O0")


@pytest.fixture(scope="module")
def sidecars() -> Iterator[SidecarFactory]:
    factory = SidecarFactory()
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def kept() -> Iterator[KeptSidecars]:
    """Demo sidecar pairs a module's ``run_demo`` cases share (one per set of serve arguments)."""
    pairs = KeptSidecars()
    yield pairs
    pairs.close()


@pytest.fixture
def factory() -> Iterator[SidecarFactory]:
    """Sidecars of one test only (stopped when it ends)."""
    with SidecarFactory() as f:
        yield f


@dataclass
class PD:
    prefill: SidecarProc
    decode: SidecarProc
    p: SyntheticEngine
    d: SyntheticEngine


@pytest.fixture(scope="module")
def pd(sidecars: SidecarFactory) -> Iterator[PD]:
    """A prefill and a decode sidecar process, each with a registered synthetic engine."""
    ps = sidecars.start("prefill", "--lease-s", "30", "--handshake-timeout-s", "1")
    ds = sidecars.start("decode", "--handshake-timeout-s", "1")
    layout = make_layout(layers=4, num_blocks=128, heads=4, head_dim=64)
    p = SyntheticEngine(layout, ps.endpoint, seed=1)
    d = SyntheticEngine(layout, ds.endpoint, seed=2)
    try:
        p.start()
        d.start()
        yield PD(ps, ds, p, d)
    finally:
        p.close()
        d.close()


def pull(p: SyntheticEngine, d: SyntheticEngine, req: str, n: int, timeout: float = 20.0,
         **remote: object) -> tuple[list[int], list[int], Drained]:
    """Fill n fresh prefill blocks with ``req``'s pattern and hold them; the decode reads them
    into n fresh blocks. Returns (prefill blocks, decode blocks, the decode's Done/Failed)."""
    reg = p.registered
    assert reg is not None
    pb, db = p.allocate(n), d.allocate(n)
    p.fill(req, pb)
    token = new_token()  # a test may read with another (remote["token"])
    p.client.hold(req, pb, token=token)
    d.wipe(db)
    remote.setdefault("token", token)
    where = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb, **remote)  # type: ignore[arg-type]
    d.client.recv(req, db, where)
    got = d.client.wait_until(lambda a: bool(a.done or a.failed), timeout)
    assert got.done or got.failed, f"no answer for {req} within {timeout}s"
    return pb, db, got
