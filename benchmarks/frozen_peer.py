"""A READ against a frozen (SIGSTOPped) peer, on two raw NIXL agents as the sidecar creates
them: does it land, does NIXL report it, does it settle once the initiator removes the
remote agent, and does any byte land after the peer resumes? (#37's open question.)

    python benchmarks/frozen_peer.py [remove|release|none] [peer|none] \
        [--chunk BYTES] [--notif] [--memfd] [--other-thread]

Measured 2026-11-26 on this CPU (64 MiB, UCX over CMA on one host): see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

import numpy as np

from kvxfer.sidecar.nixl_agent import create_agent

SIZE = 64 << 20
_KEEP: list[mmap.mmap] = []


def _buffer(fill: int, memfd: bool) -> np.ndarray:
    if not memfd:
        return np.full(SIZE, fill, dtype=np.uint8)
    fd = os.memfd_create("kvxfer-frozen")
    os.ftruncate(fd, SIZE)
    m = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    _KEEP.append(m)
    arr = np.frombuffer(m, dtype=np.uint8)
    arr[:] = fill
    return arr


def _target(conn: Any, mode: str, memfd: bool) -> None:
    a = create_agent("T", mode, 2)
    buf = _buffer(0xAB, memfd)
    a.register_memory([(buf.ctypes.data, SIZE, 0, "")], "DRAM")
    conn.send((bytes(a.get_agent_metadata()), buf.ctypes.data))
    while True:  # progress as a sidecar's NIXL thread does
        a.get_new_notifs()
        time.sleep(0.0005)


def _states(a: Any, handles: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in handles:
        try:
            s = str(a.check_xfer_state(h))
        except Exception as e:
            s = type(e).__name__
        out[s] = out.get(s, 0) + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", nargs="?", default="remove", choices=["remove", "release", "none"])
    ap.add_argument("mode", nargs="?", default="peer", choices=["peer", "none"])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--notif", action="store_true", help="send_notif to the peer after the first post")
    ap.add_argument("--memfd", action="store_true", help="memfd-backed buffers, as the sidecar's pools")
    ap.add_argument("--other-thread", action="store_true", help="post from another thread than the warm-up")
    ap.add_argument("--readd", action="store_true", help="after the resume: release the handles, load the "
                    "peer again, and read from it (what a re-handshake does)")
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    t = ctx.Process(target=_target, args=(child, args.mode, args.memfd), daemon=True)
    t.start()
    md, raddr = parent.recv()
    a = create_agent("I", args.mode, 2)
    loc = _buffer(0, args.memfd)
    a.register_memory([(loc.ctypes.data, SIZE, 0, "")], "DRAM")
    name = a.add_remote_agent(md)

    def post(off: int, n: int) -> Any:
        h = a.initialize_xfer("READ", a.get_xfer_descs([(loc.ctypes.data + off, n, 0)], "DRAM"),
                              a.get_xfer_descs([(raddr + off, n, 0)], "DRAM"), name)
        a.transfer(h)
        return h

    warm = post(0, 4096)
    while a.check_xfer_state(warm) != "DONE":
        pass
    a.release_xfer_handle(warm)
    loc[:] = 0
    os.kill(t.pid, signal.SIGSTOP)
    handles: list[Any] = []

    def post_all() -> None:
        for off in range(0, SIZE, args.chunk):
            handles.append(post(off, args.chunk))
            if args.notif and len(handles) == 1:
                a.send_notif(name, b"started")

    if args.other_thread:
        th = threading.Thread(target=post_all)
        th.start()
        th.join()
    else:
        post_all()
    time.sleep(1.0)
    print(f"[{args.mode} mode, {args.action}] 1 s after posting with the peer frozen: "
          f"{_states(a, handles)}, bytes landed {int(np.count_nonzero(loc))} of {SIZE}")
    if args.action == "remove":
        a.remove_remote_agent(name)
    elif args.action == "release":
        for h in handles:
            a.release_xfer_handle(h)
        handles = []
    t0 = time.monotonic()
    states = _states(a, handles)
    while handles and "PROC" in states and time.monotonic() - t0 < 3.0:
        time.sleep(0.01)
        states = _states(a, handles)
    print(f"  then after {time.monotonic() - t0:.2f} s: {states}")
    loc[:] = 0  # the blocks are reused now
    os.kill(t.pid, signal.SIGCONT)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.0:
        a.get_new_notifs()
        _states(a, handles)
        time.sleep(0.005)
    print(f"  bytes written after the reuse and the peer's resume: {int(np.count_nonzero(loc))}")
    if args.readd:
        _readd(a, md, handles, post, loc)
    t.kill()


def _readd(a: Any, md: bytes, handles: list[Any], post: Any, loc: np.ndarray) -> None:
    refused = 0
    for h in handles:
        try:
            a.release_xfer_handle(h)
        except Exception:
            refused += 1
    print(f"  release of the {len(handles)} settled handles: {refused} refused")
    t0 = time.monotonic()
    a.add_remote_agent(md)
    h = post(0, SIZE)
    while (state := a.check_xfer_state(h)) == "PROC" and time.monotonic() - t0 < 5.0:
        a.get_new_notifs()
        time.sleep(0.001)
    a.release_xfer_handle(h)
    ok = bool((loc == 0xAB).all())
    print(f"  peer loaded again, one {SIZE >> 20} MiB read: {state} in {time.monotonic() - t0:.3f} s, "
          f"bytes right: {ok}")


if __name__ == "__main__":
    main()
