"""Nobody reads, releases or pins KV they were not given (#17).

Pure pieces first (the MAC encoding, the challenge book, lease accounting, capability
checks, memory-path rules), then real sidecar processes: a captured Hello replayed to the
same and to a second sidecar sharing the secret, a read presenting a forged token, the
refused insecure bind, and the handshake channel recorded on the wire (the NIXL metadata
must not be in it), each followed where it matters by an honest transfer that verifies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvxfer import auth
from kvxfer.auth import ChallengeBook, check_welcome, new_token, sign_hello, sign_welcome
from kvxfer.client import RemoteBlocks
from kvxfer.config import Config
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.leases import Lease, LeaseTable
from kvxfer.memory import SharedKV
from kvxfer.observe import Observer
from kvxfer.protocol import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    RankInfo,
    ReadNotice,
    Refused,
    RemoteRegion,
    Welcome,
    encode,
    handshake_reply_decoder,
)
from kvxfer.sidecar.holds import Holds
from kvxfer.sidecar.mapping import check_shm_files
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port

LAYOUT = make_layout(layers=2, num_blocks=32, heads=2, head_dim=32)
SECRET = b"correct horse battery staple"


# ----------------------------------------------------------------------------- pure


def test_macs_are_length_safe() -> None:
    assert auth._mac(SECRET, "x", "a|b", "c") != auth._mac(SECRET, "x", "a", "b|c")
    assert auth._mac(SECRET, "x", "ab", "") != auth._mac(SECRET, "x", "a", "b")


@pytest.mark.parametrize("body", [44, 255, 256, 65535, 65536, 1 << 20])
def test_a_request_mac_is_the_one_every_sidecar_computes(body: int) -> None:
    """A request's MAC is computed as a stream (the unsigned request encoded once into a
    reused buffer, hashed behind the bytes msgpack puts before it): it must stay byte for
    byte what ``_mac(secret, "request", msgpack(unsigned))`` gives, which older sidecars
    compute, on both sides of each of msgpack's bin-header sizes (unsigned bodies of exactly
    255 | 256 and 65535 | 65536 bytes); pinned as the code before the stream computed it."""
    from kvxfer.protocol import LeaseRenew, StageRank, StageRequest

    def stage(k: int) -> StageRequest:
        return StageRequest(seq=3, engine_id="p", req_id="r", nbytes=1, readers=["0/0"], agent_name="d",
                            ranks=[StageRank(rank=1, runs=b"\x07" * k)], token="t")

    def unsigned(req: msgspec.Struct) -> bytes:
        return msgspec.msgpack.encode(msgspec.structs.replace(req, mac=""))

    k = next(k for k in range(max(0, body - 80), body + 1) if len(unsigned(stage(k))) == body)
    renew = LeaseRenew(seq=4, engine_id="p", req_ids=["r" * 16], extend_s=1.0)
    for req in (stage(k), renew):
        assert auth._request_mac(SECRET, req) == auth._mac(SECRET, "request", unsigned(req))
        assert auth.check_request(SECRET, auth.sign_request(SECRET, req))
        assert not auth.check_request(b"another secret", auth.sign_request(SECRET, req))
    assert auth._request_mac(SECRET, renew).startswith("da77f6a11e4b07e1")
    if body == 256:
        assert auth._request_mac(SECRET, stage(k)).startswith("0b77321d1173f132")


def _hello() -> Hello:
    return Hello(version=PROTOCOL_VERSION, compat_hash="h", engine_id="dec", agent_name="d-agent")


def test_a_hello_answers_one_challenge_of_one_sidecar_once() -> None:
    a, b = ChallengeBook("agent-a"), ChallengeBook("agent-b")  # two sidecars, one secret
    hello = sign_hello(SECRET, _hello(), a.issue(now=0.0), "agent-a")
    b.issue(now=0.0)
    assert "not to this sidecar" in (b.check_hello(SECRET, hello, now=1.0) or "")  # replay to B
    assert a.check_hello(SECRET, hello, now=1.0) is None
    assert "no live challenge" in (a.check_hello(SECRET, hello, now=1.0) or "")  # replay to A
    # a Hello re-addressed to B (target changed) no longer checks
    forged = msgspec.structs.replace(hello, target="agent-b")
    assert "signature" in (b.check_hello(SECRET, forged, now=1.0) or "")
    late = sign_hello(SECRET, _hello(), a.issue(now=0.0), "agent-a")
    assert "no live challenge" in (a.check_hello(SECRET, late, now=auth.CHALLENGE_S + 1) or "")
    wrong = sign_hello(b"another secret", _hello(), a.issue(now=0.0), "agent-a")
    assert "signature" in (a.check_hello(SECRET, wrong, now=1.0) or "")
    assert "requires" in (a.check_hello(SECRET, _hello(), now=1.0) or "")


def test_the_welcome_mac_covers_what_it_vouches_for() -> None:
    hello = sign_hello(SECRET, _hello(), "c", "p-agent")
    rank = RankInfo(layout=LAYOUT, regions=[RemoteRegion(addr=4096, block_len=64, block_stride=64)],
                    engine_id="pre")
    w = sign_welcome(SECRET, Welcome(version=PROTOCOL_VERSION, compat_hash="h", engine_id="pre",
                                     agent_name="p-agent", ranks=[rank], generation="g1"), hello, b"md")
    assert check_welcome(SECRET, w, hello, b"md")
    lying = [
        msgspec.structs.replace(w, ranks=[msgspec.structs.replace(
            rank, regions=[RemoteRegion(addr=8192, block_len=64, block_stride=64)])]),
        msgspec.structs.replace(w, generation="g2"),
        msgspec.structs.replace(w, compat_hash="other"),
        msgspec.structs.replace(w, version=PROTOCOL_VERSION + 1),
        msgspec.structs.replace(w, engine_id="someone-else"),
    ]
    for bad in lying:
        assert not check_welcome(SECRET, bad, hello, b"md"), bad
    assert not check_welcome(SECRET, w, hello, b"other metadata")
    assert not check_welcome(SECRET, w, sign_hello(SECRET, _hello(), "c2", "p-agent"), b"md")


# What was appended to Welcome within protocol 6: each changes how the decode reads
LATER_FIELDS = {"lease_words_addr": 1 << 20, "lease_words_slots": 7, "layer_streams": True,
                "grouped_streams": True, "chunk_streams": True, "compat_tp": "other-tp-layout",
                "reader_engines": True}


def test_the_welcome_mac_covers_the_fields_appended_within_protocol_six() -> None:
    hello = sign_hello(SECRET, _hello(), "c", "p-agent")
    assert auth.welcome_cover(hello) == auth.WELCOME_COVER >= 1
    w = sign_welcome(SECRET, Welcome(version=PROTOCOL_VERSION, compat_hash="h", engine_id="pre",
                                     agent_name="p-agent", ranks=[], lease_words_addr=4096,
                                     lease_words_slots=64), hello, b"md")
    assert check_welcome(SECRET, w, hello, b"md")
    for name, value in LATER_FIELDS.items():  # changed on the way by someone without the secret
        assert not check_welcome(SECRET, msgspec.structs.replace(w, **{name: value}), hello, b"md"), name
    # the Hello's compat_tp, which its own MAC leaves out, changed on the way to the listener: the
    # Welcome signed over what the listener saw does not check against what the dialer sent
    seen = msgspec.structs.replace(hello, compat_tp="other-tp-layout")
    assert auth._hello_fields(seen) == auth._hello_fields(hello)  # (its own MAC does not see it)
    assert not check_welcome(SECRET, sign_welcome(SECRET, w, seen, b"md"), hello, b"md")
    # nor can the ask be stripped from the Hello (the nonce is under the Hello's MAC) to make a
    # listener sign the first release's fields only
    stripped = msgspec.structs.replace(hello, nonce=hello.nonce.partition(".")[2])
    book = ChallengeBook("p-agent")
    assert "signature" in (book.check_hello(SECRET, stripped) or "")


def test_sidecars_of_older_sixes_still_shake_hands_with_a_secret() -> None:
    """A listener of an older 6 signs the first release's fields (it ignores the ask); a dialer
    of an older 6 asks nothing (a bare nonce) and is answered with what it checks."""
    hello = msgspec.structs.replace(_hello(), nonce="w1.00112233445566778899aabbccddeeff", challenge="c",
                                    target="p-agent")
    ours = Welcome(version=PROTOCOL_VERSION, compat_hash="h", engine_id="pre", agent_name="p-agent",
                   ranks=[], generation="g1", staging_bytes=4096, lease_words_addr=4096, lease_words_slots=64)
    # (signed by kvxfer/auth.py as it was before the cover, ef8aa6f^: pinned, so that a change to
    # the first fields, which every older listener signs, cannot pass unseen)
    older_listener = msgspec.structs.replace(
        ours, mac="c125cee5d472a63db5a0d1ea95fe3e6051d684496ce91a324fcbd725ad5cb934")
    assert check_welcome(SECRET, older_listener, hello, b"md")
    assert not check_welcome(SECRET, msgspec.structs.replace(older_listener, staging_bytes=0), hello, b"md")
    for odd in ("w\u00b2.ab", "w" + "9" * 5000 + ".ab", "w.ab", "x1.ab", "w-1.ab"):  # (no crash, no ask)
        assert auth.welcome_cover(msgspec.structs.replace(hello, nonce=odd)) == 0, odd
    book = ChallengeBook("p-agent")
    older_hello = msgspec.structs.replace(_hello(), nonce="ab" * 16, challenge=book.issue(), target="p-agent")
    older_hello = msgspec.structs.replace(
        older_hello, mac=auth._mac(SECRET, "hello", *auth._hello_fields(older_hello)))
    assert book.check_hello(SECRET, older_hello) is None
    assert auth.welcome_cover(older_hello) == 0
    answer = sign_welcome(SECRET, ours, older_hello, b"md")
    assert answer.mac == auth._mac(SECRET, "welcome", *auth._welcome_fields(ours, older_hello, b"md", 0))
    # a listener that read the ask never signs the part: what it signs does not check as one
    whole = sign_welcome(SECRET, ours, hello, b"md")
    assert whole.mac != older_listener.mac


def test_ranks_of_two_decode_engines_never_add_up_to_a_release() -> None:
    t = LeaseTable()
    t.add(Lease(req_id="r", owner=b"w", block_ids=[1], expires=10.0, reads_expected=2, engine="e"))
    t.note_started(("e", "r"), ("agent-2", 0, 1))  # a router retry: another decode reads too
    assert t.note_read(("e", "r"), ("agent-1", 0, 0), 2) is None
    assert t.note_read(("e", "r"), ("agent-2", 0, 1), 2) is None  # rank 1 of *another* engine
    assert t.note_read(("e", "r"), ("agent-1", 0, 1), 2) is not None  # agent-1's ranks all read


def test_another_agents_read_in_progress_keeps_the_lease() -> None:
    t = LeaseTable()
    t.add(Lease(req_id="r", owner=b"w", block_ids=[1], expires=10.0, reads_expected=1, engine="e"))
    t.note_started(("e", "r"), ("agent-2", 0, 0))
    assert t.note_read(("e", "r"), ("agent-1", 0, 0)) is None  # agent-2 still copies the blocks
    assert t.note_read(("e", "r"), ("agent-2", 0, 0)) is not None


class _Registry:
    def owners(self, engine: str) -> set[bytes]:
        return set()


def _holds(authenticated: bool = True) -> tuple[Holds, list[object], Observer]:
    sent: list[object] = []
    obs = Observer()
    h = Holds(Config(max_read_s=5.0, max_lease_s=60.0), _Registry(), obs,  # type: ignore[arg-type]
              authenticated=lambda a: authenticated)
    h.changed.subscribe(lambda: sent.extend(out.message for out in h.take_outbox()))
    now = time.monotonic()
    h.table.add(Lease(req_id="r", owner=b"w", block_ids=[1], expires=now + 1, created=now,
                      engine="e", token="tok"))
    return h, sent, obs


def _refused(obs: Observer, message: str, reason: str) -> float:
    return obs.registry.get_sample_value("kvxfer_peer_refused_total",
                                         {"message": message, "reason": reason}) or 0.0


def test_a_notice_without_the_token_or_from_a_stranger_releases_nothing() -> None:
    h, sent, obs = _holds()
    h.on_notice("a", encode(ReadNotice(req_id="r", tp_rank=0, ok=True, engine_id="e", token="guess")))
    h.on_notice("a", encode(ReadNotice(req_id="r", tp_rank=0, ok=True, engine_id="e")))
    assert len(h.table) == 1
    assert not sent
    assert _refused(obs, "read_notice", "bad_token") == 2
    stranger, sent2, obs2 = _holds(authenticated=False)
    stranger.on_notice("x", encode(ReadNotice(req_id="r", tp_rank=0, ok=True, engine_id="e", token="tok")))
    assert len(stranger.table) == 1
    assert not sent2
    assert _refused(obs2, "read_notice", "unauthenticated") == 1
    h.on_notice("a", encode(ReadNotice(req_id="r", tp_rank=0, ok=True, engine_id="e", token="tok")))
    assert len(h.table) == 0
    assert len(sent) == 1


def test_no_peer_can_pin_a_lease_for_ever() -> None:
    h, _, obs = _holds()
    lease = h.table.get(("e", "r"))
    assert lease is not None
    h.on_notice("a", encode(ReadNotice(req_id="r", tp_rank=0, ok=True, engine_id="e", token="tok",
                                       reading_s=float("inf"))))
    assert lease.expires <= time.monotonic() + 5.0 + 1.0  # max_read_s (+ its 1 s margin)
    assert _refused(obs, "read_notice", "capped") == 1
    lease.created = time.monotonic() - 59.5  # almost max_lease_s old: no renewal reaches past it
    lease.expires = time.monotonic() + 0.1
    h.on_notice("a", encode(ReadNotice(req_id="r", tp_rank=0, ok=True, engine_id="e", token="tok",
                                       reading_s=4.0)))
    assert lease.expires <= lease.created + 60.0 + 1e-6


def _make_file(directory: Path, name: str) -> str:
    path = str(directory / name)
    with open(path, "wb") as fh:
        fh.truncate(4096)
    return path


def test_registrations_name_only_the_engines_own_kvxfer_files(tmp_path: Path) -> None:
    kv = SharedKV.create(LAYOUT)
    try:
        msg = msgspec.structs.replace(kv.register_message(), pid=os.getpid())
        check_shm_files(msg, ["/dev/shm"])  # the real thing passes

        def refused(path: str, dirs: list[str] | None = None) -> str:
            bad = msgspec.structs.replace(msg, memory=[msgspec.structs.replace(msg.memory[0], path=path)])
            with pytest.raises(RequestError) as ei:
                check_shm_files(bad, dirs or ["/dev/shm", str(tmp_path)])
            assert ei.value.code == ErrorCode.INVALID_MEMORY
            return ei.value.reason

        link = tmp_path / "kvxfer-link"
        link.symlink_to(kv.path)
        assert "symlink" in refused(str(link))
        assert "outside" in refused(_make_file(tmp_path, "kvxfer-elsewhere"), ["/dev/shm"])
        assert "kvxfer file" in refused(_make_file(tmp_path, "passwd"))
        assert "absolute" in refused("/dev/shm/../etc/kvxfer-x")
        (tmp_path / "kvxfer-dir").mkdir()
        assert "regular" in refused(str(tmp_path / "kvxfer-dir"))
        other = _make_file(tmp_path, "kvxfer-other-uid")
        os.chown(other, os.geteuid() + 4242, -1)
        assert "owned by uid" in refused(other)
    finally:
        kv.close()


# ----------------------------------------------------------------------------- real sidecars


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    return str(path)


def _prefill(factory: SidecarFactory, name: str, *args: str,
             seed: int = 1) -> tuple[SidecarProc, SyntheticEngine]:
    sc = factory.start(name, *args, metrics_port=free_port())
    eng = SyntheticEngine(LAYOUT, sc.endpoint, seed=seed)
    eng.start()
    return sc, eng


def _ask(port: int, hello: Hello) -> object:
    with zmq.Context.instance().socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send(encode(hello))
        assert s.poll(5000), "no answer"
        return handshake_reply_decoder.decode(s.recv_multipart()[0])


def test_a_captured_hello_replays_to_neither_sidecar(factory: SidecarFactory, secret_file: str) -> None:
    """Two prefill sidecars share the secret (encryption off, so the test speaks the
    protocol itself). A Hello that won sidecar A's Welcome is refused by A the second time,
    and by B, although it carries a valid MAC."""
    args = ("--secret-file", secret_file, "--handshake-encryption", "none")
    (_, pa), (_, pb) = _prefill(factory, "ra", *args), _prefill(factory, "rb", *args, seed=2)
    try:
        assert pa.registered is not None
        assert pb.registered is not None
        port_a, port_b = pa.registered.handshake_port, pb.registered.handshake_port
        from kvxfer.protocol import compat_hash

        hello = Hello(version=PROTOCOL_VERSION, compat_hash=compat_hash(LAYOUT), engine_id="eve",
                      agent_name="eve-agent", model=LAYOUT.model)
        challenge = _ask(port_a, hello)
        assert isinstance(challenge, Challenge)
        signed = sign_hello(SECRET, hello, challenge.nonce, challenge.agent_name)
        assert isinstance(_ask(port_a, signed), Welcome)  # the genuine exchange works
        for port in (port_a, port_b):
            again = _ask(port, signed)
            assert isinstance(again, Refused), again
            assert again.code == ErrorCode.UNAUTHORIZED
    finally:
        pa.close()
        pb.close()


def test_a_read_with_a_forged_token_releases_nothing_and_fails(factory: SidecarFactory,
                                                               secret_file: str) -> None:
    """An authenticated decode (it holds the secret) reads a request with the wrong
    capability: its claim is answered "unknown", its load fails, its notices are refused,
    and the lease stays held for the decode that has the token, whose read verifies."""
    ps, p = _prefill(factory, "tp", "--secret-file", secret_file)
    ds = factory.start("td", "--secret-file", secret_file, "--handshake-timeout-s", "1")
    d = SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    try:
        d.start()
        reg = p.registered
        assert reg is not None
        token = new_token()
        pbk = p.allocate(3)
        p.fill("cap", pbk)
        p.client.hold("cap", pbk, lease_s=30, token=token)
        forged = d.allocate(3)
        d.client.recv("cap", forged, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pbk,
                                                  token="forged"))
        got = d.client.wait_until(lambda a: bool(a.done or a.failed), 20)
        assert not got.done, got
        assert [f.code for f in got.failed] == [ErrorCode.EXPIRED], got
        time.sleep(0.3)  # its notices reach the prefill (and are refused there)
        m = ps.scrape()
        assert m.get('kvxfer_peer_refused_total{message="lease_renew",reason="bad_token"}', 0) >= 1, m
        assert m.get('kvxfer_peer_refused_total{message="read_notice",reason="bad_token"}', 0) >= 1, m
        assert not p.client.poll().released  # still held
        honest = d.allocate(3)
        d.wipe(honest)
        d.client.recv("cap-2", honest, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port,
                                                    pbk, req_id="cap", token=token))
        got = d.client.wait_until(lambda a: bool(a.done or a.failed), 20)
        assert [x.req_id for x in got.done] == ["cap-2"], got
        assert d.verify("cap", honest)
        rel = p.client.wait_until(lambda a: bool(a.released), 10).released
        assert [(r.req_id, r.reason) for r in rel] == [("cap", "read")]
    finally:
        p.close()
        d.close()


def test_an_open_handshake_beyond_loopback_is_refused_unless_insecure(tmp_path: Path) -> None:
    sock = f"ipc://{tmp_path}/e.sock"
    base = [sys.executable, "-m", "kvxfer", "serve", "--engine-socket", sock, "--handshake-host", "0.0.0.0",
            "--handshake-port", "0", "--control-target", "", "--metrics-port", "0"]
    env = {k: v for k, v in os.environ.items() if k != "KVXFER_SECRET"}
    out = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out
    assert "--insecure" in out.stderr, out.stderr
    assert "secret" in out.stderr, out.stderr
    with SidecarFactory() as f:
        sc = f.start("open", "--handshake-host", "0.0.0.0", "--insecure", metrics_port=free_port(), env=env)
        eng = SyntheticEngine(LAYOUT, sc.endpoint, seed=1)
        try:
            eng.start()
            assert sc.scrape()["kvxfer_insecure"] == 1.0
            status = subprocess.run([sys.executable, "-m", "kvxfer", "status", "--target", sc.control],
                                    capture_output=True, text=True, timeout=60)
            assert "INSECURE" in status.stdout, status.stdout
            assert "INSECURE" in sc.log()
        finally:
            eng.close()


class _Recorder:
    """A TCP forwarder that keeps every byte it forwards (both directions)."""

    def __init__(self, target_port: int) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.target = target_port
        self.data = bytearray()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                with self._lock:
                    self.data += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.srv.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@pytest.mark.parametrize("encryption", ["auto", "none"])
def test_nixl_metadata_never_crosses_the_wire_in_clear(factory: SidecarFactory, secret_file: str,
                                                       encryption: str) -> None:
    """The handshake goes through a recording TCP forwarder. Encrypted (the default with a
    secret), nothing readable of the Welcome is on the wire: not the prefill's agent name,
    not the metadata frame. With encryption off (the control case, which shows the test can
    fail) both are there in clear. The read itself verifies either way."""
    args = ("--secret-file", secret_file, "--handshake-encryption", encryption)
    ps, p = _prefill(factory, f"w{encryption}", *args)
    ds = factory.start(f"v{encryption}", *args)
    d = SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    reg = p.registered
    assert reg is not None
    rec = _Recorder(reg.handshake_port)
    try:
        d.start()
        token = new_token()
        pbk, dbk = p.allocate(2), d.allocate(2)
        p.fill("wire", pbk)
        p.client.hold("wire", pbk, token=token)
        d.wipe(dbk)
        d.client.recv("wire", dbk, RemoteBlocks(reg.engine_id, "127.0.0.1", rec.port, pbk, token=token))
        got = d.client.wait_until(lambda a: bool(a.done or a.failed), 20)
        assert got.done, got
        assert d.verify("wire", dbk)
        wire = bytes(rec.data)
        assert len(wire) > 200  # the handshake did go through the recorder
        clear = reg.agent_name.encode() in wire or b"welcome" in wire
        assert clear == (encryption == "none"), (encryption, wire[:200])
    finally:
        rec.close()
        p.close()
        d.close()


# ----------------------------------------------------------------------------- files (#40)

ATTACKER = 65534  # nobody


def _as_attacker(action: object) -> None:
    """Run ``action()`` in a forked child that has become another uid (we are root)."""
    pid = os.fork()
    if pid == 0:  # (the child: no pytest machinery, exit straight away)
        code = 1
        try:
            os.setgid(ATTACKER)
            os.setuid(ATTACKER)
            action()  # type: ignore[operator]
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's action failed"


@pytest.mark.skipif(os.geteuid() != 0, reason="plants files as another uid: needs root")
@pytest.mark.parametrize("where", ["world-writable", "sticky", "attacker-owned"])
def test_a_lock_symlink_planted_in_the_socket_directory_truncates_nothing(where: str) -> None:
    """Door 5: a user who can write the engine socket's directory plants
    ``<socket>.lock -> a root-owned file``. A root sidecar must refuse to start there, and
    the file must keep its bytes (the sidecar used to open the link, truncate its target and
    write its pid into it)."""
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="kvx", dir="/tmp")  # (short: ipc paths stay < 100 bytes)
    try:
        os.chmod(base, 0o711)  # the attacker may pass through, not list or write
        victim = os.path.join(base, "victim")
        with open(victim, "w") as fh:
            fh.write("root's precious bytes\n")
        os.chmod(victim, 0o644)
        d = os.path.join(base, "run")
        os.mkdir(d)
        if where == "attacker-owned":
            os.chown(d, ATTACKER, ATTACKER)
            os.chmod(d, 0o700)
        else:
            os.chmod(d, 0o1777 if where == "sticky" else 0o777)
        sock = os.path.join(d, "e.sock")
        _as_attacker(lambda: os.symlink(victim, sock + ".lock"))
        assert os.path.islink(sock + ".lock")
        with subprocess.Popen([sys.executable, "-m", "kvxfer", "serve", "--engine-socket", f"ipc://{sock}",
                               "--handshake-port", "0", "--control-target", "", "--metrics-port", "0"],
                              stderr=subprocess.PIPE, text=True) as proc:
            killer = threading.Timer(60, proc.kill)
            killer.start()
            assert proc.stderr is not None
            stderr = ""
            for line in proc.stderr:  # until it exits, or says it is ready (then stop it)
                stderr += line
                if " ready: " in line:
                    proc.send_signal(signal.SIGINT)
            proc.wait()
            killer.cancel()
        with open(victim) as fh:
            assert fh.read() == "root's precious bytes\n", "the sidecar wrote through the planted link"
        assert proc.returncode == 2, stderr
        assert d in stderr, stderr  # it names the directory ...
        assert "private directory" in stderr, stderr  # ... and what to do
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_lock_file_is_never_a_link_or_someone_elses(tmp_path: Path) -> None:
    """In a private directory too: the lock is opened without following a link, and must be a
    regular file of this uid (a leftover of another user, or a link, is refused by name)."""
    from kvxfer.errors import ListenError
    from kvxfer.sidecar.engine_server import EngineServer

    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    lock = d / "e.sock.lock"
    lock.symlink_to(victim)
    ctx = zmq.asyncio.Context()

    def bind() -> None:
        es = EngineServer(ctx, f"ipc://{d}/e.sock", Observer())
        try:
            es.bind()
        finally:
            es.close()

    try:
        with pytest.raises(ListenError, match="e.sock.lock: it is a symbolic link"):
            bind()
        assert victim.read_text() == "keep\n"
        lock.unlink()
        lock.write_text("")
        if os.geteuid() == 0:
            os.chown(lock, ATTACKER, ATTACKER)
            with pytest.raises(ListenError, match="owned by uid"):
                bind()
            os.chown(lock, 0, 0)
        bind()  # a lock file of our own is taken over as before
    finally:
        ctx.term()


def test_what_a_peer_may_leave_for_a_hold_not_made_yet_is_bounded() -> None:
    """A failed notice for a request not held here is kept for its Hold (a decode that
    cancelled first, push mode): only from an authenticated peer, one per reader and request
    (BEFORE_HOLD_READERS readers), BEFORE_HOLD_MAX requests; replayed, it still needs the token."""
    from kvxfer.sidecar.holds import BEFORE_HOLD_MAX, BEFORE_HOLD_READERS

    stranger, _, _ = _holds(authenticated=False)
    stranger.on_notice("x", encode(ReadNotice(req_id="q", tp_rank=0, ok=False, engine_id="e", token="t")))
    assert not stranger._before_hold
    h, _, _ = _holds()
    for _ in range(3):  # the same reader again: one entry
        h.on_notice("a", encode(ReadNotice(req_id="q", tp_rank=0, ok=False, engine_id="e", token="t")))
    assert len(h._before_hold["q"]) == 1
    for rank in range(BEFORE_HOLD_READERS + 10):
        h.on_notice("a", encode(ReadNotice(req_id="q", tp_rank=rank, ok=False, engine_id="e", token="t")))
    assert len(h._before_hold["q"]) == BEFORE_HOLD_READERS
    for i in range(BEFORE_HOLD_MAX + 10):
        h.on_notice("a", encode(ReadNotice(req_id=f"j{i}", tp_rank=0, ok=False, engine_id="e", token="t")))
    assert len(h._before_hold) == BEFORE_HOLD_MAX
    assert "q" not in h._before_hold  # (the oldest went first)
