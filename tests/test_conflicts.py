"""One owner per engine socket and port: a second sidecar on a taken engine socket, a taken
handshake, metrics or control port each refuse to start with one line naming the listener
and exit 2; a sidecar whose socket file is removed under it stops reporting ready. Real
`kvxfer serve` processes."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from kvxfer.client import SidecarClient
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port


def ping(sc: SidecarProc, endpoint: str = "") -> None:
    c = SidecarClient(endpoint or sc.endpoint)
    try:
        c.ping(30)
    finally:
        c.close()


def refused(sc: SidecarProc, *words: str) -> str:
    rc = sc.proc.wait(60)
    log = sc.log()
    assert rc == 2, log[-2000:]
    assert "Traceback" not in log, log[-3000:]
    for w in words:
        assert w in log, log[-2000:]
    return log


def test_a_second_sidecar_on_a_taken_engine_socket_refuses_and_leaves_the_first_alone(
        factory: SidecarFactory) -> None:
    first = factory.start("owner")
    ping(first)
    path = first.endpoint.removeprefix("ipc://")
    second = factory.start("intruder", "--engine-socket", first.endpoint)
    refused(second, f"engine socket {path} belongs to a running sidecar (pid {first.proc.pid}")
    assert os.path.exists(path)  # not deleted by the one that refused
    ping(first)  # and the first still answers on it
    # once the owner is gone (even by SIGKILL, socket file left behind), the socket is free
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    third = factory.start("successor", "--engine-socket", first.endpoint)
    ping(third, first.endpoint)
    assert third.proc.poll() is None


def test_taken_ports_are_refused_naming_the_listener(factory: SidecarFactory) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        refused(factory.start("hs", "--handshake-port", str(port)), f"handshake listener 127.0.0.1:{port}",
                "Address already in use")
        refused(factory.start("metrics", metrics_port=port), f"metrics listener 127.0.0.1:{port}",
                "--metrics-port")
        refused(factory.start("ctl", "--control-target", f"127.0.0.1:{port}"), "control listener",
                f"127.0.0.1:{port}")
        refused(factory.start("health", "--health-target", f"127.0.0.1:{port}"), "control listener",
                f"127.0.0.1:{port}")


def test_a_control_or_health_port_another_sidecar_serves_is_refused(factory: SidecarFactory) -> None:
    """gRPC binds with SO_REUSEPORT unless told not to: a second sidecar given the control or
    health port of a running one bound it as well, and the kernel handed each connection to
    either (a ``kvxfer status`` or ``drain`` reached a random one of the two)."""
    ctl, health = free_port(), free_port()
    first = factory.start("ctl-owner", "--control-target", f"127.0.0.1:{ctl}",
                          "--health-target", f"127.0.0.1:{health}")
    ping(first)
    refused(factory.start("ctl-twin", "--control-target", f"127.0.0.1:{ctl}"), "control listener",
            f"127.0.0.1:{ctl}")
    refused(factory.start("health-twin", "--health-target", f"127.0.0.1:{health}"), "control listener",
            f"127.0.0.1:{health}")
    assert first.proc.poll() is None


def test_readiness_goes_off_when_the_engine_socket_is_removed(factory: SidecarFactory) -> None:
    sc = factory.start("lost", "--engine-check-s", "0.2", metrics_port=free_port())
    ping(sc)
    assert sc.scrape()["kvxfer_ready"] == 1
    os.unlink(sc.endpoint.removeprefix("ipc://"))
    deadline = time.monotonic() + 10
    while sc.scrape()["kvxfer_ready"] != 0:
        assert time.monotonic() < deadline, sc.log()[-2000:]
        time.sleep(0.1)
    assert "was removed: engines cannot reach this sidecar; readiness off" in sc.log()


@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_a_sidecar_never_deletes_a_socket_it_does_not_own(factory: SidecarFactory, sig: int) -> None:
    """The file at its path was replaced (an operator, another process): on exit it is left."""
    sc = factory.start("replaced")
    ping(sc)
    path = sc.endpoint.removeprefix("ipc://")
    os.unlink(path)
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(path)
        sc.proc.send_signal(sig)
        sc.proc.wait(30)
        assert os.path.exists(path)
