"""The wire format is a contract: pin the encoded bytes of every message."""

from __future__ import annotations

import msgspec
import pytest

from kvxfer import protocol as p

LAYOUT = p.KVLayout(
    num_layers=2, num_blocks=10, block_size=16, num_kv_heads=8, local_kv_heads=8,
    head_dim=128, dtype="bfloat16",
)

MESSAGES: dict[str, tuple[object, str]] = {
    "register": (
        p.RegisterKV(
            layout=LAYOUT,
            memory=[p.ShmMemory(path="/dev/shm/x", size=4096)],
            regions=[p.KVRegion(memory=0, offset=0, block_len=64, block_stride=64)],
        ),
        (
            "9aa87265676973746572dc0017a66c61796f7574020a100808cc80a862666c6f6174313602c2a34e"
            "48440001a0a0000100000000a0909193a373686daa2f6465762f73686d2f78cd10009195a672656769"
            "6f6e0000404000a000c0c0cb0000000000000000"
        ),
    ),
    "unregister": (p.Unregister(tp_rank=1), "94aa756e726567697374657201a000"),
    "hold": (p.Hold(req_id="r1", block_ids=[1, 2, 3], lease_s=2.5, reads=2), "9ea4686f6c64a2723193010203cb400400000000000002c2cb0000000000000000a0a0c2c000c2c2"),
    "release": (p.Release(req_id="r1"), "93a772656c65617365a27231a0"),
    "holds_check": (p.HoldsCheck(engine_id="E", req_ids=["r1", "r2"]), "93ab686f6c64735f636865636ba14592a27231a27232"),
    "recv": (
        p.Recv(req_id="r1", block_ids=[4, 5], remote_engine_id="P", remote_host="10.0.0.1",
               remote_port=5700, remote_block_ids=[1, 2]),
        (
            "dc0019a472656376a27231920405a150a831302e302e302e31cd16449201020100a0cb0000000000"
            "000000c2cb0000000000000000a0a000a0c0c0c2c2c0c00000"
        ),
    ),
    "ping": (p.Ping(seq=7), "92a470696e6707"),
    "registered": (
        p.Registered(tp_rank=0, engine_id="D", agent_name="a", bytes_registered=4096,
                     handshake_host="h", handshake_port=5700),
        "99aa7265676973746572656400a144a161cd1000a168cd16440000",
    ),
    "done": (p.Done(req_id="r1", nbytes=1024, seconds=0.5), "96a4646f6e65a27231cd0400cb3fe000000000000000c0"),
    "failed": (p.Failed(req_id="r1", block_ids=[4, 5], code="deadline", reason="late"), "97a66661696c6564a27231920405a8646561646c696e65a46c617465ffff"),
    "released": (p.Released(req_id="r1", reason="read", reads=1), "94a872656c6561736564a27231a47265616401"),
    "error": (p.Error(code="malformed", message="bad", req_id="r1"), "94a56572726f72a96d616c666f726d6564a3626164a27231"),
    "pong": (p.Pong(seq=7, engine_id="D", version=1, handshake_host="h", handshake_port=1), "9ca4706f6e6707a14401a16801a0a0c2c2c2c2"),
    "hello": (p.Hello(version=1, compat_hash="abcd", engine_id="D", agent_name="a"), "9ca568656c6c6f01a461626364a144a161a0cb0000000000000000a0a0a0a0a0"),
    "welcome": (
        p.Welcome(version=1, compat_hash="abcd", engine_id="P", agent_name="b",
                  ranks=[p.RankInfo(layout=LAYOUT, regions=[p.RemoteRegion(addr=4096, block_len=64, block_stride=64)])]),
        (
            "dc0010a777656c636f6d6501a461626364a150a1629196a472616e6bdc0017a66c61796f7574020a1008"
            "08cc80a862666c6f6174313602c2a34e48440001a0a0000100000000a0909195a772726567696f6ecd"
            "1000404000a44452414da000a0a0000000c2c2c2a0c2"
        ),
    ),
    "refused": (p.Refused(version=1, code="incompatible", reason="no"), "94a77265667573656401ac696e636f6d70617469626c65a26e6f"),
    "digest": (
        p.DigestRequest(req_id="r1", agent_name="a",
                        ranks=[p.DigestRank(rank=0, items=[p.DigestItem(blocks=[1, 2], runs=[[0, 64]])])]),
        "97a6646967657374a272319196a56472616e6b009193a5646974656d92010291920040000000a161a0a0a0",
    ),
    "digested": (p.DigestReply(req_id="r1", digests=["00ff:8"]), "93a86469676573746564a2723191a6303066663a38"),
    "keepalive": (p.KeepAlive(remote_engine_id="P", remote_host="h", remote_port=5700, remote_req_ids=["r1"], req_ids=["d1"]), "97a96b656570616c697665a150a168cd164491a2723191a2643190"),
    "renew": (p.LeaseRenew(seq=3, engine_id="P", req_ids=["r1"], extend_s=2.5, agent_name="a"), "98a572656e657703a15091a27231cb4004000000000000a161a090"),
    "challenge": (p.Challenge(version=4, nonce="n1", agent_name="b"), "94a96368616c6c656e676504a26e31a162"),
    "leases": (p.LeaseState(seq=3, held=["held", "gone"]), "95a66c65617365730392a468656c64a4676f6e65a090"),
    "cancel": (p.Cancel(req_id="r1", engine_id="E"), "93a663616e63656ca27231a145"),
    "layers": (p.LayersDone(req_ids=["t1"], layers=3, tp_rank=1), "97a66c617965727391a27431030100a000"),
    "watch": (p.LayerWatch(seq=4, engine_id="P", req_id="t1", have=2, token="tok"),
              "9aa5776174636804a150a2743102a3746f6bcb3ff0000000000000cb0000000000000000a0a0"),
    "cwatch": (p.ChunkWatch(seq=4, engine_id="P", req_id="t1", have=2, token="tok", seen=3),
               "9ba663776174636804a150a2743102a3746f6bcb3ff0000000000000cb0000000000000000a0a003"),
    "layersat": (p.LayersAt(seq=4, held="held", ready=3, total=8, block_ids=[1, 2], generation="g", tp_size=2,
                            engine_id="P"), "dc0012a86c6179657273617404a468656c64030892010290a16702a150a0a0c000c20000a0"),
    "stage": (
        p.StageRequest(seq=3, engine_id="P", req_id="r1", ranks=[p.StageRank(rank=0, runs=bytes(range(16)))],
                       nbytes=64, readers=["0/0"], extend_s=2.5, agent_name="a"),
        "9ba5737461676503a150a272319194a57372616e6b00c410000102030405060708090a0b0c0d0e0f004091a3302f30cb40"
        "04000000000000a161a0a0",
    ),
    "staged": (p.Staged(seq=3, held="held", addr=4096, nbytes=64, ttl_s=7.5),
               "99a673746167656403a468656c64cd100040cb401e000000000000a0a0a0"),
    "read": (p.ReadNotice(req_id="r1", tp_rank=0, ok=True, readers=2), "9aa472656164a2723100c302cb0000000000000000a000a0a0"),
}

