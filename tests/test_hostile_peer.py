"""Peers that hold the secret and lie (#17, item 6).

Authentication says who may talk, not that what they say is true. Both directions, with
real sidecar processes and real NIXL:

- A lying *prefill*: a man in the middle that holds the secret re-signs a real sidecar's
  Welcome after changing its ranks (region sizes, strides, addresses, rank numbers, heads,
  layers, the agent name). The decode sidecar refuses each one at the handshake, before it
  loads the metadata, and never prepares a NIXL descriptor list for it.
- A lying *decode*: the test itself completes an authenticated handshake with its own NIXL
  agent, then sends read notices for other requests, huge and negative durations, renewals
  that would pin a lease for a day, and digest requests for blocks, ranks and bytes it was
  not given. Each is refused and counted; no lease ends early or lives past the cap.

Afterwards an honest decode reads the request it was meant to and the bytes verify.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvxfer.auth import new_token, sign_hello, sign_request, sign_welcome
from kvxfer.client import RemoteBlocks
from kvxfer.errors import ErrorCode
from kvxfer.protocol import (
    PROTOCOL_VERSION,
    Challenge,
    DigestItem,
    DigestRank,
    DigestReply,
    DigestRequest,
    Hello,
    LeaseRenew,
    LeaseState,
    RankInfo,
    ReadNotice,
    Refused,
    Welcome,
    compat_hash,
    encode,
    handshake_reply_decoder,
    handshake_request_decoder,
)
from kvxfer.sidecar.nixl_agent import create_agent
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port

LAYOUT = make_layout(layers=2, num_blocks=32, heads=2, head_dim=32)
SECRET = b"a secret every sidecar here shares"
# Both ends speak the protocol in the clear so the test can sit in the middle; the channel's
# encryption is tested on its own (test_security).
PLAIN = ("--handshake-encryption", "none")


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return str(path)


def _engine(factory: SidecarFactory, name: str, secret_file: str, seed: int,
            *args: str) -> tuple[SidecarProc, SyntheticEngine]:
    sc = factory.start(name, "--secret-file", secret_file, *PLAIN, *args, metrics_port=free_port())
    eng = SyntheticEngine(LAYOUT, sc.endpoint, seed=seed)
    eng.start()
    return sc, eng


# ----------------------------------------------------------------------------- a lying prefill

Lie = Callable[[Welcome], Welcome]


def _rank(w: Welcome, **layout: Any) -> Welcome:
    r = w.ranks[0]
    return msgspec.structs.replace(w, ranks=[msgspec.structs.replace(
        r, layout=msgspec.structs.replace(r.layout, **layout))])


def _region(w: Welcome, **region: Any) -> Welcome:
    r = w.ranks[0]
    regions = [msgspec.structs.replace(r.regions[0], **region), *r.regions[1:]]
    return msgspec.structs.replace(w, ranks=[msgspec.structs.replace(r, regions=regions)])


def _regions(w: Welcome, keep: int) -> Welcome:
    r = w.ranks[0]
    return msgspec.structs.replace(w, ranks=[msgspec.structs.replace(r, regions=r.regions[:keep])])


def _other_head_dim(w: Welcome) -> Welcome:
    """A layout that is self-consistent (its regions match it) but not the model agreed on."""
    r = w.ranks[0]
    lay = msgspec.structs.replace(r.layout, head_dim=r.layout.head_dim * 2)
    regions = [msgspec.structs.replace(g, block_len=lay.region_block_len,
                                       block_stride=max(g.block_stride, lay.region_block_len))
               for g in r.regions]
    return msgspec.structs.replace(w, ranks=[RankInfo(layout=lay, regions=regions, mem_type=r.mem_type,
                                                      engine_id=r.engine_id, dp_rank=r.dp_rank)])


LIES: dict[str, tuple[Lie, str]] = {
    "region size": (lambda w: _region(w, block_len=w.ranks[0].regions[0].block_len * 2), "-byte blocks"),
    "missing region": (lambda w: _regions(w, 1), "regions for"),
    "overlapping blocks": (lambda w: _region(w, block_stride=w.ranks[0].regions[0].block_len - 1),
                           "overlap"),
    "address overflow": (lambda w: _region(w, addr=(1 << 64) - 4096), "address space"),
    "rank beyond tp": (lambda w: _rank(w, tp_rank=3), "tp_rank"),
    "more heads than the model": (lambda w: _rank(w, local_kv_heads=LAYOUT.num_kv_heads + 1), "KV heads"),
    "another model's layout": (_other_head_dim, "compatibility hash"),
    "layers outside the model": (lambda w: _rank(w, first_layer=1), "layer"),
    "a rank twice": (lambda w: msgspec.structs.replace(w, ranks=[*w.ranks, *w.ranks]), "rank twice"),
    "another agent's name": (lambda w: msgspec.structs.replace(w, agent_name=w.agent_name + "-x"),
                             "metadata names agent"),
}


class LyingProxy:
    """Stands between a decode sidecar and a real prefill sidecar's listener, holding the
    secret: forwards every request, and re-signs each Welcome after ``lie`` changed it."""

    def __init__(self, target_port: int, resign: bool = True) -> None:
        self.target = f"tcp://127.0.0.1:{target_port}"
        self.port = free_port()
        self.lie: Lie | None = None
        self.resign = resign  # False: a man in the middle without the secret (keeps the MAC)
        self.unchanged = 0  # lies that changed nothing (the test would prove nothing)
        self.welcomes = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(5)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        with ctx.socket(zmq.ROUTER) as front:
            front.setsockopt(zmq.LINGER, 0)
            front.bind(f"tcp://127.0.0.1:{self.port}")
            self._ready.set()
            while not self._stop.is_set():
                if not front.poll(50):
                    continue
                ident, *_, body = front.recv_multipart()
                with ctx.socket(zmq.DEALER) as back:
                    back.setsockopt(zmq.LINGER, 0)
                    back.connect(self.target)
                    back.send(body)
                    if not back.poll(5000):
                        continue
                    frames = back.recv_multipart()
                reply = handshake_reply_decoder.decode(frames[0])
                if isinstance(reply, Welcome) and self.lie is not None:
                    hello = handshake_request_decoder.decode(body)
                    assert isinstance(hello, Hello)
                    if self.resign:
                        lied = self.lie(msgspec.structs.replace(reply, mac=""))
                        frames[0] = encode(sign_welcome(SECRET, lied, hello, frames[1]))
                    else:
                        lied = self.lie(reply)
                        self.unchanged += lied == reply
                        frames[0] = encode(lied)
                if isinstance(reply, Welcome):
                    self.welcomes += 1
                front.send_multipart([ident, *frames])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _reads_the_truth(d: SyntheticEngine, proxy: LyingProxy, engine_id: str, pbk: list[int],
                     token: str) -> None:
    """Through the same man in the middle, now passing the real Welcome on: request "x"'s
    blocks are read, and its bytes verify."""
    proxy.lie = lambda w: w
    honest = d.allocate(len(pbk))
    d.wipe(honest)
    d.client.recv("truth", honest, RemoteBlocks(engine_id, "127.0.0.1", proxy.port, pbk, req_id="x",
                                                token=token))
    got = d.client.wait_until(lambda a: bool(a.done or a.failed), 20)
    assert [x.req_id for x in got.done] == ["truth"], got
    assert d.verify("x", honest)


def test_a_lying_prefill_is_refused_before_any_descriptor(factory: SidecarFactory, secret_file: str) -> None:
    ps, p = _engine(factory, "lp", secret_file, 1)
    ds, d = _engine(factory, "ld", secret_file, 2, "--handshake-timeout-s", "2")
    proxy = None
    try:
        reg = p.registered
        assert reg is not None
        proxy = LyingProxy(reg.handshake_port)
        pbk = p.allocate(3)
        p.fill("x", pbk)
        token = new_token()
        p.client.hold("x", pbk, lease_s=60, token=token)
        for i, (what, (lie, says)) in enumerate(LIES.items()):
            proxy.lie = lie
            before = proxy.welcomes
            blocks = d.allocate(3)
            d.client.recv(f"lie-{i}", blocks, RemoteBlocks(reg.engine_id, "127.0.0.1", proxy.port, pbk,
                                                           req_id="x", token=token))
            got = d.client.wait_until(lambda a: bool(a.done or a.failed), 20)
            assert proxy.welcomes == before + 1, f"{what}: the lie never reached the decode"
            assert not got.done, f"{what}: a lying Welcome was used: {got}"
            (f,) = got.failed
            assert says in f.reason, f"{what}: {f.code} {f.reason}"
            assert f.code in (ErrorCode.INCOMPATIBLE, ErrorCode.HANDSHAKE_FAILED), f"{what}: {f}"
            d.free(blocks)
            m = ds.scrape()
            assert m["kvxfer_descriptor_lists_prepared"] == 0, f"{what}: descriptors were built"
            assert m["kvxfer_peers"] == 0, f"{what}: the liar became a peer"
        assert not p.client.poll().released  # the lies released nothing at the prefill
        # Told the truth again (same man in the middle, re-signing the real Welcome): it reads.
        _reads_the_truth(d, proxy, reg.engine_id, pbk, token)
        assert ds.scrape()["kvxfer_descriptor_lists_prepared"] >= 1  # the gauge does count
        rel = p.client.wait_until(lambda a: bool(a.released), 10).released
        assert [(r.req_id, r.reason) for r in rel] == [("x", "read")]
    finally:
        if proxy is not None:
            proxy.close()
        p.close()
        d.close()


def test_a_welcome_changed_on_the_way_is_refused(factory: SidecarFactory, secret_file: str) -> None:
    """Someone on the path without the secret (the channel in the clear) changes what a Welcome
    says about the lease words or push mode: the MAC covers those fields, so the decode
    refuses the answer and reads nothing; the same Welcome passed on unchanged is read."""
    ps, p = _engine(factory, "wp", secret_file, 1)
    ds, d = _engine(factory, "wd", secret_file, 2, "--handshake-timeout-s", "2")
    proxy = None
    try:
        reg = p.registered
        assert reg is not None
        proxy = LyingProxy(reg.handshake_port, resign=False)
        pbk = p.allocate(2)
        p.fill("x", pbk)
        token = new_token()
        p.client.hold("x", pbk, lease_s=60, token=token)
        put = msgspec.structs.replace
        changes: dict[str, Lie] = {
            "no lease words (every read waits for its claim)": lambda w: put(w, lease_words_slots=0),
            "lease words elsewhere": lambda w: put(w, lease_words_addr=w.lease_words_addr + 64),
            "push mode switched": lambda w: put(w, layer_streams=not w.layer_streams,
                                                grouped_streams=not w.grouped_streams,
                                                chunk_streams=not w.chunk_streams)}
        for i, (what, change) in enumerate(changes.items()):
            proxy.lie = change
            blocks = d.allocate(2)
            d.client.recv(f"mitm-{i}", blocks, RemoteBlocks(reg.engine_id, "127.0.0.1", proxy.port, pbk,
                                                            req_id="x", token=token))
            got = d.client.wait_until(lambda a: bool(a.done or a.failed), 20)
            assert not proxy.unchanged, f"{what}: the Welcome was not changed (no lease words here?)"
            assert not got.done, f"{what}: a changed Welcome was used: {got}"
            (f,) = got.failed
            assert f.code == ErrorCode.UNAUTHORIZED, f"{what}: {f}"
            assert "prove" in f.reason, f"{what}: {f}"
            d.free(blocks)
            assert ds.scrape()["kvxfer_peers"] == 0, what
        _reads_the_truth(d, proxy, reg.engine_id, pbk, token)  # (the Welcome passed on as it came)
    finally:
        if proxy is not None:
            proxy.close()
        p.close()
        d.close()


# ----------------------------------------------------------------------------- a lying decode


class LyingDecode:
    """An authenticated peer with its own NIXL agent: it handshakes as a decode sidecar
    would, then says whatever the test wants."""

    def __init__(self, port: int, name: str) -> None:
        self.port = port
        self.agent_name = name
        self.agent = create_agent(name, "peer", 0)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.seq = 0
        self.remote = ""
        self.metadata = b""

    def ask(self, msg: Any) -> Any:
        self.sock.send(encode(msg))
        assert self.sock.poll(5000), "no answer"
        frames = self.sock.recv_multipart()
        reply = handshake_reply_decoder.decode(frames[0])
        return (reply, frames) if isinstance(reply, Welcome) else reply

    def handshake(self) -> Welcome:
        hello = Hello(version=PROTOCOL_VERSION, compat_hash=compat_hash(LAYOUT), engine_id="liar",
                      agent_name=self.agent_name, model=LAYOUT.model)
        challenge = self.ask(hello)
        assert isinstance(challenge, Challenge), challenge
        welcome, frames = self.ask(sign_hello(SECRET, hello, challenge.nonce, challenge.agent_name))
        self.metadata = frames[1]  # the prefill's NIXL metadata: the liar may hand it to anyone
        self.remote = self.agent.add_remote_agent(frames[1])
        self.remote = self.remote.decode() if isinstance(self.remote, bytes) else self.remote
        return welcome

    def notice(self, **fields: Any) -> None:
        base = {"req_id": "x", "tp_rank": 0, "ok": True}
        self.agent.send_notif(self.remote, encode(ReadNotice(**{**base, **fields})))

    def renew(self, **fields: Any) -> Any:
        self.seq += 1
        msg = LeaseRenew(**{"seq": self.seq, "engine_id": "", "req_ids": ["x"],
                            "agent_name": self.agent_name, **fields})
        return self.ask(sign_request(SECRET, msg))

    def digest(self, ranks: list[DigestRank], **fields: Any) -> Any:
        msg = DigestRequest(**{"req_id": "x", "ranks": ranks, "agent_name": self.agent_name, **fields})
        return self.ask(sign_request(SECRET, msg))

    def close(self) -> None:
        self.sock.close(0)


def _wait_metric(sc: SidecarProc, key: str, at_least: float, what: str,
                 *agents: Any) -> dict[str, float]:
    end = time.monotonic() + 10
    while True:
        for agent in agents:  # no NIXL progress thread here: sends move when we poll
            agent.get_new_notifs()
        m = sc.scrape()
        if m.get(key, 0) >= at_least:
            return m
        assert time.monotonic() < end, f"{what}: {key} stayed {m.get(key, 0)}"
        time.sleep(0.05)


def test_a_lying_decode_is_refused_and_an_honest_read_verifies(factory: SidecarFactory,
                                                               secret_file: str) -> None:
    ps, p = _engine(factory, "hp", secret_file, 1, "--max-read-s", "3")
    ds, d = _engine(factory, "hd", secret_file, 2)
    liar = stranger = None
    try:
        reg = p.registered
        assert reg is not None
        liar = LyingDecode(reg.handshake_port, "liar-agent")
        welcome = liar.handshake()
        assert welcome.ranks
        assert liar.remote == welcome.agent_name
        # A stranger has NIXL (and the metadata, from the liar) but never handshook itself.
        stranger = create_agent("stranger-agent", "peer", 0)
        token, pinned_token = new_token(), new_token()
        x, pinned = p.allocate(3), p.allocate(2)
        p.fill("x", x)
        p.client.hold("x", x, lease_s=60, token=token)
        _wait_metric(ps, "kvxfer_held_leases", 1, "the hold")

        refused = 'kvxfer_peer_refused_total{message="read_notice",reason="bad_token"}'
        # Read notices: for a request it was not given (no token, a guessed one), "done" and
        # "abandoned" alike; from an agent that never handshook, even with the right token.
        liar.notice(ok=True)
        liar.notice(ok=False, token="guess")
        liar.notice(ok=True, readers=1, tp_rank=7, pp_rank=3, token="guess")
        _wait_metric(ps, refused, 3, "notices without the capability", liar.agent)
        stranger.add_remote_agent(liar.metadata)
        stranger.send_notif(liar.remote, encode(ReadNotice(req_id="x", tp_rank=0, ok=True, token=token)))
        _wait_metric(ps, 'kvxfer_peer_refused_total{message="read_notice",reason="unauthenticated"}', 1,
                     "a notice from an agent that never handshook", stranger)
        # Durations: negative does not even decode; a day is cut to --max-read-s.
        liar.agent.send_notif(liar.remote, encode(ReadNotice(req_id="x", tp_rank=0, ok=True,
                                                             reading_s=-5.0, token=token)))
        _wait_metric(ps, 'kvxfer_stray_notices_total{kind="malformed"}', 1, "a negative duration", liar.agent)
        # "pinned" is held for one second; a reader that says its read lasts for ever gets
        # --max-read-s (3 s), and so does a renewal asking for a day.
        p.client.hold("pinned", pinned, lease_s=1, token=pinned_token)
        _wait_metric(ps, "kvxfer_held_leases", 2, "the second hold")
        liar.notice(req_id="pinned", reading_s=1e300, token=pinned_token)
        _wait_metric(ps, 'kvxfer_peer_refused_total{message="read_notice",reason="capped"}', 1,
                     "a read that says it lasts for ever", liar.agent)
        bad = liar.ask(sign_request(SECRET, LeaseRenew(seq=99, engine_id="", req_ids=["x"], extend_s=-1.0,
                                                       agent_name=liar.agent_name, tokens=[token])))
        assert isinstance(bad, Refused), bad
        assert bad.code == ErrorCode.MALFORMED, bad
        state = liar.renew(req_ids=["pinned"], extend_s=86400.0, tokens=[pinned_token])
        assert isinstance(state, LeaseState), state
        assert state.held == ["held"], state
        assert ps.scrape()['kvxfer_peer_refused_total{message="lease_renew",reason="capped"}'] >= 1
        state = liar.renew(req_ids=["x"], extend_s=86400.0, tokens=["guess"])
        assert isinstance(state, LeaseState), state
        assert state.held == ["unknown"], state  # looks like nothing
        # Digests: blocks it does not hold, a rank that does not exist, bytes beyond a block,
        # a request it has no token for.
        block_len = welcome.ranks[0].regions[0].block_len
        cases = [
            ([DigestRank(rank=0, items=[DigestItem(blocks=[10**6], runs=[[0, 8]])])],
             {"token": token}, ErrorCode.BLOCK_OUT_OF_RANGE),
            ([DigestRank(rank=0, items=[DigestItem(blocks=[pinned[0]], runs=[[0, 8]])])],
             {"token": token}, ErrorCode.BLOCK_OUT_OF_RANGE),
            ([DigestRank(rank=5, items=[DigestItem(blocks=[x[0]], runs=[[0, 8]])])],
             {"token": token}, ErrorCode.NOT_REGISTERED),
            ([DigestRank(rank=0, items=[DigestItem(blocks=[x[0]], runs=[[block_len - 4, 8]])])],
             {"token": token}, ErrorCode.MALFORMED),
            ([DigestRank(rank=0, items=[DigestItem(blocks=[x[0]], runs=[[0, 8]])])],
             {"token": "guess"}, ErrorCode.UNKNOWN_REQUEST),
        ]
        for ranks, fields, code in cases:
            got = liar.digest(ranks, **fields)
            assert isinstance(got, Refused), (ranks, got)
            assert got.code == code, (ranks, got)
        ok = liar.digest([DigestRank(rank=0, items=[DigestItem(blocks=[x[0]], runs=[[0, 8]])])], token=token)
        assert isinstance(ok, DigestReply), ok  # the same request, asked properly, is answered

        # The pinned lease ends within the cap, not in a day; "x" is still held for its reader.
        rel = p.client.wait_until(lambda a: bool(a.released), 15).released
        assert [(r.req_id, r.reason) for r in rel] == [("pinned", "expired")]
        assert ps.scrape()["kvxfer_descriptor_lists_prepared"] == 0
        honest = d.allocate(3)
        d.wipe(honest)
        d.client.recv("honest", honest, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port,
                                                     x, req_id="x", token=token))
        got = d.client.wait_until(lambda a: bool(a.done or a.failed), 20)
        assert [r.req_id for r in got.done] == ["honest"], got
        assert d.verify("x", honest)
        rel = p.client.wait_until(lambda a: bool(a.released), 10).released
        assert [(r.req_id, r.reason) for r in rel] == [("x", "read")]
    finally:
        if liar is not None:
            liar.close()
        p.close()
        d.close()

