"""``kvxfer demo``: a prefill and a decode sidecar (``kvxfer serve`` processes) with a
synthetic engine process each, moving KV blocks over NIXL and checking every byte.

Phases: start everything; the prefill engine fills and holds all requests (the decode
side gets their kv_transfer_params over a pipe, as a router would forward them); one
warm-up request pays the handshake; the decode engine then posts every receive at once
and the clock runs from the first ``Recv`` to the last ``Done``; every received byte is
verified; the prefill engine waits until every hold is released by a read notice.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvxfer.client import RemoteBlocks
from kvxfer.memory import region_block_len
from kvxfer.protocol import KVLayout
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 64
    layers: int = 32
    blocks_per_request: int = 8
    block_size: int = 16
    heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    prefill_tp: int = 1
    decode_tp: int = 1
    lease_s: float = 60.0
    timeout_s: float = 300.0
    ucx_error_mode: str = "peer"
    extra_serve_args: tuple[str, ...] = field(default=())

    def layout(self, tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
        return make_layout(
            layers=self.layers,
            num_blocks=self.requests * self.blocks_per_request + 2,  # + null + warm-up block
            block_size=self.block_size,
            heads=self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def request_bytes(self) -> int:
        lay = self.layout()
        return lay.num_regions * region_block_len(lay) * self.blocks_per_request


def _prefill_main(opts: DemoOptions, endpoint: str, to_decode: Any, results: Any) -> None:
    eng = SyntheticEngine(opts.layout(), endpoint, seed=1)
    try:
        reg = eng.start()
        params = []
        t0 = time.perf_counter()
        names = ["warmup"] + [f"req-{i}" for i in range(opts.requests)]
        for name in names:
            blocks = eng.allocate(1 if name == "warmup" else opts.blocks_per_request)
            eng.fill(name, blocks)
            eng.client.hold(name, blocks, lease_s=opts.lease_s)
            params.append(
                {"req_id": name, "engine_id": reg.engine_id, "host": reg.handshake_host,
                 "port": reg.handshake_port, "block_ids": blocks, "tp_size": opts.prefill_tp}
            )
        fill_s = time.perf_counter() - t0
        to_decode.send(params)
        reasons: dict[str, int] = {}
        errors: list[str] = []
        deadline = time.monotonic() + opts.timeout_s
        while sum(reasons.values()) < len(names) and time.monotonic() < deadline:
            ev = eng.client.wait(0.5)
            for r in ev.released:
                reasons[r.reason] = reasons.get(r.reason, 0) + 1
            errors += [f"{e.code}: {e.message}" for e in ev.errors]
        results.put({"role": "prefill", "released": reasons, "errors": errors, "fill_s": fill_s})
    except BaseException as e:
        results.put({"role": "prefill", "fatal": repr(e)})
    finally:
        eng.close()


def _decode_main(opts: DemoOptions, endpoint: str, from_prefill: Any, results: Any) -> None:
    eng = SyntheticEngine(opts.layout(), endpoint, seed=2)
    try:
        eng.start()
        params = from_prefill.recv()
        local: dict[str, list[int]] = {}

        def post(p: dict[str, Any]) -> None:
            blocks = eng.allocate(len(p["block_ids"]))
            local[p["req_id"]] = blocks
            remote = RemoteBlocks(p["engine_id"], p["host"], p["port"], p["block_ids"], p["tp_size"])
            eng.client.recv(p["req_id"], blocks, remote, deadline_s=opts.timeout_s)

        def collect(n: int) -> tuple[dict[str, float], dict[str, str]]:
            done: dict[str, float] = {}
            failed: dict[str, str] = {}
            deadline = time.monotonic() + opts.timeout_s
            while len(done) + len(failed) < n and time.monotonic() < deadline:
                ev = eng.client.wait(0.5)
                now = time.perf_counter()
                done.update({d.req_id: now for d in ev.done})
                failed.update({f.req_id: f"{f.code}: {f.reason}" for f in ev.failed})
                failed.update({e.req_id or "?": f"{e.code}: {e.message}" for e in ev.errors})
            return done, failed

        t_cold = time.perf_counter()
        post(params[0])
        done, failed = collect(1)
        cold_ms = (time.perf_counter() - t_cold) * 1e3
        t0 = time.perf_counter()
        for p in params[1:]:
            post(p)
        d2, f2 = collect(len(params) - 1)
        done.update(d2)
        failed.update(f2)
        seconds = (max(d2.values()) - t0) if d2 else 0.0
        bad = [r for r in done if not eng.verify(r, local[r])]
        results.put({
            "role": "decode", "done": len(d2), "failed": failed, "bad": bad,
            "verified_requests": len(done) - len(bad), "seconds": seconds,
            "first_transfer_ms_cold": cold_ms,
        })
    except BaseException as e:
        results.put({"role": "decode", "fatal": repr(e)})
    finally:
        eng.close()


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Run the whole pipeline; returns the summary (``verified`` tells if every byte matched)."""
    if opts.prefill_tp != 1 or opts.decode_tp != 1:
        raise ValueError("heterogeneous / multi-rank TP demo arrives with the TP mapping")
    serve_args = ("--handshake-host", "127.0.0.1", "--lease-s", str(opts.lease_s),
                  "--ucx-error-mode", opts.ucx_error_mode, *opts.extra_serve_args)
    ctx = mp.get_context("spawn")
    engines: list[Any] = []
    factory = SidecarFactory()
    try:
        sidecars = [factory.start(name, *serve_args) for name in ("prefill", "decode")]
        results = ctx.Queue()
        p_conn, d_conn = ctx.Pipe()
        engines = [
            ctx.Process(target=_prefill_main, args=(opts, sidecars[0].endpoint, p_conn, results)),
            ctx.Process(target=_decode_main, args=(opts, sidecars[1].endpoint, d_conn, results)),
        ]
        for e in engines:
            e.start()
        got: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + opts.timeout_s + 60
        while len(got) < 2 and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                r = results.get(timeout=1.0)
                got[r["role"]] = r
            if any(sc.proc.poll() is not None for sc in sidecars):
                break
        return _summarise(opts, got, sidecars)
    finally:
        for e in engines:
            e.join(10)
            if e.is_alive():
                e.kill()
        factory.close()


