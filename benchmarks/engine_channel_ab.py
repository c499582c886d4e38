"""#38 A/B: the fixed cost of a warm one-block read with the decode engine on an engine ring
and on the ZMQ socket, same sidecars, same prefill, same raw-NIXL baseline, interleaved.

Two decode sidecars, one decode engine on each (one on a ring, one on ZMQ), read from one
prefill sidecar; each round times ``--n`` reads through each (``kvxfer.testing.bench_measure._fixed_cost``:
kvxfer's read minus raw NIXL's median of the same block, alternated), rounds alternating
which channel goes first. Prints the per-round p50s, their medians and the hop trace medians.

    .venv/bin/python benchmarks/engine_channel_ab.py [--rounds 6] [--n 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvxfer.client import RemoteBlocks
from kvxfer.testing.bench_measure import _fixed_cost, _wait, ab_round_line, ab_summary
from kvxfer.testing.bench_targets import RawNixl, _layout
from kvxfer.testing.engine import SyntheticEngine
from kvxfer.testing.procs import SidecarFactory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    lay = _layout(8)
    out: dict[str, Any] = {"rounds": [], "n": args.n}
    with SidecarFactory() as f:
        ps = f.start("ab-p")
        p = SyntheticEngine(lay, ps.endpoint, seed=1, engine_channel="ring")
        ds_ = {ch: SyntheticEngine(lay, f.start(f"ab-{ch}").endpoint, seed=2, engine_channel=ch)
               for ch in ("ring", "zmq")}
        raw = None
        try:
            reg = p.start()
            for d in ds_.values():
                d.start()
            assert ds_["ring"].client.ring is not None, ds_["ring"].client.ring_error
            pb = p.allocate(6)
            p.fill("ab", pb)
            dbs = {ch: d.allocate(6) for ch, d in ds_.items()}
            raw = RawNixl(p.kv, ds_["ring"].kv, "peer", 2)
            rem = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, [])
            for d in ds_.values():
                d.client.recv("warmup", [], rem)
                _wait(d, 1)
            for r in range(args.rounds):
                order = ("ring", "zmq") if r % 2 == 0 else ("zmq", "ring")
                row = {ch: _fixed_cost(p, ds_[ch], raw, reg, pb, dbs[ch], args.n) for ch in order}
                out["rounds"].append(row)
                print(ab_round_line(r, row), flush=True)
        finally:
            if raw is not None:
                raw.close()
            p.close()
            for d in ds_.values():
                d.close()
    out.update(ab_summary(out["rounds"], ("ring", "zmq")))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
