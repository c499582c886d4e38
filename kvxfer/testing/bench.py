"""``kvxfer bench``: kvxfer against raw NIXL and against memcpy, side by side, one run.

Every size is measured by the three methods in turn, repeat after repeat, so drift hits
all of them alike:

* **kvxfer** — engine -> sidecar -> NIXL -> sidecar -> engine: the decode engine sends
  ``Recv`` and the clock stops when ``Done`` arrives (two real ``kvxfer serve`` processes).
* **raw NIXL** — what an in-engine connector does: this process's agent READs the same
  descriptors (strided lists, same block ids) from a second process's agent that maps the
  prefill engine's memory, in one transfer, polling until done. Both agents are configured
  as the sidecars are (progress thread off, ``--nixl-threads``), so the ratio is the cost
  (or gain) of the sidecar alone. (The sidecar splits large reads into chunks in flight at
  once, which UCX's worker threads copy in parallel; one raw request runs on one.)
* **memcpy** — a gather/scatter copy of exactly those blocks inside one process: the
  machine's limit for this access pattern.

Plus: the per-step cost of the connector's calls with 0/16/256 requests in flight, time
to first transfer with a cold and a warm peer, 1..64 concurrent requests, 1..4 decode
engines pulling from one prefill, descriptor preparation for 10k/100k blocks, and what an
integrity check (``--verify-sample``) adds to a verified receive. The sidecars of the main
comparison run with ``--verify-sample 0``; the verification cost is measured apart, with
two decode sidecars (verifying every read, and never) pulling alternately from one prefill.

``--device`` picks where the KV caches live: ``cpu`` (shared host memory), ``cuda[:N]``
(VRAM, registered with the sidecars over CUDA IPC; the raw-NIXL target opens the same IPC
handle, memcpy is a gather/scatter on the GPU), or ``auto`` (the GPU when torch sees one).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from typing import Any

import msgspec
import numpy as np

from kvxfer.client import Drained, RemoteBlocks
from kvxfer.config import Config
from kvxfer.memory import CudaKV, SharedKV
from kvxfer.protocol import Done, KVLayout
from kvxfer.sidecar.nixl_agent import create_agent
from kvxfer.sidecar.plan import desc_indices, merge_rows, strided_rows
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory

BLOCK_BYTES = 2 << 20  # 32 layers x K/V x 16 tokens x 8 heads x 128 x bf16


BENCH_LAYOUTS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")  # vLLM's names: BL... = block-outermost


def _layout(num_blocks: int, kv_layout: str = "LBNHC") -> KVLayout:
    return make_layout(layers=32, num_blocks=num_blocks, block_size=16, heads=8, head_dim=128,
                       head_layout="HND" if "HN" in kv_layout else "NHD")


def _raw_target(ref: bytes, mode: str, threads: int, conn: Any) -> None:
    """The prefill side of raw NIXL: open the engine's memory (the shm file or the CUDA IPC
    handle the sidecar gets), register it, make progress until told to stop."""
    import msgspec

    from kvxfer.protocol import MemoryRef
    from kvxfer.sidecar.mapping import map_memory

    if isinstance(ref, str):  # a pool: the parent's memfd, opened through /proc
        from kvxfer.memchannel import map_fd
        from kvxfer.sidecar.mapping import host_mapping

        fd = os.open(ref, os.O_RDWR)
        try:
            m = host_mapping(map_fd(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    else:
        m = map_memory(msgspec.msgpack.decode(ref, type=MemoryRef))  # type: ignore[arg-type]
    agent = create_agent("raw-target", mode, threads)
    agent.register_memory([(m.addr, m.size, m.device_id, "")], m.mem_type)
    conn.send((bytes(agent.get_agent_metadata()), m.addr, m.device_id, m.mem_type))
    while not conn.poll(0.001):
        agent.get_new_notifs()  # the target of a READ must progress in UCX peer mode
    conn.recv()


def _local_memory(kv: SharedKV | CudaKV) -> tuple[int, int, str]:
    """(address, device id, NIXL memory type) of a KV cache this process owns."""
    if isinstance(kv, SharedKV):
        return int(kv.data.ctypes.data), 0, "DRAM"
    return int(kv.tensor.data_ptr()), int(kv.tensor.device.index or 0), "VRAM"


class RawNixl:
    def __init__(self, src: SharedKV | CudaKV, dst: SharedKV | CudaKV, mode: str, threads: int = 0) -> None:
        import msgspec

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        (ref,) = src.register_message().memory
        pool = getattr(src, "pool", None)
        arg: bytes | str = (f"/proc/{os.getpid()}/fd/{pool.fd}" if pool is not None
                            else msgspec.msgpack.encode(ref))
        self.proc = ctx.Process(target=_raw_target, args=(arg, mode, threads, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError(f"the raw NIXL target did not start (exit code {self.proc.exitcode})")
        md, remote_addr, remote_dev, mem_type = self.conn.recv()
        self.agent = create_agent("raw-init", mode, threads)
        local_addr, local_dev, local_type = _local_memory(dst)
        self.agent.register_memory([(local_addr, dst.nbytes, local_dev, "")], local_type)
        name = self.agent.add_remote_agent(md)
        name = name.decode() if isinstance(name, bytes) else name
        lay = dst.layout
        reg = dst.register_message().regions
        from kvxfer.protocol import RemoteRegion

        def rows(base: int, dev: int) -> list[RemoteRegion]:
            return [RemoteRegion(addr=base + r.offset, block_len=r.block_len, block_stride=r.block_stride,
                                 device_id=dev) for r in reg]

        # the rows the sidecar reads (regions touching inside a block merged: same descriptors)
        pairs = zip(rows(local_addr, local_dev), rows(remote_addr, remote_dev), strict=True)
        merged = merge_rows(list(pairs))
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", strided_rows([a for a, _ in merged], lay.num_blocks), local_type)
        self.remote = self.agent.prep_xfer_dlist(name, strided_rows([b for _, b in merged], lay.num_blocks),
                                                 mem_type)
        self.regions = np.arange(len(merged))
        self.nb = lay.num_blocks

    def read(self, src_blocks: list[int], dst_blocks: list[int]) -> float:
        li = desc_indices(self.regions, self.nb, np.asarray(dst_blocks))
        ri = desc_indices(self.regions, self.nb, np.asarray(src_blocks))
        t0 = time.perf_counter()
        h = self.agent.make_prepped_xfer("READ", self.local, li, self.remote, ri)
        state = self.agent.transfer(h)
        while state == "PROC":
            time.sleep(20e-6)
            state = self.agent.check_xfer_state(h)
        took = time.perf_counter() - t0
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read ended in {state}")
        return took

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)


def _memcpy(src: SharedKV | CudaKV, dst: SharedKV | CudaKV, src_blocks: list[int],
            dst_blocks: list[int]) -> float:
    s, d = src.blocks(), dst.blocks()
    if isinstance(src, CudaKV):  # one gather/scatter kernel pair on the GPU
        import torch

        si = torch.tensor(src_blocks, device=s.device)
        di = torch.tensor(dst_blocks, device=d.device)
        torch.cuda.synchronize(s.device)
        t0 = time.perf_counter()
        d[:, :, di] = s[:, :, si]
        torch.cuda.synchronize(s.device)
        return time.perf_counter() - t0
    if isinstance(src, SharedKV) and src.block_outer and isinstance(dst, SharedKV) and dst.block_outer:
        lay = src.layout  # a block of every layer is one run: copy it as one
        n = lay.num_regions * lay.region_block_len
        s = src.data[:n * lay.num_blocks].reshape(lay.num_blocks, n)
        d = dst.data[:n * lay.num_blocks].reshape(lay.num_blocks, n)
    t0 = time.perf_counter()
    for a, b in zip(src_blocks, dst_blocks, strict=True):
        d[..., b, :] = s[..., a, :]
    return time.perf_counter() - t0


def resolve_device(device: str) -> str:
    """``auto``: the first GPU when torch sees one, else ``cpu``."""
    if device != "auto":
        return device
    try:
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


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
    p.client.hold(name, pb, lease_s=120)
    t0 = time.monotonic_ns()
    d.client.recv(name, db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb,
                                         generation=generation), trace=trace)
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


def run_bench(quick: bool = False, mode: str = "peer", device: str = "cpu",
              nixl_threads: int = Config.nixl_threads, kv_layout: str = "LBNHC") -> dict[str, Any]:
    device = resolve_device(device)
    cuda = device.startswith("cuda")
    if cuda:  # as the sidecar does with --cuda: UCX must not classify IPC-imported VRAM as host
        os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    sizes = [1, 8, 32] if quick else [1, 8, 32, 128, 256]
    repeats = 3 if quick else 5
    nb = max(sizes) * 2 + 2
    if kv_layout not in BENCH_LAYOUTS:
        raise ValueError(f"--kv-layout must be one of {', '.join(BENCH_LAYOUTS)}, not {kv_layout!r}")
    outer = kv_layout.startswith("BL")
    if outer and cuda:
        raise ValueError("block-outermost layouts are benchmarked in host memory only")
    lay = _layout(nb, kv_layout)
    out: dict[str, Any] = {"machine": _machine(device), "ucx_error_mode": mode, "nixl_threads": nixl_threads,
                           "quick": quick, "kv_layout": kv_layout,
                           "device": device, "memory": "VRAM (CUDA IPC)" if cuda else "shared host memory",
                           "layout": f"{kv_layout}: 32 layers x K/V x 16 tokens x 8 heads x 128 x bf16 "
                                     "(2 MiB/block, " + ("one 2 MiB run per block" if outer
                                                         else "32 KiB descriptors")
                                     + "), random non-contiguous blocks"}
    base = ["--ucx-error-mode", mode, "--cuda", "on" if cuda else "off", "--nixl-threads", str(nixl_threads)]
    serve = [*base, "--verify-sample", "0"]
    with SidecarFactory() as f:
        ps, ds = f.start("bench-p", *serve), f.start("bench-d", *serve)
        p = SyntheticEngine(lay, ps.endpoint, seed=1, device=device, block_outer=outer)
        d = SyntheticEngine(lay, ds.endpoint, seed=2, device=device, block_outer=outer)
        raw = None
        try:
            reg = p.start()
            d.start()
            rem = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, [])
            pb_all, db_all = p.allocate(nb - 2), d.allocate(nb - 2)  # shuffled: non-contiguous
            p.fill("bench", pb_all)
            raw = RawNixl(p.kv, d.kv, mode, nixl_threads)
            d.client.recv("warmup", [], rem)
            _wait(d, 1)
            rows = []
            for n in sizes:
                pb, db = pb_all[:n], db_all[:n]
                t: dict[str, list[float]] = {"kvxfer": [], "raw_nixl": [], "memcpy": []}
                descs = 0
                for r in range(repeats):
                    took, done = _timed_read(p, d, reg, f"s{n}-{r}", pb, db)
                    descs = done.descriptors
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
                rows.append(row)
            out["sizes"] = rows
            out["fixed_cost_us"] = _fixed_cost(p, d, raw, reg, pb_all, db_all, 10 if quick else 40)
            out["fixed_cost_us_p50"] = out["fixed_cost_us"]["p50"]
            out["first_transfer_ms_cold"], out["first_transfer_ms_warm"] = _first_transfer(
                ds.control, d, p, rem, pb_all, db_all)
            out["concurrency"] = _concurrency(p, d, reg, pb_all, db_all, [1, 8] if quick else [1, 8, 32, 64])
        finally:
            if raw is not None:
                raw.close()
            p.close()
            d.close()
        if not cuda:
            out["layouts"] = _layouts(f, serve, 3 if quick else 5)
        out["step_overhead"] = _step_overhead(f, [0, 16] if quick else [0, 16, 256])
        out["fan_in"] = _fan_in(f, [1, 2] if quick else [1, 2, 4], serve, device)
        out["verify_cost"] = _verify_cost(f, [1, 8] if quick else [1, 8, 32], 3 if quick else 7, base,
                                          device)
    out["descriptor_prep_ms"] = _desc_prep([10_000] if quick else [10_000, 100_000], mode)
    large = [r for r in out["sizes"] if r["bytes"] >= 16 << 20]
    huge = [r for r in out["sizes"] if r["bytes"] >= 256 << 20] or out["sizes"][-1:]
    out["throughput_ratio_vs_raw_nixl"] = statistics.median(r["ratio_vs_raw_nixl"] for r in large)
    out["throughput_ratio_vs_memcpy"] = statistics.median(r["ratio_vs_memcpy"] for r in huge)
    top = out["step_overhead"][-1]
    out["step_overhead_us_p50"], out["step_overhead_us_p99"] = top["p50_us"], top["p99_us"]
    return out


def _fixed_cost(p: SyntheticEngine, d: SyntheticEngine, raw: RawNixl, reg: Any, pb_all: list[int],
                db_all: list[int], n: int) -> dict[str, Any]:
    """What kvxfer adds to a warm one-block read: kvxfer's read (engine -> sidecar -> NIXL ->
    sidecar -> engine) and raw NIXL's of the same block, alternated ``n`` times; p50 and p90
    of kvxfer's times minus raw NIXL's median."""
    ks, rs, traces = [], [], []
    for i in range(n):
        took, done = _timed_read(p, d, reg, f"fixed-{i}", pb_all[:1], db_all[:1], trace=True)
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


def _check(p: SyntheticEngine, d: SyntheticEngine, pb: list[int], db: list[int], what: str) -> None:
    src, dst = p.kv.blocks()[:, :, pb], d.kv.blocks()[:, :, db]
    same = np.array_equal(src, dst) if isinstance(src, np.ndarray) else bool((src == dst).all().item())
    if not same:
        raise RuntimeError(f"{what}: received bytes differ")


def _first_transfer(control: str, d: SyntheticEngine, p: SyntheticEngine, rem: RemoteBlocks,
                    pb_all: list[int], db_all: list[int]) -> tuple[float, float]:
    """One block with a cold peer (handshake included) and right after (warm), 5 times."""
    import grpc

    from kvxfer.control.v1 import control_pb2 as pb
    from kvxfer.control.v1 import control_pb2_grpc as pb_grpc

    from_d = pb_grpc.ControlStub(grpc.insecure_channel(control))
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
    for n in levels:
        n = min(n, len(pb_all) // per)
        names = [f"c{n}-{i}" for i in range(n)]
        for i, name in enumerate(names):
            p.client.hold(name, pb_all[i * per:(i + 1) * per], lease_s=120)
        t0 = time.perf_counter()
        for i, name in enumerate(names):
            d.client.recv(name, db_all[i * per:(i + 1) * per],
                          RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port,
                                       pb_all[i * per:(i + 1) * per]))
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
        for n in engines:
            t0 = time.perf_counter()
            for k, (d, dbs) in enumerate(decs[:n]):
                for j in range(reqs):
                    src = pbs[(k * reqs + j) * per:(k * reqs + j + 1) * per]
                    name = f"fan{n}-{k}-{j}"
                    p.client.hold(name, src, lease_s=120)
                    d.client.recv(name, dbs[j * per:(j + 1) * per],
                                  RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, src))
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


def _machine(device: str = "cpu") -> dict[str, Any]:
    import importlib.metadata as md

    def ver(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "-"

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
           "nixl": ver("nixl-cu12") if ver("nixl-cu12") != "-" else ver("nixl-cu13"),
           "kvxfer": ver("kvxfer"), "numpy": np.__version__, "torch": ver("torch")}
    if device.startswith("cuda"):
        import torch

        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def print_table(res: dict[str, Any]) -> None:
    where = res["machine"].get("gpu") or f"{res['machine']['cpu']}, {res['machine']['cores']} cores"
    print(f"kvxfer bench ({'quick' if res['quick'] else 'full'}, UCX {res['ucx_error_mode']} mode, "
          f"{res['nixl_threads']} NIXL threads, "
          f"{res.get('memory', 'shared host memory')}) on {where}; {res['layout']}")
    print(f"  {'size':>9} {'descs':>7} {'kvxfer':>10} {'raw NIXL':>10} {'memcpy':>10} {'vs raw':>7} "
          f"{'vs memcpy':>9}")
    for r in res["sizes"]:
        print(f"  {r['bytes'] / (1 << 20):>6.0f} MiB {r['descriptors']:>7} {r['kvxfer_gbps']:>6.2f} GB/s "
              f"{r['raw_nixl_gbps']:>6.2f} GB/s {r['memcpy_gbps']:>6.2f} GB/s {r['ratio_vs_raw_nixl']:>7.2f} "
              f"{r['ratio_vs_memcpy']:>9.2f}")
    print("  step overhead: " + ", ".join(
        f"{s['inflight']} in flight p50 {s['p50_us']} us p99 {s['p99_us']} us" for s in res["step_overhead"]))
    print(f"  first transfer (1 block): cold {res['first_transfer_ms_cold']} ms, "
          f"warm {res['first_transfer_ms_warm']} ms")
    fc = res["fixed_cost_us"]
    print(f"  fixed cost (warm 1-block read minus raw NIXL's, n={fc['n']}): p50 {fc['p50']} us, "
          f"p90 {fc['p90']} us (kvxfer {fc['kvxfer_p50_us']} us, raw NIXL {fc['raw_nixl_p50_us']} us)")
    if fc.get("hops_us"):
        print("    per hop, p50 us: " + ", ".join(f"{k} {v}" for k, v in fc["hops_us"].items()))
    for x in res.get("layouts", []):
        print(f"  layout {x['kv_layout']}, {x['block_ids']} block ids, 16 MiB: {x['descriptors']} "
              f"descriptors ({x['descriptors_unmerged']} unmerged), kvxfer {x['kvxfer_gbps']} GB/s, memcpy "
              f"{x['memcpy_gbps']} GB/s ({x['ratio_vs_memcpy']})")
    print("  concurrency (16 MiB each): " + ", ".join(
        f"{c['concurrent']}: {c['gbps']} GB/s" for c in res["concurrency"]))
    print("  decode engines pulling from one prefill: " + ", ".join(f"{c['decode_engines']}: {c['gbps']} GB/s"
                                                                    for c in res["fan_in"]))
    print("  integrity check (--verify-sample) per verified receive: " + ", ".join(
        f"{v['bytes'] / (1 << 20):.0f} MiB +{v['cost_ms']} ms ({v['cost_pct']}%)"
        for v in res["verify_cost"]))
    print("  descriptor prep: " + ", ".join(
        f"{x['blocks']} blocks ({x['descriptors']} descs): dlist {x['prep_dlist_ms']} ms, "
        f"make_prepped_xfer {x['make_prepped_xfer_ms']} ms" for x in res["descriptor_prep_ms"]))


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    mib = [r["bytes"] / (1 << 20) for r in res["sizes"]]
    for key, label in (("kvxfer_gbps", "kvxfer (sidecar)"), ("raw_nixl_gbps", "raw NIXL (in-engine)"),
                       ("memcpy_gbps", "memcpy (same blocks)")):
        a.plot(mib, [r[key] for r in res["sizes"]], marker="o", label=label)
    a.set_xscale("log", base=2)
    a.set_xlabel("request size (MiB)")
    a.set_ylabel("GB/s")
    a.set_title("Throughput vs request size")
    a.grid(alpha=0.3)
    a.legend()
    c = res["concurrency"]
    b.bar([str(x["concurrent"]) for x in c], [x["gbps"] for x in c])
    b.set_xlabel("concurrent 16 MiB requests")
    b.set_ylabel("GB/s")
    b.set_title(f"Concurrency; step overhead p50 {res['step_overhead_us_p50']} us")
    where = res["machine"].get("gpu") or f"{res['machine']['cpu']} ({res['machine']['cores']} cores)"
    fig.suptitle(f"kvxfer bench on {where}, {res.get('memory', 'shared host memory')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: Any) -> int:
    res = run_bench(quick=args.quick, mode=args.ucx_error_mode, device=args.device,
                    nixl_threads=args.nixl_threads, kv_layout=args.kv_layout)
    print_table(res)
    if args.plot:
        plot(res, args.plot)
        print(f"  plot: {args.plot}")
    if args.json:
        print(json.dumps(res))
    return 0