def _summarise(
    opts: DemoOptions, got: dict[str, dict[str, Any]], sidecars: list[SidecarProc]
) -> dict[str, Any]:
    pre, dec = got.get("prefill", {}), got.get("decode", {})
    nbytes = opts.request_bytes() * int(dec.get("done", 0))
    seconds = float(dec.get("seconds", 0.0))
    problems: list[str] = []
    for role, r in (("prefill", pre), ("decode", dec)):
        if not r:
            problems.append(f"{role} engine reported nothing")
        elif "fatal" in r:
            problems.append(f"{role} engine died: {r['fatal']}")
    problems += [f"request {k} failed: {v}" for k, v in dec.get("failed", {}).items()]
    problems += [f"request {k}: bytes differ" for k in dec.get("bad", [])]
    problems += [f"prefill error: {e}" for e in pre.get("errors", [])]
    released = pre.get("released", {})
    if released.get("read", 0) != opts.requests + 1:
        problems.append(f"prefill holds released by read: {released} (want {opts.requests + 1})")
    for sc in sidecars:
        if sc.proc.poll() is not None:
            problems.append(f"{sc.name} sidecar exited early with {sc.proc.returncode}")
    if problems:
        for sc in sidecars:
            if os.path.exists(sc.log_path):
                problems.append(f"{sc.name} sidecar log tail: " + sc.log()[-2000:])
    verified = not problems and dec.get("verified_requests") == opts.requests + 1
    return {
        "verified": verified,
        "requests": int(dec.get("done", 0)),
        "bytes": nbytes,
        "seconds": round(seconds, 6),
        "gbps": round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
        "prefill_tp": opts.prefill_tp,
        "decode_tp": opts.decode_tp,
        "first_transfer_ms_cold": round(float(dec.get("first_transfer_ms_cold", 0.0)), 3),
        "released": released,
        "request_bytes": opts.request_bytes(),
        "options": {k: v for k, v in asdict(opts).items() if k != "extra_serve_args"},
        "problems": problems,
    }
