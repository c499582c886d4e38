"""``kvxfer bench``'s measurements, one function each: a size of the main comparison, the fixed
cost, the per-layout runs, the first transfer, concurrency, the connector's step overhead, fan-in,
the integrity check's cost and descriptor preparation."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

from kvxfer.auth import new_token
from kvxfer.client import Drained, RemoteBlocks
from kvxfer.memory import SharedKV
from kvxfer.protocol import Done
from kvxfer.sidecar.nixl_agent import create_agent
from kvxfer.sidecar.plan import desc_indices, strided_rows
from kvxfer.testing.bench_targets import BLOCK_BYTES, RawNixl, _check, _layout, _memcpy
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory


def _wait(eng: SyntheticEngine, n: int, timeout: float = 120) -> Drained:
    acc = eng.client.wait_until(lambda a: len(a.done) + len(a.failed) >= n, timeout)
    if acc.failed or len(acc.done) < n:
        raise RuntimeError(f"kvxfer transfers failed: {acc.failed[:3]}")
    return acc


def _timed_read(p: SyntheticEngine, d: SyntheticEngine, reg: Any, name: str, pb: list[int], db: list[int],
                generation: str = "", trace: bool = False) -> tuple[float, Done]:
    """Hold ``pb`` on the prefill engine, then time the decode engine's read of them into
    ``db`` (Recv sent -> Done received): seconds, and the Done. ``trace``: the Done's trace
    starts with ("engine", Recv sent) and ends with ("engine_done", Done received)."""
    token = new_token()  # (as the connector holds: a token, the engine's deadline, the generation named)
    p.client.hold(name, pb, lease_s=120, token=token, expires_unix=time.time() + 120)
    time.sleep(0.003)  # (the prefill sidecar takes the hold first: in a deployment it is on another
    # host, long before the decode's Recv; on 2 shared cores its work would be timed as the decode's)
    t0 = time.monotonic_ns()
    d.client.recv(name, db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb,
                                         generation=generation, token=token), trace=trace)
    done = _wait(d, 1).done[0]
    t1 = time.monotonic_ns()
    if trace:
        done = msgspec.structs.replace(done, trace=[("engine", t0), *(done.trace or ()), ("engine_done", t1)])
    return (t1 - t0) / 1e9, done


def hop_times(traces: list[list[tuple[str, int]]]) -> dict[str, float]:
    """Median microseconds from the hop before to each hop (keyed by the hop it ends at),
    over every trace that has it; keys in the order they first appear (hops that race, such
    as the claim's answer and the landing, may come in either order)."""
    per: dict[str, list[float]] = {}
    for tr in traces:
        for (_a, t0), (b, t1) in zip(tr, tr[1:], strict=False):
            per.setdefault(b, []).append((t1 - t0) / 1e3)
    return {hop: round(statistics.median(v), 1) for hop, v in per.items()}


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _size_row(p: SyntheticEngine, d: SyntheticEngine, raw: RawNixl, reg: Any, pb: list[int], db: list[int],
              n: int, repeats: int) -> dict[str, Any]:
    """One size of the main comparison: kvxfer, raw NIXL and memcpy of the same ``n`` blocks in
    turn, ``repeats`` times (the first read of each method checked byte for byte)."""
    t: dict[str, list[float]] = {"kvxfer": [], "raw_nixl": [], "memcpy": []}
    descs = 0
    traces = []
    generation = p.client.ping().generation  # (named, as the connector does: the lease word proves the read)
    for r in range(repeats):
        took, done = _timed_read(p, d, reg, f"s{n}-{r}", pb, db, generation, trace=True)
        descs = done.descriptors
        traces.append(done.trace or [])
        t["kvxfer"].append(took)
        if r == 0:
            _check(p, d, pb, db, "kvxfer")
            d.wipe(db)
        t["raw_nixl"].append(raw.read(pb, db))
        if r == 0:
            _check(p, d, pb, db, "raw NIXL")
        t["memcpy"].append(_memcpy(p.kv, d.kv, pb, db))
    nbytes = n * BLOCK_BYTES
    row: dict[str, Any] = {"blocks": n, "bytes": nbytes, "descriptors": descs,
                           "raw_nixl_descriptors": n * len(raw.regions)}
    for k, v in t.items():
        row[f"{k}_gbps"] = round(nbytes / statistics.median(v) / 1e9, 3)
        row[f"{k}_ms"] = {a: round(b * 1e3, 3) if a != "n" else b for a, b in _summary(v).items()}
    row["ratio_vs_raw_nixl"] = round(row["kvxfer_gbps"] / row["raw_nixl_gbps"], 3)
    row["ratio_vs_memcpy"] = round(row["kvxfer_gbps"] / row["memcpy_gbps"], 3)
    row["hops_us"] = hop_times(traces)  # (where a read of this size spends its time, as the fixed cost's)
    return row


def _fixed_cost(p: SyntheticEngine, d: SyntheticEngine, raw: RawNixl, reg: Any, pb_all: list[int],
                db_all: list[int], n: int) -> dict[str, Any]:
    """What kvxfer adds to a warm one-block read: kvxfer's read (engine -> sidecar -> NIXL ->
    sidecar -> engine) and raw NIXL's of the same block, alternated ``n`` times; p50 and p90
    of kvxfer's times minus raw NIXL's median."""
    ks, rs, traces = [], [], []
    generation = p.client.ping().generation  # (named, as the connector's kv_transfer_params do)
    for i in range(n):
        took, done = _timed_read(p, d, reg, f"fixed-{i}", pb_all[:1], db_all[:1], generation, trace=True)
        ks.append(took)
        traces.append(done.trace or [])
        rs.append(raw.read(pb_all[:1], db_all[:1]))
    raw_p50 = statistics.median(rs)
    ks.sort()
    return {"p50": round((statistics.median(ks) - raw_p50) * 1e6, 1),
            "p90": round((ks[int(0.9 * (len(ks) - 1))] - raw_p50) * 1e6, 1),
            "kvxfer_p50_us": round(statistics.median(ks) * 1e6, 1),
            "raw_nixl_p50_us": round(raw_p50 * 1e6, 1), "n": n, "hops_us": hop_times(traces)}


def _layouts(f: SidecarFactory, serve: list[str], repeats: int) -> list[dict[str, Any]]:
    """Descriptors per 16 MiB request (8 blocks) and kvxfer's speed per layout, with random
    block ids and with consecutive ones, next to memcpy of the same blocks."""
    out = []
    ps, ds = f.start("bench-layouts-p", *serve), f.start("bench-layouts-d", *serve)
    for kv_layout in ("LBNHC", "BLHNC"):
        for contiguous in (False, True):
            lay = _layout(2 * 8 + 2, kv_layout)
            outer = kv_layout.startswith("BL")
            p = SyntheticEngine(lay, ps.endpoint, seed=3, block_outer=outer, contiguous=contiguous)
            d = SyntheticEngine(lay, ds.endpoint, seed=4, block_outer=outer, contiguous=contiguous)
            try:
                reg = p.start()
                d.start()
                # (the prefill rank was registered again with another layout: the generation
                # makes the decode sidecar handshake again, as kv_transfer_params do)
                gen = p.client.ping().generation
                pb, db = p.allocate(8), d.allocate(8)
                p.fill("layouts", pb)
                ks, ms, descs = [], [], 0
                for r in range(repeats + 1):  # the first one warms the peer up
                    took, done = _timed_read(p, d, reg, f"lay-{kv_layout}-{contiguous}-{r}", pb, db, gen)
                    descs = done.descriptors
                    if r:
                        ks.append(took)
                        ms.append(_memcpy(p.kv, d.kv, pb, db))  # type: ignore[arg-type]
                _check(p, d, pb, db, f"kvxfer ({kv_layout})")
                nbytes = 8 * BLOCK_BYTES
                kg, mg = nbytes / statistics.median(ks) / 1e9, nbytes / statistics.median(ms) / 1e9
                out.append({"kv_layout": kv_layout, "block_ids": "consecutive" if contiguous else "random",
                            "bytes": nbytes, "descriptors_unmerged": 8 * lay.num_regions,
                            "descriptors": descs,
                            "kvxfer_gbps": round(kg, 3), "memcpy_gbps": round(mg, 3),
                            "ratio_vs_memcpy": round(kg / mg, 3)})
            finally:
                p.close()
                d.close()
    return out


def _first_transfer(control: str, d: SyntheticEngine, p: SyntheticEngine, rem: RemoteBlocks,
                    pb_all: list[int], db_all: list[int]) -> tuple[float, float]:
    """One block with a cold peer (handshake included) and right after (warm), 5 times."""
    from kvxfer.control.local import local_channel
    from kvxfer.control.v1 import control_pb2 as pb
    from kvxfer.control.v1 import control_pb2_grpc as pb_grpc

    from_d = pb_grpc.ControlStub(local_channel(control))
    cold, warm = [], []
    for i in range(5):
        from_d.DisconnectPeer(pb.DisconnectPeerRequest(endpoint=f"{rem.host}:{rem.port}"), timeout=5)
        for bucket in (cold, warm):
            name = f"first-{i}-{len(bucket)}-{id(bucket)}"
            p.client.hold(name, pb_all[:1])
            t0 = time.perf_counter()
            d.client.recv(name, db_all[:1], RemoteBlocks(rem.engine_id, rem.host, rem.port, pb_all[:1]))
            _wait(d, 1)
            bucket.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(cold), 3), round(statistics.median(warm), 3)


