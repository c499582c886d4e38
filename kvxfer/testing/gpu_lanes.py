"""The ``lanes`` stage's process of ``make gpu-check`` (``kvxfer.testing.gpu_check``), one
per memory kind: one READ and one WRITE between two processes holding that kind of memory
(``gpu_pair.Pair``), both verified, run with ``UCX_PROTO_INFO=y`` so that UCX prints the
lane it chose for each; and the parser of what UCX printed (``parse_proto_info``).

    python -m kvxfer.testing.gpu_lanes lanes-one KIND [--device cuda:0]

prints ``GPU-CHECK-RESULT {json}`` last (``gpu_bench.stage_lanes`` runs it and reads that
line and UCX's tables from its output).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from kvxfer.testing.gpu_pair import Pair
from kvxfer.testing.gpu_xfer import BLOCK, Unavailable, block_ids


def lanes_one(kind: str, device: str, mode: str) -> dict[str, Any]:
    """One READ and one WRITE between two processes holding ``kind`` memory, both verified
    (run with UCX_PROTO_INFO=y: UCX prints the lane it chose for each)."""
    nb = 34
    s, d = block_ids(nb, 1)[:4], block_ids(nb, 2)[:4]
    big_s, big_d = block_ids(nb, 1)[:32], block_ids(nb, 2)[:32]
    with Pair(kind, nb, device=device, mode=mode) as pair:
        pair.target("fill", 1)
        pair.initiator("fill", 2)
        t_read = pair.initiator("xfer", "READ", "LBNHC", s, d)
        bad_read = pair.initiator("verify", 1, s, d, "LBNHC")
        pair.initiator("fill", 2)  # (the READ landed in some of the blocks written next)
        t_write = pair.initiator("xfer", "WRITE", "LBNHC", s, d)
        bad_write = pair.target("verify", 2, s, d, "LBNHC")
        time.sleep(0.2)  # (UCX prints the WRITE's table from its progress: let it flush)
        # how fast each lane is: 64 MiB of 32 KiB descriptors each way, warm, verified
        speed: dict[str, Any] = {"bytes": len(big_s) * BLOCK}
        pair.target("fill", 1)
        pair.initiator("wipe")
        t = pair.initiator("xfer", "READ", "LBNHC", big_s, big_d)
        speed["read_gbps"] = round(len(big_s) * BLOCK / t / 1e9, 3)
        speed["read_verified"] = pair.initiator("verify", 1, big_s, big_d, "LBNHC") == 0
        pair.initiator("fill", 2)
        t = pair.initiator("xfer", "WRITE", "LBNHC", big_s, big_d)
        speed["write_gbps"] = round(len(big_s) * BLOCK / t / 1e9, 3)
        speed["write_verified"] = pair.target("verify", 2, big_s, big_d, "LBNHC") == 0
        return {"kind": kind, "memory": {"target": pair.hello[0]["info"], "initiator": pair.hello[1]["info"]},
                "read_ms": round(t_read * 1e3, 3), "write_ms": round(t_write * 1e3, 3),
                "read_verified": bad_read == 0 and speed["read_verified"],
                "write_verified": bad_write == 0 and speed["write_verified"], "speed": speed}


_UCX_LINE = re.compile(r"^\[[\d.]+\]\s+\[[^:\]]*:(\d+)\s*:\d+\]\s*(.*)$")
_OP = re.compile(r"remote memory (read|write) by (ucp_\w+\*?(?:\([^)]*\))?)\s*(.*)$")
_TL = re.compile(r"\b([a-z][a-z0-9_]*)/[\w:.-]+")


def parse_proto_info(text: str) -> dict[str, Any]:
    """What UCX_PROTO_INFO=y printed about remote memory reads and writes: per table (one per
    process, operation and memory pair), its title and its rows (size range, protocol,
    lane), and per operation the transports named (``cuda_ipc``, ``cma``, ``tcp``...).

    UCX prints a table as a box, each line prefixed with ``[time] [host:pid:thread]``: lines
    are grouped by pid first, since two processes print at once."""
    by_pid: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = _UCX_LINE.match(line.strip())
        if m and "|" in m.group(2):
            by_pid.setdefault(m.group(1), []).append(m.group(2))
    tables: list[dict[str, Any]] = []
    for pid, lines in by_pid.items():
        cur: dict[str, Any] | None = None
        scope = ""
        for line in lines:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 1:
                op = _OP.search(cells[0])
                if op:
                    cur = {"pid": pid, "scope": scope, "op": op.group(1), "call": op.group(2),
                           "memory": op.group(3), "rows": [], "transports": []}
                    tables.append(cur)
                else:
                    scope, cur = cells[0], None
                continue
            if cur is None or cells[0].lower() == "range":
                continue
            cur["rows"].append(" | ".join(cells)[:200])
            for tl in _TL.findall(cells[-1]):
                if tl not in cur["transports"]:
                    cur["transports"].append(tl)
    unique: dict[str, dict[str, Any]] = {}
    for t in tables:  # (UCX prints a table again for each endpoint configuration)
        unique.setdefault(json.dumps({**t, "pid": ""}, sort_keys=True), t)
    tables = list(unique.values())
    # the lanes of the transfers themselves: the initiator's tables to its peer (not loopback)
    mine = [t for t in tables if "initiator" in t["scope"] and " self " not in f" {t['scope']} "] or tables
    ops: dict[str, list[str]] = {"read": [], "write": []}
    for t in mine:
        for tl in t["transports"]:
            if tl not in ops[t["op"]]:
                ops[t["op"]].append(tl)
    return {"read": ops["read"], "write": ops["write"], "tables": tables[:16]}


def _lanes_main(kind: str, device: str) -> int:
    try:
        one: dict[str, Any] = {"status": "ok", **lanes_one(kind, device, "peer")}
        if not (one["read_verified"] and one["write_verified"]):
            one["status"] = "failed"
            one["reason"] = "bytes differ after the transfer"
    except Unavailable as e:
        one = {"status": "unavailable", "reason": str(e)}
    except Exception as e:
        one = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:3000]}
    print("GPU-CHECK-RESULT " + json.dumps(one), flush=True)
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["lanes-one"])
    ap.add_argument("kind")
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args()
    raise SystemExit(_lanes_main(a.kind, a.device))
