"""Access control of the gRPC control plane, over real TLS against real sidecars.

A test CA (openssl) signs the sidecar's server certificate and two client certificates
(an admin and a dashboard); a second CA signs an impostor. The decode sidecar listens on a
unix socket and on 0.0.0.0 with mutual TLS; "remote" callers dial this host's non-loopback
address, so the sidecar sees a non-local peer, as it would from another machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvxfer import auth, hostkey
from kvxfer.client import RemoteBlocks
from kvxfer.control.access import AccessPolicy
from kvxfer.control.local import signed
from kvxfer.control.v1 import control_pb2 as pb
from kvxfer.control.v1 import control_pb2_grpc as pb_grpc
from kvxfer.targets import is_local_peer
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port
from tests.test_sidecar import wait_for

SERVER_NAME = "sidecar.kvxfer.test"
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN={name}", cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl("req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", f"subjectAltName=DNS:{SERVER_NAME},DNS:localhost,IP:127.0.0.1\n"
                             "extendedKeyUsage=serverAuth")
    _leaf(d, "kvxfer-admin", "ca", "extendedKeyUsage=clientAuth")
    _leaf(d, "dashboard", "ca", "extendedKeyUsage=clientAuth")
    _leaf(d, "impostor", "rogue-ca", "extendedKeyUsage=clientAuth")
    (d / "token").write_text("s3cret-control-token\n")
    return d


def host_ip() -> str:
    """This host's non-loopback IPv4 address (the source address of a remote-looking call)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                         text=True, timeout=10, check=False).stdout.split()
    addrs = [out[i + 1].split("/")[0] for i, word in enumerate(out[:-1]) if word == "inet"]
    if not addrs:
        pytest.skip("no non-loopback IPv4 address to call from")
    return addrs[0]


@dataclass
class Setup:
    pki: Path
    ps: SidecarProc
    ds: SidecarProc
    unix: str  # decode's unix control socket
    tcp: str  # decode's TLS control listener, dialled at this host's non-loopback address
    local_tcp: str  # the same listener over loopback
    health: str  # decode's plaintext health-only listener
    p: SyntheticEngine
    d: SyntheticEngine

    def channel(self, client: str | None, target: str | None = None, ca: str = "ca") -> grpc.Channel:
        key = cert = None
        if client:
            key = (self.pki / f"{client}.key").read_bytes()
            cert = (self.pki / f"{client}.crt").read_bytes()
        creds = grpc.ssl_channel_credentials((self.pki / f"{ca}.crt").read_bytes(), key, cert)
        return grpc.secure_channel(target or self.tcp, creds,
                                   options=[("grpc.ssl_target_name_override", SERVER_NAME)])

    def tls_args(self, client: str) -> list[str]:
        return ["--tls-ca", str(self.pki / "ca.crt"), "--tls-cert", str(self.pki / f"{client}.crt"),
                "--tls-key", str(self.pki / f"{client}.key"), "--tls-server-name", SERVER_NAME]


@pytest.fixture(scope="module")
def setup(sidecars: SidecarFactory, pki: Path) -> Iterator[Setup]:
    addr = host_ip()
    port, hport = free_port(), free_port()
    unix = f"unix://{sidecars.dir}/acl-d.ctl2"
    ps = sidecars.start("acl-p", "--role", "prefill", "--handshake-host", "0.0.0.0", "--insecure",
                        "--advertise-host", "127.0.0.1")
    ds = sidecars.start(
        "acl-d", "--role", "decode", "--insecure", "--control-target", f"{unix},0.0.0.0:{port}",
        "--control-tls-cert", str(pki / "server.crt"), "--control-tls-key", str(pki / "server.key"),
        "--control-tls-client-ca", str(pki / "ca.crt"), "--control-admins", "kvxfer-admin",
        "--control-token-file", str(pki / "token"), "--health-target", f"127.0.0.1:{hport}",
        metrics_port=free_port(),
    )
    lay = make_layout(layers=2, num_blocks=32, heads=2, head_dim=32)
    p, d = SyntheticEngine(lay, ps.endpoint, seed=1), SyntheticEngine(lay, ds.endpoint, seed=2)
    p.start()
    d.start()
    yield Setup(pki, ps, ds, unix, f"{addr}:{port}", f"127.0.0.1:{port}", f"127.0.0.1:{hport}", p, d)
    p.close()
    d.close()


