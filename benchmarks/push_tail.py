"""#36: the post-prefill tail, push against pull, on real sidecars with synthetic engines.

The synthetic prefill engine computes a request's layers one at a time (``--layer-ms`` each,
a sleep standing in for the forward) and, in push mode, reports each (``LayersDone``) while
the decode's sidecar follows it (``Recv.streamed``: sent when the prefill starts, as a router
dispatching to both at once does). In pull mode the prefill holds the blocks after its last
layer and the decode's ``Recv`` follows at once (a router that forwards in no time).

The tail is what the decode's first token waits for after the prefill's last layer: from the
moment the last layer was computed (CLOCK_MONOTONIC, same host) to the decode engine holding
its ``Done``. One layer's transfer (raw NIXL reading the request's blocks, divided by its
layers) is printed beside it: #36's target is tail <= one layer's transfer + 300 us.
Push and pull alternate request by request; every byte is verified.

    .venv/bin/python benchmarks/push_tail.py [--requests 20] [--layers 32] [--blocks 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from kvxfer.client import RemoteBlocks, SidecarClient
from kvxfer.protocol import LayersDone
from kvxfer.testing.bench_targets import RawNixl
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory


def wait_done(client: SidecarClient, timeout: float = 30.0) -> tuple[Any, int]:
    """The first Done or Failed, and when the engine held it (monotonic ns): woken by the
    sidecar's doorbell, as an engine that waits for it is (it polled every 0.1 ms until
    2026-11-29, which added ~0.05-0.1 ms to every tail here)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = client.wait(max(0.0, min(0.1, end - time.monotonic())))
        if got.done or got.failed:
            now = time.monotonic_ns()
            if got.failed:
                raise RuntimeError(f"failed: {got.failed[0]}")
            return got.done[0], now
    raise TimeoutError("no Done")


def compute(p: SyntheticEngine, tid: str, blocks: list[int], layers: int, layer_s: float,
            report: bool) -> int:
    """The prefill's forward, layer by layer; when the last layer was done (monotonic ns)."""
    for layer in range(layers):
        t = time.perf_counter()
        p.fill_layers(tid, blocks, range(layer, layer + 1))
        left = layer_s - (time.perf_counter() - t)
        if left > 0:
            time.sleep(left)
        if report:
            p.client.send(LayersDone(req_ids=[tid], layers=layer + 1))
    return time.monotonic_ns()


def one(mode: str, i: int, p: SyntheticEngine, d: SyntheticEngine,
        args: argparse.Namespace) -> dict[str, float]:
    reg = p.registered
    assert reg is not None
    tid = f"{mode}-{i}"
    pb, db = p.allocate(args.blocks), d.allocate(args.blocks)
    p.wipe(pb)
    d.wipe(db)
    if mode == "push":
        p.client.hold(tid, pb, token=tid, streamed=True, expires_unix=time.time() + 60)
        d.client.recv(tid, db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, [],
                                            req_id=tid, token=tid), streamed=True, deadline_s=30, trace=True)
        last = compute(p, tid, pb, args.layers, args.layer_ms / 1000, True)
    else:
        last = compute(p, tid, pb, args.layers, args.layer_ms / 1000, False)
        p.client.hold(tid, pb, token=tid, expires_unix=time.time() + 60)
        d.client.recv(tid, db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb,
                                            token=tid), deadline_s=30)
    done, at = wait_done(d.client)
    if not d.verify(tid, db):
        raise RuntimeError(f"{tid}: bytes differ")
    d.free(db)
    end = time.monotonic() + 10
    while time.monotonic() < end and not p.client.poll().released:
        time.sleep(0.001)
    p.free(pb)
    hops = {}
    if done.trace:  # (push: from the last layer to each hop of the decode sidecar, then the engine)
        hops = {name: (ns - last) / 1000 for name, ns in done.trace if ns >= last}
        hops["engine"] = (at - last) / 1000
    return {"tail_us": (at - last) / 1000, "nbytes": done.nbytes, "hops": hops}


def one_layer_us(p: SyntheticEngine, d: SyntheticEngine, args: argparse.Namespace) -> float:
    """One layer's transfer: raw NIXL (an agent of its own, no sidecar) reading the request's
    blocks, median of 7, divided by its layers."""
    assert p.kv is not None
    assert d.kv is not None
    pb, db = p.allocate(args.blocks), d.allocate(args.blocks)
    raw = RawNixl(p.kv, d.kv, "peer", 2)
    try:
        took = statistics.median(raw.read(pb, db) for _ in range(7))
    finally:
        raw.close()
    p.free(pb)
    d.free(db)
    return took * 1e6 / args.layers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--layer-ms", type=float, default=2.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    lay = make_layout(layers=args.layers, num_blocks=4 * args.blocks + 8, heads=8, head_dim=128)
    out: dict[str, Any] = {"args": vars(args), "push": [], "pull": []}
    with SidecarFactory() as f:
        ds, ps = f.start("tail-d", "--verify-sample", "0"), f.start("tail-p")
        d, p = SyntheticEngine(lay, ds.endpoint, seed=2), SyntheticEngine(lay, ps.endpoint, seed=1)
        try:
            d.start()
            p.start()
            for i in range(2):  # warm-up: handshake, prepared lists
                one("push", 1000 + i, p, d, args)
                one("pull", 1000 + i, p, d, args)
            layer = one_layer_us(p, d, args)
            hops: dict[str, list[float]] = {}
            for i in range(args.requests):
                for mode in (("push", "pull") if i % 2 == 0 else ("pull", "push")):
                    res = one(mode, i, p, d, args)
                    out[mode].append(res["tail_us"])
                    for name, us in res["hops"].items():
                        hops.setdefault(name, []).append(us)
        finally:
            d.close()
            p.close()
    mib = args.blocks * lay.num_regions * lay.region_block_len / 2**20
    out["one_layer_us"] = round(layer)
    for mode in ("push", "pull"):
        xs = sorted(out[mode])
        out[f"{mode}_p50_us"] = round(statistics.median(xs))
        out[f"{mode}_p90_us"] = round(xs[int(0.9 * (len(xs) - 1))])
    print(f"push_tail: {args.requests} requests of {mib:.0f} MiB ({args.layers} layers, {args.layer_ms} ms "
          f"each), push and pull alternating; every byte verified")
    print(f"  one layer's transfer (raw NIXL, the request's read / {args.layers}, "
          f"{mib / args.layers * 1024:.0f} KiB): {out['one_layer_us']} us")
    for mode in ("push", "pull"):
        print(f"  {mode}: tail p50 {out[f'{mode}_p50_us']} us, p90 {out[f'{mode}_p90_us']} us")
    medians = {k: round(statistics.median(v)) for k, v in hops.items()}
    out["push_hops_us"] = dict(sorted(medians.items(), key=lambda kv: kv[1]))
    print("  push, after the last layer (median us): "
          + ", ".join(f"{k} {v}" for k, v in out["push_hops_us"].items()))
    target = out["one_layer_us"] + 300
    verdict = "met" if out["push_p50_us"] <= target else "MISSED"
    print(f"  {verdict}: push tail p50 {out['push_p50_us']} us <= one layer {out['one_layer_us']} us "
          "+ 300 us")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
