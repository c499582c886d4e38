"""P/D throughput through two real sidecars, on host memory or GPU memory.

    python benchmarks/pd_throughput.py [--device cpu|cuda:0] [--requests N] [--json]

One process plays both engines (its KV caches live in shared memory or CUDA memory
exported over IPC); the two ``kvxfer serve`` processes move the blocks over NIXL.
The clock runs from the first Recv to the last Done, after a warm-up request that pays
the handshake. Every byte is verified after timing. Prints one JSON line with --json.
"""

from __future__ import annotations

import argparse
import json
import time

from kvxfer.client import Drained, RemoteBlocks
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory


def _collect(eng: SyntheticEngine, n: int, timeout: float) -> Drained:
    return eng.client.wait_until(lambda a: len(a.done) + len(a.failed) >= n, timeout)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--blocks-per-request", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ucx-error-mode", default="peer")
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n, bpr = args.requests, args.blocks_per_request
    layout = make_layout(layers=args.layers, num_blocks=(n + 1) * bpr + 1, heads=8, head_dim=128)
    serve = ["--ucx-error-mode", args.ucx_error_mode, *args.serve_arg]
    with SidecarFactory() as f:
        ps, ds = f.start("bench-p", *serve), f.start("bench-d", *serve)
        p = SyntheticEngine(layout, ps.endpoint, seed=1, device=args.device)
        d = SyntheticEngine(layout, ds.endpoint, seed=2, device=args.device)
        try:
            reg = p.start()
            d.start()
            reqs = {f"r{i}": (p.allocate(bpr), d.allocate(bpr)) for i in range(n + 1)}
            for name, (pb, _) in reqs.items():
                p.fill(name, pb)
                p.client.hold(name, pb)

            def post(name: str) -> None:
                pb, db = reqs[name]
                d.client.recv(name, db, RemoteBlocks(reg.engine_id, reg.handshake_host,
                                                     reg.handshake_port, pb))

            t = time.perf_counter()
            post("r0")
            warm = _collect(d, 1, 60)
            cold_ms = (time.perf_counter() - t) * 1e3
            t0 = time.perf_counter()
            for i in range(1, n + 1):
                post(f"r{i}")
            got = _collect(d, n, 300)
            seconds = time.perf_counter() - t0
            ok = not warm.failed and not got.failed and len(got.done) == n
            verified = ok and all(d.verify(k, db) for k, (_, db) in reqs.items())
            nbytes = sum(x.nbytes for x in got.done)
            res = {
                "device": args.device, "ucx_error_mode": args.ucx_error_mode, "requests": n,
                "request_bytes": nbytes // max(1, len(got.done)), "bytes": nbytes,
                "seconds": round(seconds, 6), "gbps": round(nbytes / seconds / 1e9, 3),
                "first_transfer_ms_cold": round(cold_ms, 3), "verified": verified,
                "failed": [f"{x.req_id}: {x.code} {x.reason}" for x in warm.failed + got.failed][:5],
            }
        finally:
            p.close()
            d.close()
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>24}: {v}")
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
