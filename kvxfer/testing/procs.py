"""Start and stop real ``kvxfer serve`` processes (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass
class SidecarProc:
    name: str
    endpoint: str  # engine socket
    proc: subprocess.Popen[bytes]
    log_path: str
    control: str  # gRPC target
    metrics_port: int = 0  # 0: /metrics disabled

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()

    @property
    def handshake_endpoint(self) -> tuple[str, int]:
        """(host, port) its peers dial (a Pong's; what a push-mode router is configured with)."""
        from kvxfer.client import SidecarClient

        client = SidecarClient(self.endpoint, ring=False)
        try:
            pong = client.ping(10.0)
        finally:
            client.close()
        return pong.handshake_host, pong.handshake_port

    def scrape(self) -> dict[str, float]:
        """The sidecar's kvxfer_* Prometheus series, by name with labels."""
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read()
        out = {}
        for line in body.decode().splitlines():
            if line.startswith("kvxfer"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            lo, hi = (int(x) for x in fh.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (tests and the demo), never handed out twice by
    this process, and *below the kernel's ephemeral range*: a port the kernel picked for
    ``bind(0)`` is released again here, and the next sidecar (or UCX, which binds its own
    listeners to port 0) could be given it before its owner binds it ("Address already in
    use" at start-up). Ports below that range are never chosen by the kernel; pyzmq's
    ``bind_to_random_port`` picks from 49152 up."""
    lo, _hi = _ephemeral_range()
    start = max(1024, min(20000, lo - 4096))
    for _ in range(200):
        port = random.randrange(start, lo)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in [{start}, {lo})")


class SidecarFactory:
    def __init__(self) -> None:
        # ipc paths must stay under ~100 bytes: keep the directory short.
        self.dir = tempfile.mkdtemp(prefix="kvx", dir="/tmp")
        self.procs: list[SidecarProc] = []

    def start(
        self,
        name: str,
        *args: str,
        metrics_port: int = 0,
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> SidecarProc:
        """Start ``kvxfer serve``; ``prefix`` wraps the command (e.g. ``ip netns exec NS``)."""
        sock = os.path.join(self.dir, f"{name}.sock")
        log_path = os.path.join(self.dir, f"{name}.log")
        control = f"unix://{os.path.join(self.dir, name)}.ctl"
        cmd = [
            *prefix, sys.executable, "-m", "kvxfer", "serve", "--engine-id", name,
            "--engine-socket", f"ipc://{sock}", "--handshake-port", "0",
            "--control-target", control, "--metrics-port", str(metrics_port),
            "--metrics-host", "127.0.0.1", *args,
        ]
        child_env = {**os.environ, **(env or {})}
        child_env.pop("KVXFER_PARENT_PID", None)  # (one this process inherited names another parent)
        # (the sidecar stops when this process dies: kvxfer.serve._tie_to_parent; not through a
        # wrapper, whose pid it would see, nor from a thread, whose end would stop it)
        if not prefix and threading.current_thread() is threading.main_thread():
            child_env["KVXFER_PARENT_PID"] = str(os.getpid())
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env)
        sc = SidecarProc(name, f"ipc://{sock}", proc, log_path, control, metrics_port)
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
        keep = os.environ.get("KVXFER_KEEP_LOGS")  # (make gpu-check: the sidecars' logs outlive the test)
        if keep:
            os.makedirs(keep, exist_ok=True)
            for sc in self.procs:
                dest = os.path.join(keep, f"{os.path.basename(self.dir)}-{sc.name}.log")
                with contextlib.suppress(OSError):
                    shutil.copyfile(sc.log_path, dest)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SidecarFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def handshake_dealer(ctx: Any, host: str, port: int, key_file: str = "") -> Any:
    """A raw ZMQ DEALER to a sidecar's handshake listener, as this user's own sidecars dial it:
    a CurveZMQ client of the server key derived from the host key (a loopback sidecar with no
    shared secret listens with it; a plain DEALER would never complete the handshake)."""
    import zmq

    from kvxfer import hostkey
    from kvxfer.auth import curve_server_keys

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)  # a test never hangs on a queue that cannot drain
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.curve_serverkey = curve_server_keys(hostkey.load(key_file or hostkey.default_path()))[0]
    sock.connect(f"tcp://{host}:{port}")
    return sock
