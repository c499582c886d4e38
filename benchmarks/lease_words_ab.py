"""#38 A/B: the fixed cost of a warm one-block read proved by its lease word, and by its
claim's answer alone, same decode sidecar and engine (on a ring), interleaved.

Two prefill sidecars, one with lease words (the default, ``--lease-word-slots 65536``) and
one without (``0``: every read waits for its claim's answer); one decode sidecar reads from
both. Each round times ``--n`` reads from each (``bench_measure._fixed_cost``: held with a
token, the generation named, as the connector does; minus raw NIXL's median of the same
block), alternating which goes first. Prints per-round p50s, their medians and hop medians.

    .venv/bin/python benchmarks/lease_words_ab.py [--rounds 6] [--n 20] [--json out.json]
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

MODES = {"words": ("--lease-word-slots", "65536"), "claim": ("--lease-word-slots", "0")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    lay = _layout(8)
    out: dict[str, Any] = {"rounds": [], "n": args.n}
    with SidecarFactory() as f:
        ds = f.start("lw-ab-d")
        d = SyntheticEngine(lay, ds.endpoint, seed=2)
        ps = {m: SyntheticEngine(lay, f.start(f"lw-ab-{m}", *flags).endpoint, seed=1)
              for m, flags in MODES.items()}
        raw = None
        try:
            d.start()
            regs = {m: p.start() for m, p in ps.items()}
            pbs = {m: p.allocate(6) for m, p in ps.items()}
            for m, p in ps.items():
                p.fill("ab", pbs[m])
                d.client.recv(f"warm-{m}", [], RemoteBlocks(regs[m].engine_id, regs[m].handshake_host,
                                                            regs[m].handshake_port, []))
                _wait(d, 1)
            db = d.allocate(6)
            raw = RawNixl(ps["words"].kv, d.kv, "peer", 2)
            for r in range(args.rounds):
                order = ("words", "claim") if r % 2 == 0 else ("claim", "words")
                row = {m: _fixed_cost(ps[m], d, raw, regs[m], pbs[m], db, args.n) for m in order}
                out["rounds"].append(row)
                print(ab_round_line(r, row), flush=True)
        finally:
            if raw is not None:
                raw.close()
            d.close()
            for p in ps.values():
                p.close()
    out.update(ab_summary(out["rounds"], MODES))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
