"""Start and stop real ``kvxfer serve`` processes (tests, benchmarks)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass
class SidecarProc:
    name: str
    endpoint: str  # engine socket
    proc: subprocess.Popen[bytes]
    log_path: str
    control: str  # gRPC target

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
        control = f"unix://{os.path.join(self.dir, name)}.ctl"
        cmd = [
            sys.executable, "-m", "kvxfer", "serve", "--engine-id", name,
            "--engine-socket", f"ipc://{sock}", "--handshake-port", "0",
            "--control-target", control, "--metrics-port", "0", *args,
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        sc = SidecarProc(name, f"ipc://{sock}", proc, log_path, control)
        self.procs.append(sc)
        return sc

    def close(self) -> None:
        for sc in self.procs:
            if sc.proc.poll() is None:
                sc.proc.send_signal(signal.SIGINT)  # stop now; SIGTERM would drain first
        for sc in self.procs:
            try:
                sc.proc.wait(10)
            except subprocess.TimeoutExpired:
                sc.proc.kill()
                sc.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SidecarFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