def _concurrency(p: SyntheticEngine, d: SyntheticEngine, reg: Any, pb_all: list[int], db_all: list[int],
                 levels: list[int]) -> list[dict[str, Any]]:
    out = []
    per = 8  # 16 MiB requests
    generation = p.client.ping().generation  # (held with tokens and named, as the connector's: lease
    for n in levels:  # words prove the reads; without, each waits for a claim after its landing)
        n = min(n, len(pb_all) // per)
        names = [f"c{n}-{i}" for i in range(n)]
        tokens = [new_token() for _ in names]
        for i, name in enumerate(names):
            p.client.hold(name, pb_all[i * per:(i + 1) * per], lease_s=120, token=tokens[i],
                          expires_unix=time.time() + 120)
        t0 = time.perf_counter()
        for i, name in enumerate(names):
            d.client.recv(name, db_all[i * per:(i + 1) * per],
                          RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port,
                                       pb_all[i * per:(i + 1) * per], generation=generation, token=tokens[i]))
        _wait(d, n)
        took = time.perf_counter() - t0
        out.append({"concurrent": n, "gbps": round(n * per * BLOCK_BYTES / took / 1e9, 3),
                    "seconds": round(took, 4)})
    return out


def _step_overhead(f: SidecarFactory, inflight: list[int]) -> list[dict[str, Any]]:
    """Per-step connector work (metadata build, bind, drain) with N receives in flight."""
    import zmq

    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.connector.settings import ConnectorSettings
    from kvxfer.connector.worker import WorkerSide

    sc = f.start("bench-step", "--transfer-timeout-s", "600", "--handshake-timeout-s", "600")
    eng = SyntheticEngine(make_layout(layers=2, num_blocks=512, heads=2, head_dim=16), sc.endpoint)
    out = []
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # a peer that never answers: reads stay in flight
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        eng.start()
        settings = ConnectorSettings(sidecar=sc.endpoint, transfer_timeout_s=600)
        sched = SchedulerSide(settings, tp_size=1)
        worker = WorkerSide(settings, 0, 1, "cpu")
        worker.client = eng.client  # registered rank 0's connection
        worker._instance = eng.registered.agent_name if eng.registered else ""
        posted = 0

        class Req:
            def __init__(self, i: int) -> None:
                self.request_id = f"step-{i}"
                self.prompt_token_ids = list(range(16))
                self.kv_transfer_params = {"do_remote_prefill": True, "remote_engine_id": "silent",
                                           "remote_host": "127.0.0.1", "remote_port": port,
                                           "remote_block_ids": [1]}

        for n in inflight:
            while posted < n:
                r = Req(posted)
                sched.get_num_new_matched_tokens(r, 0)
                sched.update_state_after_alloc(r, [1 + posted % 500], 16)
                posted += 1
            plan = sched.take_plan()
            worker.bind(plan.recvs, plan.holds)
            samples = []
            for _ in range(3000):
                t0 = time.perf_counter_ns()
                plan = sched.take_plan()  # build_connector_meta
                worker.bind(plan.recvs, plan.holds)  # start_load_kv
                worker.get_transfer_results()  # get_finished; wait_for_save is a no-op
                samples.append((time.perf_counter_ns() - t0) / 1e3)
            samples.sort()
            out.append({"inflight": n, "p50_us": round(samples[len(samples) // 2], 2),
                        "p99_us": round(samples[int(len(samples) * 0.99)], 2)})
        sched.shutdown()
    finally:
        silent.close(0)
        eng.close()
    return out


def _fan_in(f: SidecarFactory, engines: list[int], serve: list[str], device: str) -> list[dict[str, Any]]:
    """1..N decode sidecars pulling 16 MiB requests from one prefill at once."""
    per, reqs = 8, 4
    lay = _layout(max(engines) * reqs * per + 2)
    ps = f.start("fan-p", *serve)
    p = SyntheticEngine(lay, ps.endpoint, seed=1, device=device)
    decs = []
    out = []
    try:
        reg = p.start()
        pbs = p.allocate(max(engines) * reqs * per)
        for i in range(max(engines)):
            ds = f.start(f"fan-d{i}", *serve)
            d = SyntheticEngine(_layout(reqs * per + 2), ds.endpoint, seed=10 + i, device=device)
            d.start()
            decs.append((d, d.allocate(reqs * per)))
            d.client.recv("warm", [], RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, []))
            _wait(d, 1)
        generation = p.client.ping().generation  # (named, with a token: as the connector does)
        for n in engines:
            t0 = time.perf_counter()
            for k, (d, dbs) in enumerate(decs[:n]):
                for j in range(reqs):
                    src = pbs[(k * reqs + j) * per:(k * reqs + j + 1) * per]
                    name, token = f"fan{n}-{k}-{j}", new_token()
                    p.client.hold(name, src, lease_s=120, token=token, expires_unix=time.time() + 120)
                    d.client.recv(name, dbs[j * per:(j + 1) * per],
                                  RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, src,
                                               generation=generation, token=token))
            for d, _ in decs[:n]:
                _wait(d, reqs)
            took = time.perf_counter() - t0
            out.append({"decode_engines": n, "gbps": round(n * reqs * per * BLOCK_BYTES / took / 1e9, 3)})
    finally:
        p.close()
        for d, _ in decs:
            d.close()
    return out


