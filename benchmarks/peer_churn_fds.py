"""Open sockets across peer churn (README "Known limit: NIXL keeps the sockets of every live
peer it removes"; found by the 8-hour soak). Not a CI test: it measures an upstream leak.

    python benchmarks/peer_churn_fds.py [--cycles 8] [--out benchmarks/peer_churn_fds_latest.txt]

Three measurements, side by side:
- raw NIXL: two agents in this process (the sidecar's own ``create_agent``), a READ, then
  ``remove_remote_agent`` and ``add_remote_agent`` of each other, per UCX error mode;
- raw NIXL, the way around it for a changed registration: the peer's partial metadata
  loaded over the live entry instead;
- kvxfer: two real sidecars, a transfer (bytes verified), then the decode's operator
  ``DisconnectPeer`` of the live prefill, and the next transfer re-handshakes; open sockets of
  each sidecar after every cycle.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

import numpy as np


def sockets(pid: int | str = "self") -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return n


def read(a: Any, b: Any, name: str, dst: np.ndarray, src: np.ndarray, notif: bytes = b"") -> None:
    """Agent ``a`` reads all of ``src`` (agent ``b``'s, known to ``a`` as ``name``) into ``dst``,
    progressing ``b`` until it is done."""
    h = a.initialize_xfer("READ", a.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM"),
                          b.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM"), name, notif)
    a.transfer(h)
    while a.check_xfer_state(h) == "PROC":
        b.get_new_notifs()
    a.release_xfer_handle(h)


def raw_nixl(mode: str, threads: int, cycles: int) -> list[int]:
    from kvxfer.sidecar.nixl_agent import create_agent

    a = create_agent(f"A-{mode}{threads}", mode, threads)
    b = create_agent(f"B-{mode}{threads}", mode, threads)
    src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    a.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    b.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    out = []
    for _ in range(cycles):
        name = a.add_remote_agent(b.get_agent_metadata())
        b.add_remote_agent(a.get_agent_metadata())
        read(a, b, name, dst, src, b"n")
        a.remove_remote_agent(name)
        b.remove_remote_agent(f"A-{mode}{threads}")
        for _ in range(200):  # (progress both: it does not close them)
            a.get_new_notifs()
            b.get_new_notifs()
        out.append(sockets())
    return out


def raw_partial(cycles: int) -> tuple[list[int], int]:
    """The way around it for a peer whose registrations changed (its engine restarted): the
    peer's *partial* metadata (its new regions, no connection info) loaded over the live
    entry, no removal. Sockets after each cycle, and reads that moved the new bytes."""
    from kvxfer.sidecar.nixl_agent import create_agent

    a, b = create_agent("A-partial", "peer", 2), create_agent("B-partial", "peer", 2)
    dst = np.zeros(1 << 20, np.uint8)
    a.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    src = np.ones(1 << 20, np.uint8)
    reg = b.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    name = a.add_remote_agent(b.get_agent_metadata())
    out, right = [], 0
    for i in range(cycles):
        b.deregister_memory(reg)  # (the engine restarted: its memory is new)
        src = np.full(1 << 20, i + 2, np.uint8)
        region = [(src.ctypes.data, src.nbytes, 0, "")]
        reg = b.register_memory(region, "DRAM")
        a.add_remote_agent(b.get_partial_agent_metadata(b.get_reg_descs(region, "DRAM"), inc_conn_info=False))
        read(a, b, name, dst, src)
        right += bool((dst == i + 2).all())
        out.append(sockets())
    return out, right


def sidecars(cycles: int) -> tuple[list[int], list[int], int]:
    import grpc

    from kvxfer.client import RemoteBlocks
    from kvxfer.control.v1 import control_pb2 as pb
    from kvxfer.control.v1 import control_pb2_grpc as pb_grpc
    from kvxfer.testing.engine import SyntheticEngine, make_layout
    from kvxfer.testing.procs import SidecarFactory

    layout = make_layout(layers=4, num_blocks=64, heads=4, head_dim=64, block_size=16)
    dsock, psock, verified = [], [], 0
    with SidecarFactory() as f:
        ds, ps = f.start("churn-d", "--verify-sample", "0"), f.start("churn-p")
        d, p = SyntheticEngine(layout, ds.endpoint, seed=2), SyntheticEngine(layout, ps.endpoint, seed=1)
        d.start()
        p.start()
        reg = p.registered
        assert reg is not None
        try:
            for i in range(cycles):
                name, pb_, db = f"churn-{i}", p.allocate(2), d.allocate(2)
                p.fill(name, pb_)
                p.client.hold(name, pb_, token="t")
                d.client.recv(name, db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port,
                                                     pb_, token="t"), deadline_s=10)
                ev = d.client.wait_until(lambda a: bool(a.done or a.failed), 15)
                verified += bool(ev.done) and d.verify(name, db)
                d.free(db)
                p.client.wait_until(lambda a: bool(a.released), 5)
                p.free(pb_)
                peer = f"{reg.handshake_host}:{reg.handshake_port}"
                with grpc.insecure_channel(ds.control) as ch:
                    pb_grpc.ControlStub(ch).DisconnectPeer(pb.DisconnectPeerRequest(endpoint=peer), timeout=5)
                time.sleep(0.5)
                dsock.append(sockets(ds.proc.pid))
                psock.append(sockets(ps.proc.pid))
        finally:
            d.close()
            p.close()
    return dsock, psock, verified


def main() -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/peer_churn_fds.py")
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/peer_churn_fds_latest.txt")
    args = ap.parse_args()
    lines = [f"peer_churn_fds {time.strftime('%Y-%m-%d')}: open sockets after each of {args.cycles} "
             "remove/re-add cycles of a live peer"]
    for mode, threads in (("peer", 2), ("none", 2), ("peer", 0)):
        before = sockets()
        got = raw_nixl(mode, threads, args.cycles)
        per = (got[-1] - got[0]) / (len(got) - 1)
        lines.append(f"  raw NIXL, ucx error mode {mode}, {threads} UCX worker threads: "
                     f"{[n - before for n in got]} ({per:+.1f} per cycle)")
    before = sockets()
    got, right = raw_partial(args.cycles)
    lines.append(f"  raw NIXL, peer mode, partial metadata of new registrations over the live entry: "
                 f"{[n - before for n in got]} ({(got[-1] - got[0]) / (len(got) - 1):+.1f} per cycle; "
                 f"{right}/{args.cycles} reads moved the new bytes)")
    dsock, psock, verified = sidecars(args.cycles)
    for side, got in (("decode", dsock), ("prefill", psock)):
        lines.append(f"  kvxfer {side} sidecar (peer mode), DisconnectPeer + re-handshake: {got} "
                     f"({(got[-1] - got[0]) / (len(got) - 1):+.1f} per cycle)")
    lines.append(f"  transfers verified: {verified}/{args.cycles}")
    with open(args.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
