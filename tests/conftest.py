"""Fixtures that start real ``kvxfer serve`` processes and in-process synthetic engines."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc


@pytest.fixture(scope="module")
def sidecars() -> Iterator[SidecarFactory]:
    factory = SidecarFactory()
    yield factory
    factory.close()


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
