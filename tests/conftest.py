"""Fixtures that start real ``kvxfer serve`` processes and in-process synthetic engines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvxfer.testing.engine import SyntheticEngine, make_layout


@dataclass
class SidecarProc:
    name: str
    endpoint: str
    proc: subprocess.Popen[bytes]
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()


class SidecarFactory:
    def __init__(self) -> None:
        # ipc paths must stay under ~100 bytes: keep the directory short.
        self.dir = tempfile.mkdtemp(prefix="kvx", dir="/tmp")
        self.procs: list[SidecarProc] = []

    def start(self, name: str, *args: str) -> SidecarProc:
        sock = os.path.join(self.dir, f"{name}.sock")
        log_path = os.path.join(self.dir, f"{name}.log")
        cmd = [
            sys.executable, "-m", "kvxfer", "serve", "--engine-id", name,
            "--engine-socket", f"ipc://{sock}", "--handshake-port", "0", *args,
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        sc = SidecarProc(name, f"ipc://{sock}", proc, log_path)
        self.procs.append(sc)
        return sc

    def close(self) -> None:
        for sc in self.procs:
            if sc.proc.poll() is None:
                sc.proc.terminate()
        for sc in self.procs:
            try:
                sc.proc.wait(10)
            except subprocess.TimeoutExpired:
                sc.proc.kill()
                sc.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


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