def _code(fn: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()  # type: ignore[operator]
    return e.value.code()


def test_peer_strings_and_decisions() -> None:
    for local in ("ipv4:127.0.0.1:5", "ipv4:127.8.0.1:77", "ipv6:[::1]:5", "ipv6:[::ffff:127.0.0.1]:9",
                  "unix:/run/kvxfer/x.sock", "unix:"):
        assert is_local_peer(local), local
    for remote in ("ipv4:10.0.0.2:5", "ipv6:[fe80::1]:5", "ipv6:[::ffff:10.0.0.1]:9", "", "dns:x:1"):
        assert not is_local_peer(remote), remote
    tok = [("authorization", "Bearer t0k")]
    cert = {"transport_security_type": [b"ssl"], "x509_common_name": [b"ops"]}
    remote, local = "ipv4:10.0.0.2:1", "unix:"
    pol = AccessPolicy("local", b"t0k", host_key=b"k" * 64)
    pol.audiences.add("tcp:5701")
    loopback = "ipv4:127.0.0.1:5"
    assert pol.decide("GetLoad", remote, (), {}) is None  # counts are never restricted
    for private in ("GetStatus", "ListTransfers", "ListPeers", "WatchEvents"):  # names requests
        assert pol.decide(private, local, (), {}) is None
        assert pol.decide(private, loopback, (), {})[0] == "PERMISSION_DENIED"  # type: ignore[index]
        assert pol.decide(private, remote, tok, {}) is None
        assert AccessPolicy("any").decide(private, remote, (), {}) is None
    assert pol.decide("Drain", local, (), {}) is None
    assert pol.decide("Drain", remote, (), {})[0] == "PERMISSION_DENIED"  # type: ignore[index]
    # loopback TCP is any user of the host: it takes a proof, e.g. a call signed with the host key
    assert pol.decide("Drain", loopback, (), {})[0] == "PERMISSION_DENIED"  # type: ignore[index]
    signed = [(auth.CALL_HEADER, auth.sign_call(b"k" * 64, "Drain", "tcp:5701"))]
    assert pol.decide("Drain", loopback, signed, {}) is None
    assert pol.decide("Drain", loopback, signed, {})[0] == "UNAUTHENTICATED"  # type: ignore[index]  # once
    drain = [(auth.CALL_HEADER, auth.sign_call(b"k" * 64, "Drain", "tcp:5701"))]
    assert pol.decide("Resume", loopback, drain, {})[0] == "UNAUTHENTICATED"  # type: ignore[index]  # its method
    assert pol.decide("Drain", loopback, [(auth.CALL_HEADER, auth.sign_call(b"x" * 64, "Drain", "tcp:5701"))],
                      {})[0] == "UNAUTHENTICATED"  # type: ignore[index]  # under this host's key
    assert AccessPolicy("local").decide("Drain", loopback, [(auth.CALL_HEADER, auth.sign_call(
        b"k" * 64, "Drain", "tcp:5701"))], {})[0] == "UNAUTHENTICATED"  # type: ignore[index]  # no key: none verify
    assert pol.decide("Drain", remote, tok, {}) is None
    assert pol.decide("Drain", local, [("authorization", "Bearer nope")], {})[0] == "UNAUTHENTICATED"  # type: ignore[index]
    assert pol.decide("Drain", remote, [("authorization", "Basic dDBr")], {})[0] == "UNAUTHENTICATED"  # type: ignore[index]
    assert AccessPolicy("local").decide("Drain", remote, tok, {})[0] == "UNAUTHENTICATED"  # type: ignore[index]
    assert AccessPolicy("none", b"t0k").decide("CancelTransfer", local, tok, {})[0] == "PERMISSION_DENIED"  # type: ignore[index]
    assert AccessPolicy("any").decide("ConnectPeer", remote, (), {}) is None
    assert AccessPolicy("authenticated", b"t0k").decide("Drain", local, (), {})[0] == "PERMISSION_DENIED"  # type: ignore[index]
    from kvxfer.control.access import TlsFiles

    mtls = TlsFiles(b"c", b"k", b"ca")
    assert AccessPolicy("authenticated", tls=mtls).decide("Drain", remote, (), cert) is None
    assert AccessPolicy("authenticated", admins=frozenset({"root"}), tls=mtls).decide(
        "Drain", remote, (), cert)[0] == "PERMISSION_DENIED"  # type: ignore[index]
    # a certificate only counts when the server verified it (client CA configured)
    assert AccessPolicy("authenticated", b"x", tls=TlsFiles(b"c", b"k", None)).decide(
        "Drain", remote, (), cert)[0] == "PERMISSION_DENIED"  # type: ignore[index]


def test_tls_listener_refuses_plaintext_no_cert_and_foreign_ca(setup: Setup) -> None:
    req = pb.GetStatusRequest()
    with grpc.insecure_channel(setup.tcp) as ch:
        assert _code(lambda: pb_grpc.ControlStub(ch).GetStatus(req, timeout=5)) == grpc.StatusCode.UNAVAILABLE
    for client, ca in ((None, "ca"), ("impostor", "ca"), ("kvxfer-admin", "rogue-ca")):
        with setup.channel(client, ca=ca) as ch:
            code = _code(lambda ch=ch: pb_grpc.ControlStub(ch).GetStatus(req, timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE, (client, ca)
    with setup.channel("dashboard") as ch:
        st = pb_grpc.ControlStub(ch).GetStatus(req, timeout=5)
    assert st.identity.engine_id == "acl-d"
    assert [r.tp_rank for r in st.ranks] == [0]


def test_mutating_rpcs_need_admin_cert_or_token_from_remote(setup: Setup) -> None:
    cancel = pb.CancelTransferRequest(request_id="nothing-in-flight")
    before = setup.ds.scrape()
    key = 'kvxfer_control_denied_total{code="PERMISSION_DENIED",method="CancelTransfer"}'
    with setup.channel("dashboard") as ch:
        s = pb_grpc.ControlStub(ch)
        assert _code(lambda: s.CancelTransfer(cancel, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
        drain = pb.DrainRequest(timeout_s=1)
        assert _code(lambda: s.Drain(drain, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: s.CancelTransfer(cancel, timeout=5, metadata=[("authorization", "Bearer wrong")])
                     ) == grpc.StatusCode.UNAUTHENTICATED
        assert s.CancelTransfer(cancel, timeout=5,
                                metadata=[("authorization", "Bearer s3cret-control-token")]).cancelled == 0
        # a verified certificate that is no admin's gets counts, not request ids
        denied = grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: s.ListPeers(pb.ListPeersRequest(), timeout=5)) == denied
        assert s.GetStatus(pb.GetStatusRequest(), timeout=5).redacted
        assert s.GetLoad(pb.GetLoadRequest(), timeout=5) is not None
    after = setup.ds.scrape()
    assert after.get(key, 0.0) - before.get(key, 0.0) == 1, [k for k in after if "denied" in k]
    # The admin certificate pre-warms a real handshake; bytes then move over it.
    reg = setup.p.registered
    assert reg is not None
    with setup.channel("kvxfer-admin") as ch:
        peer = pb_grpc.ControlStub(ch).ConnectPeer(
            pb.ConnectPeerRequest(host=reg.handshake_host, port=reg.handshake_port), timeout=15)
        assert peer.engine_id == "acl-p"
        assert pb_grpc.ControlStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5).totals.control_denied >= 3
    pbk, dbk = setup.p.allocate(3), setup.d.allocate(3)
    setup.p.fill("acl", pbk)
    setup.p.client.hold("acl", pbk)
    setup.d.client.recv("acl", dbk, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pbk))
    got = wait_for(setup.d.client, lambda a: bool(a.done or a.failed))
    assert not got.failed, got.failed
    assert setup.d.verify("acl", dbk)
    assert "refused" in setup.ds.log()  # the operator sees who was refused, and why


def test_local_callers_may_mutate_over_unix_or_with_the_host_key(setup: Setup) -> None:
    """Loopback is no proof (every user of the host reaches it); the 0600 unix socket and a
    call signed with the host key are."""
    cancel = pb.CancelTransferRequest(request_id="nothing")
    with grpc.insecure_channel(setup.unix) as ch:
        assert pb_grpc.ControlStub(ch).CancelTransfer(cancel, timeout=5).cancelled == 0
    with setup.channel("dashboard", setup.local_tcp) as ch:  # loopback, non-admin cert
        stub = pb_grpc.ControlStub(ch)
        assert _code(lambda: stub.CancelTransfer(cancel, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
        with open(hostkey.default_path(), "rb") as fh:
            key = fh.read().strip()
    with signed(setup.channel("dashboard", setup.local_tcp), setup.local_tcp, key) as ch:
        assert pb_grpc.ControlStub(ch).CancelTransfer(cancel, timeout=5).cancelled == 0


def test_health_only_listener_is_plaintext_and_serves_nothing_else(setup: Setup) -> None:
    with grpc.insecure_channel(setup.health) as ch:
        for service in ("", "readiness", "liveness"):
            req = health_pb2.HealthCheckRequest(service=service)
            h = health_pb2_grpc.HealthStub(ch).Check(req, timeout=5)
            assert h.status == health_pb2.HealthCheckResponse.SERVING, service
        assert _code(lambda: pb_grpc.ControlStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
                     ) == grpc.StatusCode.UNIMPLEMENTED


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_cli_over_mutual_tls(setup: Setup) -> None:
    out = _cli("status", "--target", setup.tcp, "--json", *setup.tls_args("dashboard"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["identity"]["engine_id"] == "acl-d"
    # (--host-key-file: a user who cannot read the host key; the CLI of one who can signs with it)
    denied = _cli("cancel", "some-req", "--target", setup.tcp, *setup.tls_args("dashboard"),
                  "--host-key-file", "/nonexistent")
    assert denied.returncode == 1
    assert "PERMISSION_DENIED" in denied.stderr
    ok = _cli("cancel", "some-req", "--target", setup.tcp, "--json", *setup.tls_args("dashboard"),
              "--token-file", str(setup.pki / "token"))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"cancelled": 0}
    admin = _cli("cancel", "some-req", "--target", setup.tcp, *setup.tls_args("kvxfer-admin"))
    assert admin.returncode == 0, admin.stderr
    bad = _cli("status", "--target", setup.tcp, "--tls-ca", str(setup.pki / "ca.crt"),
               "--tls-cert", str(setup.pki / "dashboard.crt"))
    assert bad.returncode == 2
    assert "--tls-key" in bad.stderr
    plain = _cli("status", "--target", setup.unix)
    assert plain.returncode == 0, plain.stderr


@pytest.mark.parametrize(("mode", "token", "allowed"), [
    ("none", "", False),
    ("authenticated", "tok", True),
    ("authenticated", "", False),
    ("any", "", True),
])
def test_mutating_modes_on_a_unix_socket(sidecars: SidecarFactory, tmp_path: Path, mode: str,
                                         token: str, allowed: bool) -> None:
    tok = tmp_path / "token"
    tok.write_text("tok")
    sc = sidecars.start(f"mode-{mode}-{bool(token)}", "--control-mutating", mode,
                        "--control-token-file", str(tok))
    md = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(sc.control) as ch:
        s = pb_grpc.ControlStub(ch)
        # wait until the sidecar answers reads, then try a mutating call
        health = health_pb2_grpc.HealthStub(ch)
        health.Check(health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True)
        call = lambda: s.CancelTransfer(pb.CancelTransferRequest(request_id="r"), timeout=5, metadata=md)  # noqa: E731
        if allowed:
            assert call().cancelled == 0
        else:
            assert _code(call) == grpc.StatusCode.PERMISSION_DENIED
        assert s.GetLoad(pb.GetLoadRequest(), timeout=5).queued_requests == 0
    sc.proc.terminate()
    sc.proc.wait(30)


@pytest.mark.parametrize(("args", "message"), [
    (["--control-mutating", "authenticated"], "nobody could drain"),
    (["--control-tls-cert", "/nonexistent.crt", "--control-tls-key", "/nonexistent.key"], "control_tls_cert"),
    (["--control-tls-cert", "/nonexistent.crt"], "go together"),
    (["--control-mutating", "sometimes"], "control_mutating must be"),
])
def test_bad_access_config_refuses_to_start(sidecars: SidecarFactory, args: list[str], message: str) -> None:
    sc = sidecars.start(f"badacl{len(sidecars.procs)}", *args)
    assert sc.proc.wait(30) == 2
    assert message in sc.log()