DECODERS = {
    p.EngineRequest: p.engine_request_decoder,
    p.SidecarEvent: p.sidecar_event_decoder,
    p.HandshakeRequest: p.handshake_request_decoder,
    p.HandshakeReply: p.handshake_reply_decoder,
}


def _decoder_for(msg: object) -> msgspec.msgpack.Decoder:  # type: ignore[type-arg]
    for union, dec in DECODERS.items():
        if isinstance(msg, union.__args__):  # type: ignore[attr-defined]
            return dec
    return p.read_notice_decoder


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_encoded_bytes_are_pinned(kind: str) -> None:
    msg, expected = MESSAGES[kind]
    assert p.encode(msg).hex() == expected  # type: ignore[arg-type]
    assert _decoder_for(msg).decode(bytes.fromhex(expected)) == msg


def test_every_message_kind_is_pinned() -> None:
    tags = set()
    for union in (p.EngineRequest, p.SidecarEvent, p.HandshakeRequest, p.HandshakeReply):
        tags |= {t.__struct_config__.tag for t in union.__args__}  # type: ignore[attr-defined]
    tags |= {p.Hello.__struct_config__.tag, p.ReadNotice.__struct_config__.tag}
    assert tags == set(MESSAGES)


def test_protocol_version_is_pinned() -> None:
    # Changing the wire format means bumping this and re-pinning the bytes above.
    assert p.PROTOCOL_VERSION == 6


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        msgspec.msgpack.encode(["hold", "r1", [-1]]),  # negative block id
        msgspec.msgpack.encode(["hold", "", [1]]),  # empty request id
        msgspec.msgpack.encode(["recv", "r", [1], "P", "h", 70000, [1]]),  # port out of range
        msgspec.msgpack.encode(["nope", 1]),  # unknown kind
        msgspec.msgpack.encode({"tag": "ping"}),  # not array-like
    ],
)
def test_engine_decoder_rejects_bad_input(body: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        p.engine_request_decoder.decode(body)


def test_older_decoder_ignores_appended_fields() -> None:
    class HoldV0(msgspec.Struct, array_like=True, tag="hold"):
        req_id: str
        block_ids: list[int]

    new = p.encode(p.Hold(req_id="r1", block_ids=[1], notify_ranks=True))
    assert msgspec.msgpack.decode(new, type=HoldV0) == HoldV0(req_id="r1", block_ids=[1])


def test_older_peer_without_trailing_fields_still_decodes() -> None:
    # Schema evolution: fields appended later have defaults, so a shorter array decodes.
    short = msgspec.msgpack.encode(["hold", "r1", [1, 2]])
    assert p.engine_request_decoder.decode(short) == p.Hold(req_id="r1", block_ids=[1, 2])


def test_compat_hash_tracks_model_signature() -> None:
    other = msgspec.structs.replace(LAYOUT, head_dim=64)
    same_model_other_rank = msgspec.structs.replace(LAYOUT, tp_rank=0, num_blocks=99)
    assert p.compat_hash(LAYOUT) != p.compat_hash(other)
    assert p.compat_hash(LAYOUT) == p.compat_hash(same_model_other_rank)


def test_a_failed_without_its_rank_still_decodes() -> None:
    """Failed.tp_rank/pp_rank were appended within version 6: the bytes of a sidecar from
    before them decode (rank 0), and a decoder from before them reads the new bytes."""
    old = bytes.fromhex("95a66661696c6564a27231920405a8646561646c696e65a46c617465")
    got = p.sidecar_event_decoder.decode(old)
    assert got == p.Failed(req_id="r1", block_ids=[4, 5], code="deadline", reason="late")
    assert (got.tp_rank, got.pp_rank) == (-1, -1)  # (not said: the scheduler then passes it to nobody)

    class OldFailed(msgspec.Struct, array_like=True, tag="failed"):
        req_id: str
        block_ids: list[int]
        code: str
        reason: str

    new = p.encode(p.Failed(req_id="r1", block_ids=[4], code="c", reason="r", tp_rank=3, pp_rank=1))
    assert msgspec.msgpack.decode(new, type=OldFailed) == OldFailed("r1", [4], "c", "r")


def test_lease_words_fields_are_appended_within_version_6() -> None:
    """Welcome.lease_words_addr/slots and LeaseState.published (#38) were appended: a sidecar
    from before them sends shorter arrays (no words: every read waits for its claim), and
    one from before them decodes the new bytes."""
    old = bytes.fromhex("94a66c65617365730392a468656c64a4676f6e65a0")
    got = p.handshake_reply_decoder.decode(old)
    assert got == p.LeaseState(seq=3, held=["held", "gone"])
    assert got.published == []

    class OldLeaseState(msgspec.Struct, array_like=True, tag="leases"):
        seq: int
        held: list[str]
        generation: str = ""

    new = p.encode(p.LeaseState(seq=3, held=["held"], published=[True]))
    assert msgspec.msgpack.decode(new, type=OldLeaseState) == OldLeaseState(3, ["held"])


def test_state_parts_and_tp_hashes_are_appended_within_version_6() -> None:
    """KVLayout.state_parts and Hello/Welcome.compat_tp (state between different TP sizes) were
    appended: a decoder from before them reads a
    layout with them, and a Hello from before them decodes (no TP-independent hash)."""
    with_parts = msgspec.structs.replace(LAYOUT, state_regions=1, state_bytes=64, state_kind="mamba2",
                                         state_parts=(p.StatePart(0, 1, 0, 4, 16),))
    without = p.encode(msgspec.structs.replace(with_parts, state_parts=()))
    assert p.encode(with_parts).startswith(without[:-1])  # (the same fields, then the parts)

    class OldLayout(msgspec.Struct, array_like=True, tag="layout"):
        num_layers: int
        num_blocks: int

    assert msgspec.msgpack.decode(p.encode(with_parts), type=OldLayout) == OldLayout(LAYOUT.num_layers,
                                                                                    LAYOUT.num_blocks)
    old_hello = p.encode(p.Hello(version=6, compat_hash="ab", engine_id="D", agent_name="a"))[:-1]
    old_hello = bytes([old_hello[0] - 1]) + old_hello[1:]  # (one element fewer: no compat_tp)
    got = p.handshake_request_decoder.decode(old_hello)
    assert isinstance(got, p.Hello)
    assert got.compat_tp == ""
    assert got.compat_hash == "ab"


def test_the_fields_of_signed_peer_requests_are_pinned_within_version_6() -> None:
    """A signed peer request's MAC is over its re-encoding as the receiver decoded it
    (``kvxfer.auth._request_mac``): a field appended to one of these kinds within version 6
    would make a sidecar that knows it and one that does not refuse each other's requests
    whenever they share a secret (``ChunkWatch.now`` did, for a day: found by review). Say
    what a new field needs another way (a value its readers already take, as ChunkWatch's
    first ``seen`` of -1), or bump the version."""
    assert p.PROTOCOL_VERSION == 6
    pinned = {
        p.DigestRequest: ("req_id", "ranks", "agent_name", "mac", "engine_id", "token"),
        p.LeaseRenew: ("seq", "engine_id", "req_ids", "extend_s", "agent_name", "mac", "tokens"),
        p.StageRequest: ("seq", "engine_id", "req_id", "ranks", "nbytes", "readers", "extend_s", "agent_name",
                         "mac", "token"),
        p.LayerWatch: ("seq", "engine_id", "req_id", "have", "token", "wait_s", "extend_s", "agent_name", "mac"),
        p.ChunkWatch: ("seq", "engine_id", "req_id", "have", "token", "wait_s", "extend_s", "agent_name", "mac",
                       "seen"),
    }
    for kind, fields in pinned.items():
        assert kind.__struct_fields__ == fields, kind.__name__
