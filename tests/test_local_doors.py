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
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

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
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacker drops to another uid: needs root")


def _attack(name: str, *args: Any) -> dict[str, Any]:
    for _ in range(2):  # (an attacker process that hung, its stacks on stderr, is run once more:
        out = subprocess.run([sys.executable, "-m", "tests.attacker", name, json.dumps(args)],  # a hang
                             cwd=ROOT, capture_output=True, text=True, timeout=120)  # is no answer
        assert out.returncode == 0, out.stderr  # of the sidecar's, and proves nothing either way)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        if got.get("crash") != "no answer":
            break
        print(f"the attacker hung; its stacks:\n{out.stderr[-4000:]}")
    assert "crash" not in got, (got, out.stderr[-4000:])
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


def test_another_user_gets_no_answer_and_not_the_nixl_metadata(factory: SidecarFactory) -> None:
    """No secret, default loopback bind: the handshake is authenticated with the host key,
    which the other user cannot read, and encrypted with CURVE keys derived from it; its
    Hello gets no answer at all, never a Welcome (whose second frame is the NIXL metadata
    that let #40's attacker READ 1 MiB of KV)."""
    ps, p, _ = _prefill(factory, "victim")
    try:
        blocks = _hold(p, "r-victim")
        assert p.registered is not None
        key = hostkey.default_path()
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
        got = _attack("handshake", p.registered.handshake_port, compat_hash(LAYOUT), LAYOUT.model, key)
        assert got["key"] == "PermissionError", got
        assert got["reply"] == "none", got
        assert got["metadata_bytes"] == 0, got
        assert "host key" in ps.log()
        shown = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", ps.control],
                               capture_output=True, text=True, timeout=60)
        assert "security   host key (loopback" in shown.stdout, shown.stdout
        assert not p.client.poll().released
        _read_and_verify(factory, p, "r-victim", blocks)  # this user's sidecars trust each other
    finally:
        p.close()


def test_a_relay_of_another_user_sees_only_ciphertext(factory: SidecarFactory) -> None:
    """Another user puts a TCP relay in front of the prefill's handshake port and gets a
    request's kv_transfer_params to name it (any client of the decode's HTTP API can). The
    decode's handshake goes through (CURVE end to end: the relay cannot answer as the
    listener) and the bytes verify, but the relay never sees the prefill's agent name,
    which its Welcome and NIXL metadata carry in clear without CURVE."""
    ps, p, _ = _prefill(factory, "relayed")
    ds = factory.start("relay-d", "--role", "decode")
    d = SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    relay = None
    try:
        d.start()
        blocks = _hold(p, "r-relay")
        reg = p.registered
        assert reg is not None
        with grpc.insecure_channel(ps.control) as ch:
            agent = pb_grpc.ControlStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5).identity.agent_name
        port = free_port()
        relay = subprocess.Popen([sys.executable, "-m", "tests.attacker", "relay",
                                  json.dumps([port, reg.handshake_port, 6.0, agent])], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        while True:  # until the relay listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the relay never listened"
                time.sleep(0.05)
        dst = d.allocate(len(blocks))
        d.wipe(dst)
        d.client.recv("r-relay", dst, RemoteBlocks(reg.engine_id, "127.0.0.1", port, blocks))
        got = d.client.wait_until(lambda a: bool(a.done or a.failed), 30)
        assert [x.req_id for x in got.done] == ["r-relay"], got
        assert d.verify("r-relay", dst)
        out, err = relay.communicate(timeout=60)
        seen = json.loads(out.strip().splitlines()[-1])
        assert "crash" not in seen, (seen, err)
        assert seen["uid"] == 65534, seen
        assert seen["relayed"] > 0, seen  # the handshake did go through the relay
        assert not seen["needle_seen"], seen  # and it learnt nothing from it
    finally:
        if relay is not None and relay.poll() is None:
            relay.kill()
        d.close()
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


def test_the_host_key_stays_on_loopback_a_remote_open_prefill_is_still_read(factory: SidecarFactory) -> None:
    """A decode with no secret (so: the host key on loopback) dials a prefill beyond
    loopback that runs --insecure: the host key is never offered there (no challenge can
    be answered by it, no welcome is expected to be signed with it), and the read verifies
    as before #40. The same decode still refuses an unsigned welcome on loopback."""
    from tests.test_control_access import host_ip

    addr = host_ip()
    ps = factory.start("far-p", "--role", "prefill", "--handshake-host", "0.0.0.0", "--insecure",
                       "--advertise-host", addr)
    p = SyntheticEngine(LAYOUT, ps.endpoint, seed=1)
    try:
        p.start()
        blocks = _hold(p, "r-far")
        _read_and_verify(factory, p, "r-far", blocks)  # dials addr: beyond loopback
        reg = p.registered
        assert reg is not None
        assert reg.handshake_host == addr
        ds = factory.start("near-d", "--role", "decode")
        d = SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
        try:
            d.start()
            blocks2 = _hold(p, "r-near")
            near = RemoteBlocks(reg.engine_id, "127.0.0.1", reg.handshake_port, blocks2)
            d.client.recv("r-near", d.allocate(3), near)
            got = d.client.wait_until(lambda a: bool(a.done or a.failed), 30)
            assert [f.code for f in got.failed] == ["handshake_failed"], got
            assert "--insecure" in got.failed[0].reason
        finally:
            d.close()
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
