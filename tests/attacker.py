"""Attacks run as another user of the same host, the way #40 found its doors.

``python -m tests.attacker <attack> <json args>`` imports everything it needs as root (the
interpreter and the venv live where another uid cannot read), then forks: the child drops to
uid/gid 65534 with ``os.setuid`` and attacks a running sidecar; what it saw comes back to the
parent on a pipe and is printed as one JSON object. The parent never used gRPC or ZMQ before
the fork, so the child starts both afresh.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (socket's lazy import would fail once we cannot read the stdlib)
import faulthandler
import json
import os
import secrets
import select
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
import zmq

from kvxfer.auth import CALL_HEADER, call_audience, sign_call
from kvxfer.control.v1 import control_pb2 as pb
from kvxfer.control.v1 import control_pb2_grpc as pb_grpc
from kvxfer.protocol import PROTOCOL_VERSION, Hello, encode, handshake_reply_decoder

NOBODY = 65534
HANG_S = 40.0  # an attack that takes longer has hung: its threads' stacks are dumped, it ends


def handshake(port: int, compat_hash: str, model: str, key_path: str) -> dict[str, Any]:
    """Read the sidecar's host key if we can; then ask the sidecar's loopback handshake listener for a
    Welcome (which carries the NIXL metadata that lets a NIXL agent read the engine's KV)."""
    out: dict[str, Any] = {}
    try:
        with open(key_path, "rb") as fh:
            out["key"] = len(fh.read())
    except OSError as e:
        out["key"] = type(e).__name__
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 5000)  # (a send that cannot queue: no answer either, never a hang)
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send(encode(Hello(version=PROTOCOL_VERSION, compat_hash=compat_hash, engine_id="mallory",
                        agent_name="mallory-agent", model=model)))
    if s.poll(5000):
        frames = s.recv_multipart()
        reply = handshake_reply_decoder.decode(frames[0])
        out["reply"] = type(reply).__name__
        out["metadata_bytes"] = len(frames[1]) if len(frames) > 1 else 0
    else:
        out["reply"] = "none"
        out["metadata_bytes"] = 0
    s.close(0)
    ctx.term()
    return out


def _code(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "OK", call()
    except grpc.RpcError as e:
        return e.code().name, None


def control(target: str, req_id: str) -> dict[str, Any]:
    """Every verb that lists requests or changes things, plain; then one signed with a key
    of our own making."""
    out: dict[str, Any] = {}
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.ControlStub(ch)
        code, st = _code(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=5))
        out["GetStatus"] = code
        if st is not None:
            out["status_redacted"] = st.redacted
            out["status_leases"] = [x.request_id for x in st.leases]
        code, got = _code(lambda: stub.ListTransfers(pb.ListTransfersRequest(), timeout=5))
        out["ListTransfers"] = code
        out["ListPeers"] = _code(lambda: stub.ListPeers(pb.ListPeersRequest(), timeout=5))[0]
        watch = pb.WatchEventsRequest()
        out["WatchEvents"] = _code(lambda: next(iter(stub.WatchEvents(watch, timeout=2))))[0]
        out["CancelTransfer"] = _code(lambda: stub.CancelTransfer(
            pb.CancelTransferRequest(request_id=req_id), timeout=5))[0]
        out["Drain"] = _code(lambda: stub.Drain(pb.DrainRequest(timeout_s=1), timeout=10))[0]
        forged = [(CALL_HEADER, sign_call(secrets.token_hex(32).encode(), "Drain", call_audience(target)))]
        out["Drain_forged_key"] = _code(lambda: stub.Drain(pb.DrainRequest(timeout_s=1), timeout=10,
                                                           metadata=forged))[0]
    return out


def relay(listen_port: int, target_port: int, seconds: float, needle: str) -> dict[str, Any]:
    """A TCP relay on loopback in front of a sidecar's handshake port (a request's
    kv_transfer_params may name any remote_port): forward both ways for ``seconds``, keep
    every byte, say whether ``needle`` (the prefill's agent name, which its Welcome and NIXL
    metadata carry) went by in clear."""
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("127.0.0.1", listen_port))
    lst.listen(16)
    seen = bytearray()
    conns: list[socket.socket] = []
    end = time.monotonic() + seconds
    pairs: dict[socket.socket, socket.socket] = {}
    while time.monotonic() < end:
        ready, _, _ = select.select([lst, *pairs], [], [], 0.05)
        for s in ready:
            if s is lst:
                a, _ = lst.accept()
                b = socket.create_connection(("127.0.0.1", target_port))
                pairs[a], pairs[b] = b, a
                conns += [a, b]
                continue
            data = s.recv(65536) if s in pairs else b""
            if not data:
                other = pairs.pop(s, None)
                if other is not None:
                    pairs.pop(other, None)
                    other.close()
                s.close()
                continue
            seen += data
            pairs[s].sendall(data)
    for s in conns:
        s.close()
    lst.close()
    return {"relayed": len(seen), "needle_seen": needle.encode() in seen}


ATTACKS: dict[str, Callable[..., dict[str, Any]]] = {"handshake": handshake, "control": control,
                                                      "relay": relay}


def as_nobody(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the attacker
        os.close(r)
        # (a child that hangs says where, on stderr, and ends: the parent answers "no answer";
        # one did hang once in a full run under load, 120 s, nothing said)
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            assert os.geteuid() == NOBODY
            out = fn(*args)
            out["uid"] = os.getuid()
        except BaseException as e:  # noqa: BLE001 (reported, not raised: this is a child)
            out = {"crash": repr(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b'{"crash": "no answer"}')


if __name__ == "__main__":
    print(json.dumps(as_nobody(ATTACKS[sys.argv[1]], *json.loads(sys.argv[2]))))