def _verify_cost(f: SidecarFactory, sizes: list[int], repeats: int, base: list[str],
                 device: str) -> list[dict[str, Any]]:
    """Receive time with and without the end-to-end integrity check, per request size: two
    decode sidecars (``--verify-sample 1`` and ``0``) pulling alternately from one prefill."""
    nb = max(sizes) * 2 + 2
    ps = f.start("ver-p", *base)
    p = SyntheticEngine(_layout(nb), ps.endpoint, seed=1, device=device)
    decs: dict[str, tuple[SyntheticEngine, list[int]]] = {}
    out = []
    try:
        reg = p.start()
        pbs = p.allocate(max(sizes))
        p.fill("ver", pbs)
        for name, sample in (("on", "1"), ("off", "0")):
            ds = f.start(f"ver-d-{name}", *base, "--verify-sample", sample)
            d = SyntheticEngine(_layout(nb), ds.endpoint, seed=2, device=device)
            d.start()
            decs[name] = (d, d.allocate(max(sizes)))
            # warm: handshake and the always-verified first read from a new peer
            p.client.hold(f"warm-{name}", pbs[:1], lease_s=120)
            d.client.recv(f"warm-{name}", decs[name][1][:1],
                          RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pbs[:1]))
            _wait(d, 1)
        for n in sizes:
            t: dict[str, list[float]] = {"on": [], "off": []}
            for r in range(repeats):
                for name, (d, dbs) in decs.items():
                    t[name].append(_timed_read(p, d, reg, f"ver{n}-{r}-{name}", pbs[:n], dbs[:n])[0])
            on, off = statistics.median(t["on"]) * 1e3, statistics.median(t["off"]) * 1e3
            out.append({"blocks": n, "bytes": n * BLOCK_BYTES, "off_ms": round(off, 3), "on_ms": round(on, 3),
                        "cost_ms": round(on - off, 3), "cost_pct": round(100 * (on - off) / off, 1)})
        d_on = decs["on"][0]
        if not d_on.verify("ver", decs["on"][1][:max(sizes)]):
            raise RuntimeError("verify-sample bench: received bytes differ")
    finally:
        p.close()
        for d, _ in decs.values():
            d.close()
    return out


