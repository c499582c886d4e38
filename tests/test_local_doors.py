"""Another user of the same host gets nothing from a sidecar's loopback doors (#40, doors 1-2).

Loopback is reachable by every uid on the host. The attacker here is a real other user: a
child of ``tests.attacker`` that drops to uid 65534 with ``os.setuid`` and then dials a real
sidecar (default loopback handshake bind, no shared secret) and its gRPC control plane on
loopback TCP. Each test then shows the sidecar's own user still gets what it should, ending
with a transfer whose bytes verify.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc

from kvxfer import hostkey
from kvxfer.client import RemoteBlocks
from kvxfer.control.local import local_channel
from kvxfer.control.v1 import control_pb2 as pb
from kvxfer.control.v1 import control_pb2_grpc as pb_grpc
from kvxfer.protocol import compat_hash
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port

LAYOUT = make_layout(layers=2, num_blocks=32, heads=2, head_dim=32)
ROOT = Path(__file__).resolve().parent.parent


def _attack(name: str, *args: Any) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "tests.attacker", name, json.dumps(args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "crash" not in got, got
    assert got["uid"] == 65534, got  # really another user
    return got


def _prefill(factory: SidecarFactory, name: str, *args: str) -> tuple[SidecarProc, SyntheticEngine, str]:
    tcp = f"127.0.0.1:{free_port()}"
    unix = f"unix://{factory.dir}/{name}.ctl"
    sc = factory.start(name, "--role", "prefill", "--control-target", f"{unix},{tcp}", *args,
                       metrics_port=free_port())
    eng = SyntheticEngine(LAYOUT, sc.endpoint, seed=1)
    eng.start()
    return sc, eng, tcp


def _hold(eng: SyntheticEngine, req_id: str) -> list[int]:
    blocks = eng.allocate(3)
    eng.fill(req_id, blocks)
    eng.client.hold(req_id, blocks, lease_s=60)
    return blocks


def _read_and_verify(factory: SidecarFactory, p: SyntheticEngine, req_id: str, blocks: list[int]) -> None:
    """A decode sidecar of the sidecar's own user reads the held blocks: bytes verified."""
    ds = factory.start("own-d", "--role", "decode")
    d = SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    try:
        d.start()
        reg = p.registered
        assert reg is not None
        dst = d.allocate(len(blocks))
        d.wipe(dst)
        d.client.recv(req_id, dst, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port,
                                                blocks))
        got = d.client.wait_until(lambda a: bool(a.done or a.failed), 30)
        assert [x.req_id for x in got.done] == [req_id], got
        assert d.verify(req_id, dst)
    finally:
        d.close()


def test_another_user_gets_a_challenge_not_the_nixl_metadata(factory: SidecarFactory) -> None:
    """No secret, default loopback bind: the handshake is authenticated with the host key,
    which the other user cannot read; its Hello gets a Challenge, never a Welcome (whose
    second frame is the NIXL metadata that let #40's attacker READ 1 MiB of KV)."""
    ps, p, _ = _prefill(factory, "victim")
    try:
        blocks = _hold(p, "r-victim")
        assert p.registered is not None
        key = hostkey.default_path()
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
        got = _attack("handshake", p.registered.handshake_port, compat_hash(LAYOUT), LAYOUT.model, key)
        assert got["key"] == "PermissionError", got
        assert got["reply"] == "Challenge", got
        assert got["metadata_bytes"] == 0, got
        assert "host key" in ps.log()
        assert not p.client.poll().released
        _read_and_verify(factory, p, "r-victim", blocks)  # this user's sidecars trust each other
    finally:
        p.close()


def test_insecure_on_loopback_is_open_to_every_user_and_says_so(factory: SidecarFactory) -> None:
    """--insecure is the door #40 found, kept on purpose for who asks for it: the other
    user gets a Welcome and the metadata; the sidecar shows INSECURE."""
    ps, p, _ = _prefill(factory, "open", "--insecure")
    try:
        assert p.registered is not None
        got = _attack("handshake", p.registered.handshake_port, compat_hash(LAYOUT), LAYOUT.model,
                      hostkey.default_path())
        assert got["reply"] == "Welcome", got
        assert got["metadata_bytes"] > 0, got
        assert ps.scrape()["kvxfer_insecure"] == 1.0
    finally:
        p.close()


def test_another_user_can_neither_list_nor_change_anything_over_loopback_grpc(
        factory: SidecarFactory) -> None:
    """#40 listed held request ids and released a hold with Drain from another uid over
    loopback TCP. Now: GetStatus answers without leases, transfers or peers (redacted), every
    listing and mutating verb is PERMISSION_DENIED, a call signed with a key of the
    attacker's making is UNAUTHENTICATED; the hold stands. The sidecar's own user (the CLI
    signs with the host key) sees the lease over the same TCP listener and can drain."""
    ps, p, tcp = _prefill(factory, "ctl")
    try:
        blocks = _hold(p, "r-ctl")
        got = _attack("control", tcp, "r-ctl")
        assert got["GetStatus"] == "OK", got
        assert got["status_redacted"] is True, got
        assert got["status_leases"] == [], got
        for verb in ("ListTransfers", "ListPeers", "WatchEvents", "CancelTransfer", "Drain"):
            assert got[verb] == "PERMISSION_DENIED", (verb, got)
        assert got["Drain_forged_key"] == "UNAUTHENTICATED", got
        assert not p.client.poll().released  # the hold stands
        st = pb_grpc.ControlStub(local_channel(tcp)).GetStatus(pb.GetStatusRequest(), timeout=5)
        assert not st.redacted, st
        assert [x.request_id for x in st.leases] == ["r-ctl"], st
        assert ps.scrape().get('kvxfer_control_denied_total{code="PERMISSION_DENIED",method="Drain"}', 0) >= 1
        cli = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--json", "--target", tcp],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert [x["request_id"] for x in json.loads(cli.stdout)["leases"]] == ["r-ctl"]
        _read_and_verify(factory, p, "r-ctl", blocks)
        drained = subprocess.run([sys.executable, "-m", "kvxfer", "drain", "--json", "--drain-timeout", "2",
                                  "--target", tcp], capture_output=True, text=True, timeout=60)
        assert drained.returncode == 0, drained.stderr
    finally:
        p.close()


def test_the_unix_control_socket_is_this_users_alone(factory: SidecarFactory) -> None:
    """The unix control socket needs no token, so its file is 0600: the other user cannot
    even connect."""
    ps, p, _ = _prefill(factory, "ctl-unix")
    try:
        path = ps.control.removeprefix("unix://")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        got = _attack("control", ps.control, "x")
        assert got["GetStatus"] == "UNAVAILABLE", got
        with grpc.insecure_channel(ps.control) as ch:  # this user: no token needed
            st = pb_grpc.ControlStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
            assert not st.redacted
    finally:
        p.close()
