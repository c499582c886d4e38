"""``--verify-sample``: the decode digests what it received, the prefill what it served.

Unit level: the digest catches a flipped byte, swapped blocks and a half-moved block, and two
faithful copies agree whatever the layouts. End to end: real sidecars with a test-only hook
that flips one received byte; the load fails with code ``integrity`` (counted, logged with
both digests, sent as an event), the prefill releases, and the next read verifies."""

from __future__ import annotations

import grpc
import pytest
import torch

from kvxfer.control.v1 import control_pb2 as pb
from kvxfer.control.v1 import control_pb2_grpc as pb_grpc
from kvxfer.errors import ErrorCode
from kvxfer.integrity import digest, digest_items
from kvxfer.protocol import DigestItem
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, free_port, handshake_dealer
from kvxfer.topology import block_pairing, plan_rank
from tests.conftest import pull
from tests.test_sidecar import wait_for


def views(n_blocks: int = 6, block_len: int = 64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n_blocks, block_len), generator=g, dtype=torch.uint8) for _ in range(2)]


def test_digest_detects_a_flipped_byte_swapped_blocks_and_missing_bytes() -> None:
    v = views()
    whole = [DigestItem(blocks=[1, 2, 4], runs=[[0, 64]])]
    d0 = digest(v, whole)
    assert d0 == digest([t.clone() for t in v], whole)
    flipped = [t.clone() for t in v]
    flipped[1][2, 63] ^= 1
    assert digest(flipped, whole) != d0
    assert digest(v, [DigestItem(blocks=[2, 1, 4], runs=[[0, 64]])]) != d0  # order matters
    half = [DigestItem(blocks=[1, 2, 4], runs=[[0, 32]])]
    assert digest(v, half) != d0
    runs = [DigestItem(blocks=[1, 2, 4], runs=[[0, 16], [16, 48]])]  # same bytes, two runs
    assert digest(v, runs) == d0


def test_host_and_torch_digests_agree() -> None:
    """Host memory is digested with numpy (no torch in the sidecar), VRAM with torch: the
    same bytes must give the same digest on both paths (a prefill on one, a decode on the
    other would otherwise always mismatch)."""
    v = views(seed=3)
    split = [DigestItem(blocks=[4, 1], runs=[[3, 7], [40, 13]]), DigestItem(blocks=[2], runs=[[0, 9]])]
    for items in ([DigestItem(blocks=[0, 5, 2], runs=[[0, 64]])], split):
        assert digest(v, items) == digest([t.numpy() for t in v], items)


def test_a_torch_digest_waits_for_its_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A VRAM digest keeps its sums on the device and synchronizes once (``.item()``), not
    once per region: on an H200, 64 regions' synchronizations cost ~38 ms a check. Words
    that wrap (every byte 0xff) agree with numpy's wrapping sum."""
    v = [t.clone() for t in views(n_blocks=6, block_len=64, seed=5) for _ in range(8)]  # 16 regions
    v[3].fill_(0xFF)
    items = [DigestItem(blocks=[5, 0, 3], runs=[[0, 64]]), DigestItem(blocks=[2], runs=[[8, 24]])]
    calls = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: calls.append(1) or item(t))
    got = digest(v, items)
    assert len(calls) == 1
    assert got == digest([t.numpy() for t in v], items)


def test_digest_items_pair_local_and_remote_bytes_across_tp_and_block_sizes() -> None:
    local = make_layout(layers=1, num_blocks=8, block_size=8, heads=4, head_dim=4, tp_rank=1, tp_size=2,
                        head_layout="HND")
    remote = make_layout(layers=1, num_blocks=8, block_size=4, heads=4, head_dim=4, tp_rank=0, tp_size=1,
                         head_layout="NHD")
    plans, pairing = plan_rank(local, remote), block_pairing(local, remote)
    items = digest_items(plans, pairing, [5, 2], [1, 3, 6, 7])
    (lit, rit, _plan), = items.values()
    assert [i.blocks for i in lit] == [[5, 2], [5, 2]]  # two remote blocks fill each local one
    assert [i.blocks for i in rit] == [[1, 6], [3, 7]]
    assert sum(n for i in lit for _, n in i.runs) == sum(n for i in rit for _, n in i.runs)


def stub(sc: object) -> pb_grpc.ControlStub:
    return pb_grpc.ControlStub(grpc.insecure_channel(sc.control))  # type: ignore[attr-defined]