def _desc_prep(block_counts: list[int], mode: str) -> list[dict[str, Any]]:
    """prep_xfer_dlist (strided, per registration) and make_prepped_xfer for a whole request."""
    agent = create_agent("prep", mode, 0)
    out = []
    for n in block_counts:
        lay = make_layout(layers=32, num_blocks=n, block_size=1, heads=1, head_dim=16, dtype="uint8")
        kv = SharedKV.create(lay)
        try:
            base = int(kv.data.ctypes.data)
            reg = agent.register_memory([(base, kv.nbytes, 0, "")], "DRAM")
            from kvxfer.protocol import RemoteRegion

            regs = kv.register_message().regions
            rows = strided_rows([RemoteRegion(addr=base + r.offset, block_len=r.block_len,
                                               block_stride=r.block_stride) for r in regs], n)
            t0 = time.perf_counter()
            dl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
            t1 = time.perf_counter()
            loop = agent.prep_xfer_dlist("prep", rows, "DRAM")  # loopback "remote" side
            blocks = np.random.default_rng(0).permutation(n)
            idx = desc_indices(np.arange(len(regs)), n, blocks)
            t2 = time.perf_counter()
            h = agent.make_prepped_xfer("WRITE", dl, idx, loop, idx[::-1].copy())  # not posted
            t3 = time.perf_counter()
            agent.release_xfer_handle(h)
            agent.release_dlist_handle(loop)
            agent.release_dlist_handle(dl)
            agent.deregister_memory(reg)
            out.append({"blocks": n, "descriptors": len(idx), "prep_dlist_ms": round((t1 - t0) * 1e3, 3),
                        "index_build_ms": round((t2 - t1) * 1e3, 3),
                        "make_prepped_xfer_ms": round((t3 - t2) * 1e3, 3)})
        finally:
            kv.close()
    return out


