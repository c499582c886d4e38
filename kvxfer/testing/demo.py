"""``kvxfer demo``: a prefill and a decode sidecar (``kvxfer serve`` processes) with a
synthetic engine process each, moving KV blocks over NIXL and checking every byte.

Each engine process holds one KV cache per TP rank, each registered separately over its
own connection, as separate GPUs' workers would, in pools from its sidecar's memory
channel. The pools hold what is in flight at once (``in_flight`` requests and the
warm-up), not every request: blocks are recycled as an engine recycles them. One warm-up
request pays the handshake; then, round by round, the prefill engine fills and holds
``in_flight`` requests (the decode side gets their kv_transfer_params over a pipe, as a
router would forward them), the decode engine posts every rank's receive at once, the
clock runs from the first ``Recv`` to the last ``Done``, every received byte of every rank
is verified, and both sides free the blocks once the prefill's holds are released by read
notices. The throughput is the bytes over the sum of the rounds' ``Recv``→``Done`` times.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvxfer.auth import new_token
from kvxfer.client import RemoteBlocks, SidecarClient
from kvxfer.memchannel import available_memory, gib
from kvxfer.memory import dense_bytes
from kvxfer.protocol import KVLayout
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.kept import KeptSidecars, start_pair
from kvxfer.testing.procs import SidecarFactory, SidecarProc


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 64
    in_flight: int = 32  # requests moved at once; the pools hold these (0: all of them)
    layers: int = 32
    blocks_per_request: int = 8  # in prefill blocks
    block_size: int = 16
    heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    prefill_tp: int = 1
    decode_tp: int = 1
    mla: bool = False
    prefill_block_size: int = 0  # 0: block_size
    decode_block_size: int = 0
    head_layout: str = "NHD"
    # A vLLM backend's KV layout (kvxfer.testing.vllm_layouts.KINDS), allocated as vLLM
    # allocates it and registered through the connector's code; "": kvxfer's dense layout.
    kv_layout: str = ""
    decode_kv_layout: str = ""  # "": the same as kv_layout
    contiguous_blocks: bool = False  # requests get runs of consecutive block ids (else random ones)
    lease_s: float = 60.0
    timeout_s: float = 300.0
    ucx_error_mode: str = "peer"
    extra_serve_args: tuple[str, ...] = field(default=())

    def side_blocks(self, side: str) -> int:
        """Blocks per request on a side (the decode side may use another block size)."""
        tokens = self.blocks_per_request * self.block_size_of("prefill")
        bs = self.block_size_of(side)
        if tokens % bs:
            raise ValueError(f"{tokens} tokens per request do not fill whole {side} blocks of {bs}")
        return tokens // bs

    def block_size_of(self, side: str) -> int:
        size = self.prefill_block_size if side == "prefill" else self.decode_block_size
        return size or self.block_size

    def kv_layout_of(self, side: str) -> str:
        return (self.decode_kv_layout if side == "decode" else "") or self.kv_layout

    @property
    def is_mla(self) -> bool:
        return self.mla or self.kv_layout == "mla"

    @property
    def window(self) -> int:
        """Requests in flight at once (a round)."""
        return max(1, min(self.in_flight or self.requests, self.requests))

    def rounds(self) -> list[range]:
        """The timed requests (1..requests; 0 is the warm-up), ``window`` at a time."""
        w = self.window
        return [range(i, min(i + w, self.requests + 1)) for i in range(1, self.requests + 1, w)]

    def pool_bytes(self, side: str) -> int:
        """KV-pool bytes one side's engine asks its sidecar for (all its TP ranks)."""
        lay = self.layout(side)
        tp = self.prefill_tp if side == "prefill" else self.decode_tp
        return tp * dense_bytes(lay)  # (state regions included, as the engine allocates them)

    def check_memory(self, available: int | None = None) -> None:
        """Refuse, before anything is allocated, pools this machine cannot hold."""
        need = self.pool_bytes("prefill") + self.pool_bytes("decode")
        have = available_memory() if available is None else available
        if need > have:
            per = need / (self.window + 1)  # the pools hold the window and the warm-up
            fits = int(0.75 * have // per) - 1
            hint = (f"--in-flight {fits} fits in three quarters of that" if fits >= 1
                    else "fewer --blocks-per-request or --layers are needed")
            raise MemoryError(
                f"the KV pools need {gib(need)} ({gib(self.pool_bytes('prefill'))} prefill + "
                f"{gib(self.pool_bytes('decode'))} decode for {self.window} requests in flight and "
                f"a warm-up), and this machine has {gib(have)} available (MemAvailable); {hint}")

    def layout(self, side: str, rank: int = 0) -> KVLayout:
        return make_layout(
            layers=self.layers,
            num_blocks=(self.window + 1) * self.side_blocks(side) + 1,  # in flight + warm-up + null
            block_size=self.block_size_of(side),
            heads=self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            tp_rank=rank,
            tp_size=self.prefill_tp if side == "prefill" else self.decode_tp,
            mla=self.is_mla,
            head_layout=self.head_layout,
        )

    def request_bytes(self) -> int:
        """KV bytes of one request as the whole decode engine holds it (all its ranks): K and
        V of every token of every local head (one latent for MLA), whatever the layout."""
        lay = self.layout("decode")
        block = lay.block_size * lay.local_kv_heads * lay.head_dim * lay.itemsize * (1 if self.is_mla else 2)
        return block * lay.num_layers * self.side_blocks("decode") * self.decode_tp


def _engines(opts: DemoOptions, side: str, endpoints: str, seed: int) -> list[SyntheticEngine]:
    tp = opts.prefill_tp if side == "prefill" else opts.decode_tp
    return [SyntheticEngine(opts.layout(side, r), endpoints, seed=seed, kv_layout=opts.kv_layout_of(side),
                            contiguous=opts.contiguous_blocks)
            for r in range(tp)]


def _prefill_main(opts: DemoOptions, endpoint: str, to_decode: Any, results: Any, tag: str = "") -> None:
    engines = _engines(opts, "prefill", endpoint, 1)
    lead = engines[0]
    try:
        for e in engines:
            e.start()
        reg = lead.registered
        assert reg is not None
        # (named in every request, as the connector's kv_transfer_params do: a decode that
        # knows it proves a read by its lease word, with no wait for the claim's answer)
        generation = lead.client.ping().generation
        fill_s = 0.0
        reasons: dict[str, int] = {}
        errors: list[str] = []
        for round_ in [range(0, 1), *opts.rounds()]:  # the warm-up, then the timed rounds
            deadline = time.monotonic() + opts.timeout_s  # (a round's)
            t0 = time.perf_counter()
            params, held = [], {}
            for i in round_:
                name = tag + _req_name(i)
                blocks = lead.allocate(opts.side_blocks("prefill"))  # block ids are engine-wide
                for e in engines:
                    e.fill(name, blocks)
                token = new_token()  # as the connector does: the read and its notices must present it
                lead.client.hold(name, blocks, lease_s=opts.lease_s, token=token)
                held[name] = blocks
                params.append(
                    {"req_id": name, "engine_id": reg.engine_id, "host": reg.handshake_host,
                     "port": reg.handshake_port, "block_ids": blocks, "tp_size": opts.prefill_tp,
                     "token": token, "generation": generation}
                )
            fill_s += time.perf_counter() - t0
            to_decode.send(params)
            while held and time.monotonic() < deadline:  # a block is reused once its hold ends
                ev = lead.client.wait(0.5)
                for r in ev.released:
                    reasons[r.reason] = reasons.get(r.reason, 0) + 1
                    if r.req_id in held:
                        lead.free(held.pop(r.req_id))
                errors += [f"{e.code}: {e.message}" for e in ev.errors]
            if held:
                errors.append(f"holds of {sorted(held)} not released in {opts.timeout_s:.0f} s")
                break
        results.put({"role": "prefill", "released": reasons, "errors": errors, "fill_s": fill_s})
    except BaseException as e:
        results.put({"role": "prefill", "fatal": repr(e)})
    finally:
        for e in engines:
            e.close()


class _Decoder:
    """The decode engine's side of the demo: post a round's receives on every rank, collect
    the ranks' answers, check every byte and give the blocks back."""

    def __init__(self, opts: DemoOptions, engines: list[SyntheticEngine]) -> None:
        self.opts = opts
        self.engines = engines
        self.lead = engines[0]
        self.local: dict[str, list[int]] = {}
        self.stats = {"bytes": 0, "descriptors": 0}

    def post(self, p: dict[str, Any]) -> None:
        blocks = self.lead.allocate(self.opts.side_blocks("decode"))
        self.local[p["req_id"]] = blocks
        remote = RemoteBlocks(p["engine_id"], p["host"], p["port"], p["block_ids"], p["tp_size"],
                              token=p["token"], generation=p["generation"],
                              block_size=self.opts.block_size_of("prefill"))
        for e in self.engines:  # (a read's deadline under the sidecar's --max-read-s, as the
            # connector's default is: a longer one is cut, counted and logged with every read)
            e.client.recv(p["req_id"], blocks, remote, tp_rank=e.layout.tp_rank,
                          deadline_s=min(self.opts.timeout_s, RECV_DEADLINE_S))

    def collect(self, names: list[str]) -> tuple[dict[str, float], dict[str, str]]:
        """A request is done when every rank is done; returns done times and failures."""
        engines, stats = self.engines, self.stats
        ranks_done: dict[str, int] = {}
        done: dict[str, float] = {}
        failed: dict[str, str] = {}
        deadline = time.monotonic() + self.opts.timeout_s
        clients = [e.client for e in engines]
        while len(done) + len(failed) < len(names) and time.monotonic() < deadline:
            # every rank at once: waiting on one rank at a time would see the others' Done
            # only when that wait ends (up to its timeout late, which the clock counted)
            drained = SidecarClient.wait_any(clients, 0.5)
            now = time.perf_counter()
            for e, ev in zip(engines, drained, strict=True):
                for d in ev.done:
                    stats["bytes"] += d.nbytes
                    stats["descriptors"] += d.descriptors
                    ranks_done[d.req_id] = ranks_done.get(d.req_id, 0) + 1
                    if ranks_done[d.req_id] == len(engines):
                        done[d.req_id] = now
                failed.update({f.req_id: f"rank {e.layout.tp_rank}: {f.code}: {f.reason}"
                               for f in ev.failed})
                failed.update({x.req_id or "?": f"{x.code}: {x.message}" for x in ev.errors})
        return done, failed

    def verify_and_free(self, names: list[str]) -> list[str]:
        """Check every byte of every rank, then give the blocks back for the next round."""
        bad = [f"{r} (rank {e.layout.tp_rank})" for r in names for e in self.engines
               if not e.verify(r, self.local[r])]
        for r in names:
            self.lead.free(self.local.pop(r))
        return bad

    def run(self, from_prefill: Any) -> dict[str, Any]:
        """The warm-up, then every timed round, as the prefill sends them; the decode's result."""
        opts, lead, local, stats = self.opts, self.lead, self.local, self.stats
        done: dict[str, float] = {}
        failed: dict[str, str] = {}
        bad: list[str] = []
        verified = seconds = 0.0
        cold_ms = 0.0
        round_seconds: list[float] = []  # each timed round's Recv -> last Done
        for n_round in range(1 + len(opts.rounds())):
            params = from_prefill.recv()
            t0 = time.perf_counter()
            for p in params:
                self.post(p)
            d, f = self.collect([p["req_id"] for p in params])
            if n_round == 0:  # the warm-up pays the handshake; its bytes are not counted
                cold_ms = (time.perf_counter() - t0) * 1e3
                stats.update(bytes=0, descriptors=0)
            else:
                done.update(d)
                round_seconds.append((max(d.values()) - t0) if d else 0.0)
                seconds += round_seconds[-1]
            failed.update(f)
            round_bad = self.verify_and_free(list(d))
            bad += round_bad
            verified += 0 if round_bad else len(d)
            for r in f:  # a failed receive's blocks are the engine's again too
                if r in local:
                    lead.free(local.pop(r))
        return {
            "role": "decode", "done": len(done), "failed": failed, "bad": bad,
            "verified_requests": int(verified) if not bad else 0, "seconds": seconds,
            "round_seconds": round_seconds,
            "first_transfer_ms_cold": cold_ms, "bytes": stats["bytes"],
            "descriptors": stats["descriptors"], "rounds": len(opts.rounds()),
        }


def _decode_main(opts: DemoOptions, endpoint: str, from_prefill: Any, results: Any) -> None:
    engines = _engines(opts, "decode", endpoint, 2)
    decoder = _Decoder(opts, engines)
    try:
        for e in engines:
            e.start()
        results.put(decoder.run(from_prefill))
    except BaseException as e:
        results.put({"role": "decode", "fatal": repr(e)})
    finally:
        for e in engines:
            e.close()


def _req_name(i: int) -> str:
    return "warmup" if i == 0 else f"req-{i - 1}"


RECV_DEADLINE_S = 120.0  # one request's (the round's is ``timeout_s``)

PRELOAD = ["kvxfer.testing.demo", "kvxfer.testing.tensor_kv"]


def run_demo(opts: DemoOptions, start_method: str = "forkserver",
             kept: KeptSidecars | None = None) -> dict[str, Any]:
    """Run the whole pipeline; returns the summary (``verified`` tells if every byte matched).
    Raises ``ValueError`` for impossible block sizes and ``MemoryError`` for pools larger than
    this machine's available memory, before anything starts. ``start_method``: how the engine
    processes start (``forkserver``: forked from a server that imported torch and this module
    once, ~2 s less per run when runs follow each other, as in the tests and ``kvxfer bench
    --tp-matrix``; the engines see the environment as it was when the first run started it).
    ``kept``: run on its sidecar pair for these serve arguments (``kvxfer.testing.kept``),
    left running for the next run."""
    opts.side_blocks("decode")  # refuse impossible block-size combinations up front
    opts.check_memory()
    if start_method == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # (read when the server starts)
    serve_args = ("--handshake-host", "127.0.0.1", "--lease-s", str(opts.lease_s),
                  "--ucx-error-mode", opts.ucx_error_mode, *opts.extra_serve_args)
    ctx = mp.get_context(start_method)
    engines: list[Any] = []
    factory = SidecarFactory()
    tag = ""
    try:
        if kept is None:
            sidecars = start_pair(factory, serve_args)
        else:
            sidecars = kept.pair(serve_args)
            kept.runs += 1
            tag = f"run{kept.runs}-"
        results = ctx.Queue()
        p_conn, d_conn = ctx.Pipe()
        engines = [
            ctx.Process(target=_prefill_main, args=(opts, sidecars[0].endpoint, p_conn, results, tag)),
            ctx.Process(target=_decode_main, args=(opts, sidecars[1].endpoint, d_conn, results)),
        ]
        for e in engines:
            e.start()
        got: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + (opts.timeout_s + 60) * (1 + len(opts.rounds()))
        while len(got) < 2 and time.monotonic() < deadline:
            dead = not any(e.is_alive() for e in engines)  # (before the get: it may hold the last)
            with contextlib.suppress(Exception):
                r = results.get(timeout=1.0)
                got[r["role"]] = r
                if "fatal" in r:
                    break  # the other side would only wait for it until its deadlines
                continue
            if dead or any(sc.proc.poll() is not None for sc in sidecars):
                break
        summary = _summarise(opts, got, sidecars)
        summary["metrics"] = _metrics(sidecars)
        if kept is not None:  # (what its engines' exit left behind is this run's, not the next's)
            _join(engines)
            late = kept.after_run(sidecars)
            summary["problems"] += late
            summary["verified"] = summary["verified"] and not late
        return summary
    finally:
        _join(engines)
        factory.close()


def _join(engines: list[Any]) -> None:
    for e in engines:
        e.join(10)
        if e.is_alive():
            e.kill()


_SERIES = (
    "kvxfer_gc_pause_worst_seconds",
    "kvxfer_gc_frozen_objects",
    "kvxfer_gc_old_objects",
    'kvxfer_transfers_total{result="ok"}',
    'kvxfer_transfers_total{result="failed"}',
    "kvxfer_transferred_bytes_total",
    "kvxfer_transfer_duration_seconds_count",
    "kvxfer_transfer_duration_seconds_sum",
    "kvxfer_transfer_descriptors_sum",
    'kvxfer_handshakes_total{result="ok"}',
    'kvxfer_leases_released_total{reason="read"}',
    "kvxfer_leases_expired_total",
    'kvxfer_staged_receives{how="slot"}',
    'kvxfer_staged_receives{how="windows"}',
    'kvxfer_staged_receives{how="direct"}',
    "kvxfer_staging_arena_bytes",
    "kvxfer_staging_arenas_missing",
)


def _metrics(sidecars: list[SidecarProc]) -> dict[str, dict[str, float]]:
    """Scrape each sidecar's /metrics at the end of the run (what Prometheus would see)."""
    out = {}
    for sc in sidecars:
        try:
            got = sc.scrape()
        except OSError as e:
            out[sc.name] = {"error": str(e)}  # type: ignore[dict-item]
            continue
        out[sc.name] = {k: got[k] for k in _SERIES if k in got}
    return out


def _summarise(
    opts: DemoOptions, got: dict[str, dict[str, Any]], sidecars: list[SidecarProc]
) -> dict[str, Any]:
    pre, dec = got.get("prefill", {}), got.get("decode", {})
    nbytes = int(dec.get("bytes", opts.request_bytes() * int(dec.get("done", 0))))
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
    if nbytes != opts.request_bytes() * int(dec.get("done", 0)):
        problems.append(f"moved {nbytes} bytes, expected {opts.request_bytes()} per request")
    for sc in sidecars:
        if sc.proc.poll() is not None:
            problems.append(f"{sc.name} sidecar exited early with {sc.proc.returncode}")
    if problems:
        for sc in sidecars:
            if os.path.exists(sc.log_path):
                problems.append(f"{sc.name} sidecar log tail: " + sc.log()[-2000:])
    verified = not problems and dec.get("verified_requests") == opts.requests + 1
    done = int(dec.get("done", 0))
    descriptors = int(dec.get("descriptors", 0))
    return {
        "verified": verified,
        "requests": done,
        "bytes": nbytes,
        "seconds": round(seconds, 6),
        "round_seconds": [round(x, 6) for x in dec.get("round_seconds", [])],
        "gbps": round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
        "prefill_tp": opts.prefill_tp,
        "decode_tp": opts.decode_tp,
        "first_transfer_ms_cold": round(float(dec.get("first_transfer_ms_cold", 0.0)), 3),
        "in_flight": opts.window,
        "rounds": len(opts.rounds()),
        "pool_bytes": opts.pool_bytes("prefill") + opts.pool_bytes("decode"),
        "released": released,
        "request_bytes": opts.request_bytes(),
        "descriptors": descriptors,
        "descriptors_per_request": descriptors // done if done else 0,
        "options": {k: v for k, v in asdict(opts).items() if k != "extra_serve_args"},
        "problems": problems,
    }