def test_a_corrupted_receive_fails_with_integrity_and_the_next_one_verifies() -> None:
    with SidecarFactory() as f:
        ps = f.start("ip", "--handshake-timeout-s", "2", metrics_port=free_port())
        ds = f.start("id", "--handshake-timeout-s", "2", "--verify-sample", "1", metrics_port=free_port(),
                     env={"KVXFER_TEST_CORRUPT_READS": "1"})
        lay = make_layout(layers=2, num_blocks=32, heads=4, head_dim=32)
        p, d = SyntheticEngine(lay, ps.endpoint, seed=1), SyntheticEngine(lay, ds.endpoint, seed=2)
        try:
            p.start()
            d.start()
            events = stub(ds).WatchEvents(pb.WatchEventsRequest(kinds=["integrity_failure"]), timeout=30)
            for n, req in enumerate(["bad-1", "good-1", "good-2"]):
                _, db, got = pull(p, d, req, 3)
                rel = wait_for(p.client, lambda a: bool(a.released))
                if n == 0:
                    assert not got.done
                    assert got.failed[0].code == ErrorCode.INTEGRITY, got.failed
                    assert "differ" in got.failed[0].reason
                    assert not d.verify(req, db)  # the hook really corrupted what landed
                    assert rel.released[0].reason == "aborted"  # the prefill let go of its blocks
                else:
                    assert not got.failed, got.failed
                    assert d.verify(req, db)
                    assert rel.released[0].reason == "read"
            ev = next(iter(events))
            assert (ev.kind, ev.request_id, ev.code) == ("integrity_failure", "bad-1", "integrity")
            events.cancel()
            m = ds.scrape()
            assert m["kvxfer_integrity_failures_total"] == 1
            assert m['kvxfer_integrity_checks_total{result="mismatch"}'] == 1
            assert m['kvxfer_integrity_checks_total{result="ok"}'] == 2
            assert m['kvxfer_transfer_failures_total{reason="integrity"}'] == 1
            log = ds.log()
            assert "integrity: receive bad-1" in log
            assert "!= prefill digests" in log
        finally:
            p.close()
            d.close()


@pytest.mark.parametrize("sample", [0, 4])
def test_verify_sample_checks_the_first_read_per_peer_then_one_in_n(sample: int) -> None:
    with SidecarFactory() as f:
        ps = f.start("sp", "--handshake-timeout-s", "2", metrics_port=free_port())
        ds = f.start("sd", "--verify-sample", str(sample), metrics_port=free_port())
        lay = make_layout(layers=2, num_blocks=64, heads=2, head_dim=16)
        p, d = SyntheticEngine(lay, ps.endpoint, seed=1), SyntheticEngine(lay, ds.endpoint, seed=2)
        try:
            p.start()
            d.start()
            for i in range(9):
                _, db, got = pull(p, d, f"s{i}", 2)
                assert got.done
                assert d.verify(f"s{i}", db)
                wait_for(p.client, lambda a: bool(a.released))
            checks = ds.scrape().get('kvxfer_integrity_checks_total{result="ok"}', 0)
            assert checks == (0 if sample == 0 else 1 + 2)  # the first read, then reads 4 and 8
        finally:
            p.close()
            d.close()


def test_a_digest_of_blocks_not_held_is_refused() -> None:
    """Digests are served only for blocks a lease still holds: nobody can make the prefill
    hash (or time) memory it did not offer (even a holder of the host key, signing its asks)."""
    import zmq

    from kvxfer import hostkey
    from kvxfer.auth import sign_hello, sign_request
    from kvxfer.protocol import (
        PROTOCOL_VERSION,
        Challenge,
        DigestRank,
        DigestRequest,
        Hello,
        Refused,
        Welcome,
        compat_hash,
        encode,
        handshake_reply_decoder,
    )

    with SidecarFactory() as f:
        ps = f.start("hp")
        lay = make_layout(layers=1, num_blocks=16, heads=1, head_dim=16)
        p = SyntheticEngine(lay, ps.endpoint)
        try:
            p.start()
            reg = p.registered
            assert reg is not None
            p.client.hold("held", [3, 4])
            ctx = zmq.Context()
            sock = handshake_dealer(ctx, reg.handshake_host, reg.handshake_port)
            key = hostkey.load(hostkey.default_path())  # this user's: an authenticated peer
            hello = Hello(version=PROTOCOL_VERSION, compat_hash=compat_hash(lay), engine_id="probe",
                          agent_name="probe-agent", model=lay.model)
            sock.send(encode(hello))
            assert sock.poll(5000)
            challenge = handshake_reply_decoder.decode(sock.recv_multipart()[0])
            assert isinstance(challenge, Challenge)
            sock.send(encode(sign_hello(key, hello, challenge.nonce, challenge.agent_name)))
            assert sock.poll(5000)
            assert isinstance(handshake_reply_decoder.decode(sock.recv_multipart()[0]), Welcome)
            cases = [("held", [3, 9], "does not hold"), ("nothing", [3], "no blocks held"),
                     ("held", [3, 4] * 100, "larger than the held blocks")]
            for req_id, blocks, why in cases:
                item = DigestItem(blocks=blocks, runs=[[0, 16]])
                ask = DigestRequest(req_id=req_id, ranks=[DigestRank(rank=0, items=[item])],
                                    agent_name="probe-agent")
                sock.send(encode(sign_request(key, ask)))
                assert sock.poll(5000)
                reply = handshake_reply_decoder.decode(sock.recv_multipart()[0])
                assert isinstance(reply, Refused)
                assert why in reply.reason, reply
            sock.close(0)
            ctx.term()
        finally:
            p.close()