def ab_round_line(r: int, row: dict[str, dict[str, Any]]) -> str:
    """One interleaved A/B round of ``_fixed_cost`` results, arm by arm (benchmarks/*_ab.py)."""
    return f"round {r}: " + ", ".join(f"{arm} fixed p50 {c['p50']} us (kvxfer {c['kvxfer_p50_us']}, raw "
                                      f"{c['raw_nixl_p50_us']})" for arm, c in row.items())


def ab_summary(rounds: list[dict[str, dict[str, Any]]], arms: Iterable[str]) -> dict[str, Any]:
    """Per arm: the median of its rounds' fixed-cost p50s, those p50s, and per-hop medians."""
    out: dict[str, Any] = {}
    for arm in arms:
        p50s = [row[arm]["p50"] for row in rounds]
        hops: dict[str, list[float]] = {}
        for row in rounds:
            for k, v in row[arm]["hops_us"].items():
                hops.setdefault(k, []).append(v)
        out[arm] = {"fixed_p50_median_us": round(statistics.median(p50s), 1), "fixed_p50s_us": p50s,
                    "hops_median_us": {k: round(statistics.median(v), 1) for k, v in hops.items()}}
        print(f"{arm}: fixed cost p50 median {out[arm]['fixed_p50_median_us']} us over {len(p50s)} rounds "
              f"({p50s}); hops {out[arm]['hops_median_us']}")
    return out
