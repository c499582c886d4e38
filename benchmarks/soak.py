"""A day of faults, nothing left behind (#37 part 3): ``make soak``.

    python benchmarks/soak.py [--minutes 60] [--fault-every 60] [--out benchmarks/soak_latest]

P/D transfers through two real sidecars (synthetic engines, real NIXL, every byte of every
transfer verified), each sidecar run as deployed: under a watchdog supervisor
(``kvxfer.testing.supervise``, the shipped systemd unit's WatchdogSec=2, TimeoutAbortSec=1,
RestartSec=2). Every ``--fault-every`` seconds one fault, drawn at random (seeded):
kill -9 or SIGSTOP of either sidecar, a synthetic engine restart, the peer dropped by an
operator (gRPC ``DisconnectPeer``) and so re-handshaked at once, hostile bytes on the engine
socket and the handshake port, and, where network namespaces can be made (root), a veth
link cut for a few seconds (the sidecars then run on two "hosts", UCX over TCP).

``--inflight`` requests (4) are in flight at once. Recorded per minute: transfers ok /
failed, p50 / p99 latency (of a batch), and of every process (both
sidecars, this harness with its engines): RSS, open fds, memfd bytes; of each sidecar (its
metrics): peers, NIXL remote agents, held leases, receives in flight; ``/dev/shm`` bytes.

It fails (exit 1, the reasons in the summary) when a request stays unsettled past its
deadline + ``--settle-s`` while its decode sidecar lives, when no transfer succeeds within
``--recover-s`` of a fault, or when a resource grows without bound: its value in the last
quarter of the run is more than the larger of 1.5x and ``slack`` above its median in the
second quarter (the first is warm-up). Writes <out>.json, <out>.txt and <out>.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvxfer.client import RemoteBlocks
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port

LAYOUT = make_layout(layers=8, num_blocks=512, heads=4, head_dim=64, block_size=16)  # 32 KiB blocks
NS = (f"kvxsp{os.getpid() % 10000}", f"kvxsd{os.getpid() % 10000}")
VETH = (f"ksp{os.getpid() % 10000}", f"ksd{os.getpid() % 10000}")
IPS = ("10.232.7.1", "10.232.7.2")
SLACK = {"rss_mib": 64, "fds": 16, "memfd_mib": 8, "shm_mib": 8, "peers": 1, "agents": 1,
         "leases": 8, "inflight": 4}


def ip(*args: str) -> bool:
    return subprocess.run(["ip", *args], capture_output=True, timeout=10, check=False).returncode == 0


@dataclass
class Side:
    """One sidecar under its supervisor, and its synthetic engine."""

    name: str
    proc: SidecarProc
    state: str  # the supervisor's event log
    engine: SyntheticEngine | None = None
    registered_with: int = 0  # the sidecar start (1, 2, ...) its engine last registered with

    def events(self) -> list[dict[str, Any]]:
        with open(self.state) as f:
            return [json.loads(line) for line in f]

    def child(self) -> int:
        return int(self.events()[-1]["pid"])

    def starts(self) -> int:
        return sum(e["event"] == "started" for e in self.events())


@dataclass
class Minute:
    ok: int = 0
    failed: int = 0
    unsettled: int = 0
    latencies: list[float] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.f = SidecarFactory()
        self.netns = args.netns and self._make_hosts()
        self.sides = {"p": self._start("p"), "d": self._start("d")}
        self.lock = threading.RLock()  # the engines: the workload, or a fault restarting one
        self.minutes: list[Minute] = [Minute()]
        self.samples: list[dict[str, float]] = []
        self.problems: list[str] = []
        self.last_ok = time.monotonic()
        self.started = time.monotonic()
        self.fault_log: list[tuple[float, str]] = []  # (when it began, the fault): named in problems
        self.signalled: set[int] = set()  # sidecar pids a fault killed or stopped
        self.stop = threading.Event()

    # ------------------------------------------------------------------ setup

    def _make_hosts(self) -> bool:
        if not ip("netns", "add", NS[0]):
            print("soak: no network namespaces here (root?): no link-cut faults", file=sys.stderr)
            return False
        ip("netns", "add", NS[1])
        ip("link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        for ns, dev, addr in zip(NS, VETH, IPS, strict=True):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        return True

    def _start(self, which: str) -> Side:
        state = os.path.join(self.f.dir, f"{which}.supervise")
        prefix: tuple[str, ...] = (sys.executable, "-m", "kvxfer.testing.supervise", "--watchdog-s", "2",
                                   "--abort-s", "1", "--restart-s", "2", "--state", state, "--")
        args = ["--lease-s", "10", "--transfer-timeout-s", "10", "--handshake-timeout-s", "2",
                "--role", "prefill" if which == "p" else "decode"]
        env = None
        if self.netns:
            i = 0 if which == "p" else 1
            prefix = ("ip", "netns", "exec", NS[i], *prefix)
            args += ["--handshake-host", IPS[i], "--insecure"]
            env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "all"}
        proc = self.f.start(f"soak-{which}", *args, metrics_port=free_port(), env=env, prefix=prefix)
        return Side(which, proc, state)

    def engine(self, which: str, fresh: bool = False) -> SyntheticEngine:
        side = self.sides[which]
        if side.engine is None or fresh:
            if side.engine is not None:
                side.engine.close()
            side.engine = SyntheticEngine(LAYOUT, side.proc.endpoint, seed=1 if which == "p" else 2)
            side.registered_with = side.starts()
            side.engine.start()
        return side.engine

    def _reregister(self, which: str, timeout: float = 60.0) -> None:
        """Register the engine with its sidecar's latest start if it has not: after any restart,
        a fault's or an unplanned one (its watchdog's), as a connector's heartbeat finds it."""
        side = self.sides[which]
        eng = self.engine(which)
        starts = side.starts()
        if side.registered_with != starts and _alive(side.child()):
            eng.start(timeout=timeout)  # (raises: tried again at the next batch)
            side.registered_with = starts

    # ------------------------------------------------------------------ the workload

    def transfer(self, i: int) -> None:
        """``--inflight`` P/D requests at once: each held on the prefill, received on the
        decode, every byte verified."""
        with self.lock:
            for which in ("p", "d"):
                with contextlib.suppress(Exception):  # (a sidecar not back yet: this batch fails)
                    self._reregister(which, timeout=5.0)
            p, d = self.engine("p"), self.engine("d")
            reg = p.registered
            assert reg is not None
            batch: dict[str, tuple[list[int], list[int]]] = {}
            for k in range(self.args.inflight):
                n = self.rng.randint(1, 8)
                batch[f"soak-{i}-{k}"] = (p.allocate(n), d.allocate(n))
                p.fill(f"soak-{i}-{k}", batch[f"soak-{i}-{k}"][0])
            starts = self.sides["d"].starts()
            t0 = time.monotonic()
            try:
                for name, (pb, db) in batch.items():
                    p.client.hold(name, pb)
                    where = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb)
                    d.client.recv(name, db, where, deadline_s=self.args.deadline_s)
                answers, died = self._answers(d, set(batch), starts)
                if not died and len(answers) < len(batch):
                    self.problems.append(self._diagnose(set(batch) - set(answers)))
                outcome = {name: ("died" if died else "unsettled") if name not in answers
                           else answers[name] if answers[name] != "done"
                           else "ok" if d.verify(name, batch[name][1]) else "corrupt" for name in batch}
            except Exception:  # a sidecar gone under the engine's client: failed, not unsettled
                outcome = dict.fromkeys(batch, "failed")
            finally:
                for pb, db in batch.values():
                    d.free(db)
                    p.free(pb)
        self._count(outcome, t0, time.monotonic() - t0)

    def _when(self, t0: float) -> str:
        """When a request was sent, and the faults begun within 30 s before it or after."""
        near = [f"{kind} at {t - self.started:.1f}s" for t, kind in self.fault_log if t0 - 30 < t]
        return f"sent at {t0 - self.started:.1f}s (faults near: {', '.join(near) or 'none'})"

    def _diagnose(self, names: set[str]) -> str:
        """What the decode sidecar says of unanswered requests, and its log's last lines (an
        unsettled request is a bug to find: the CI output is all there is of it)."""
        from kvxfer.control.v1 import control_pb2 as pb
        from kvxfer.control.v1 import control_pb2_grpc as pb_grpc

        said = []
        for which in ("d", "p"):
            try:
                import grpc

                with grpc.insecure_channel(self.sides[which].proc.control) as ch:
                    st = pb_grpc.ControlStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
                said.append(f"{which}: {len(st.transfers)} transfers " + "; ".join(
                    f"{t.request_id} {t.state} age {t.age_s:.1f}s" for t in st.transfers
                    if t.request_id in names) + f", {len(st.leases)} leases, {len(st.ranks)} ranks")
            except Exception as e:  # (diagnostics only)
                said.append(f"{which}: no status ({e!r})")
        try:
            tail = self.sides["d"].proc.log().splitlines()[-15:]
        except OSError as e:
            tail = [repr(e)]
        return f"unanswered {sorted(names)}: " + " | ".join(said) + "\n  d log: " + "\n    ".join(tail)

    def _count(self, outcome: dict[str, str], t0: float, took: float) -> None:
        m = self.minutes[-1]
        for name, what in outcome.items():
            if what == "ok":
                m.ok += 1
                m.latencies.append(took)
                self.last_ok = time.monotonic()
            elif what == "unsettled":  # no answer past deadline + settle while the decode sidecar lived
                m.unsettled += 1
                self.problems.append(f"{name}: unsettled {self.args.deadline_s + self.args.settle_s:.0f}s "
                                     f"after it was sent, its decode sidecar alive; {self._when(t0)}")
            else:
                m.failed += 1
                if what == "corrupt":
                    self.problems.append(f"{name}: Done but the bytes differ")

    def _answers(self, d: SyntheticEngine, names: set[str], starts: int) -> tuple[dict[str, str], bool]:
        """("done" or "failed" by request, whether the decode sidecar died meanwhile: its
        engine's connector fails the loads left then, once it exited: ``connector.sidecar_death``)."""
        end = time.monotonic() + self.args.deadline_s + self.args.settle_s
        got: dict[str, str] = {}
        while time.monotonic() < end and len(got) < len(names):
            have = frozenset(got)
            ev = d.client.wait_until(lambda a, h=have: names <= {m.req_id for m in [*a.done, *a.failed]} | h,
                                     0.5)
            got |= {m.req_id: "failed" for m in ev.failed if m.req_id in names}
            got |= {m.req_id: "done" for m in ev.done if m.req_id in names}
            if len(got) < len(names) and (self.sides["d"].starts() != starts
                                          or not _alive(self.sides["d"].child())):
                return got, True
        return got, False

    def work(self) -> None:
        i = 0
        while not self.stop.is_set():
            self.transfer(i)
            i += 1
            if self.args.pause_ms:
                self.stop.wait(self.args.pause_ms / 1e3)

    # ------------------------------------------------------------------ faults

    def rng_kind(self) -> str:
        kinds = ["kill9-p", "kill9-d", "stop-p", "stop-d", "engine-p", "engine-d", "drop-peer", "hostile"]
        if self.netns:
            kinds.append("link-cut")
        return self.rng.choice(kinds)

    def fault(self, kind: str) -> None:
        which = kind[-1]
        if kind.startswith(("kill9", "stop")):
            side = self.sides[which]
            before = side.starts()
            pid = side.child()
            self.signalled.add(pid)  # (its watchdog firing, its exit: ours, not unplanned)
            os.kill(pid, signal.SIGKILL if kind.startswith("kill9") else signal.SIGSTOP)
            self._restarted(which, before)
        elif kind.startswith("engine"):
            with self.lock:
                self.engine(which, fresh=True)
        elif kind == "drop-peer":
            self._drop_peer()
        elif kind == "hostile":
            self._hostile()
        else:
            ip("-n", NS[1], "link", "set", VETH[1], "down")
            time.sleep(5.0)
            ip("-n", NS[1], "link", "set", VETH[1], "up")

    def _restarted(self, which: str, before: int) -> None:
        """Wait for the supervisor's restart (a frozen sidecar: after its watchdog killed it),
        then register the engine with the new sidecar, as a connector does."""
        side = self.sides[which]
        end = time.monotonic() + 60
        while side.starts() == before:
            if time.monotonic() > end:
                self.problems.append(f"sidecar {which} was not restarted within 60 s")
                return
            time.sleep(0.1)
        with self.lock:
            self._reregister(which)

    def _drop_peer(self) -> None:
        from kvxfer.control.v1 import control_pb2 as pb
        from kvxfer.control.v1 import control_pb2_grpc as pb_grpc

        reg = self.engine("p").registered
        assert reg is not None
        with contextlib.suppress(Exception):
            import grpc

            with grpc.insecure_channel(self.sides["d"].proc.control) as ch:
                peer = f"{reg.handshake_host}:{reg.handshake_port}"
                pb_grpc.ControlStub(ch).DisconnectPeer(pb.DisconnectPeerRequest(endpoint=peer), timeout=5)

    def _hostile(self) -> None:
        """Garbage on both sidecars' engine sockets and on the prefill's handshake port."""
        ctx = zmq.Context()
        try:
            reg = self.engine("p").registered
            targets = [s.proc.endpoint for s in self.sides.values()]
            if reg is not None and not self.netns:
                targets.append(f"tcp://{reg.handshake_host}:{reg.handshake_port}")
            for target in targets:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(target)
                for _ in range(50):
                    with contextlib.suppress(zmq.Again):
                        sock.send(self.rng.randbytes(self.rng.randint(0, 300)), zmq.NOBLOCK)
                time.sleep(0.1)
                sock.close(0)
        finally:
            ctx.term()

    def faults(self) -> None:
        while not self.stop.wait(self.args.fault_every):
            t0 = time.monotonic()
            kind = self.rng_kind()
            self.fault_log.append((t0, kind))
            self.minutes[-1].faults.append(kind)  # (in the minute it began: a fault may outlast the run)
            self.fault(kind)
            end = time.monotonic() + self.args.recover_s
            while self.last_ok < t0 + 0.001 and time.monotonic() < end and not self.stop.is_set():
                time.sleep(0.1)
            if self.last_ok < t0 and not self.stop.is_set():
                self.problems.append(f"no transfer succeeded within {self.args.recover_s:.0f}s of {kind}")

    # ------------------------------------------------------------------ measuring

    def sample(self) -> dict[str, float]:
        """One reading of every resource (see the module docstring)."""
        out: dict[str, float] = {"t": time.monotonic()}
        for which, side in self.sides.items():
            pid = side.child()
            out.update({f"{which}.{k}": v for k, v in _proc(pid).items()})
            metrics = self._scrape(side, 1 if which == "d" else 0)
            for key, series in (("peers", "kvxfer_peers"), ("agents", "kvxfer_nixl_remote_agents"),
                                ("leases", "kvxfer_held_leases"), ("inflight", "kvxfer_inflight_transfers")):
                out[f"{which}.{key}"] = metrics.get(series, -1.0)
        out.update({f"harness.{k}": v for k, v in _proc(os.getpid()).items()})
        out["shm_mib"] = sum(e.stat().st_size for e in os.scandir("/dev/shm") if e.is_file()) / 2**20
        return out

    def _scrape(self, side: Side, ns: int) -> dict[str, float]:
        url = f"http://127.0.0.1:{side.proc.metrics_port}/metrics"
        code = f"import urllib.request as u; print(u.urlopen({url!r}, timeout=5).read().decode())"
        cmd = [sys.executable, "-c", code]
        if self.netns:
            cmd = ["ip", "netns", "exec", NS[ns], *cmd]
        try:
            body = subprocess.run(cmd, capture_output=True, timeout=15, check=True).stdout.decode()
        except (subprocess.SubprocessError, OSError):
            return {}
        got = {}
        for line in body.splitlines():
            if line.startswith("kvxfer"):
                name, _, value = line.rpartition(" ")
                got[name] = float(value)
        return got

    def run(self) -> int:
        self.engine("p")
        self.engine("d")
        threads = [threading.Thread(target=fn, daemon=True) for fn in (self.work, self.faults)]
        for t in threads:
            t.start()
        end = time.monotonic() + self.args.minutes * 60
        try:
            while time.monotonic() < end:
                time.sleep(min(60.0, max(0.0, end - time.monotonic())))
                self.samples.append(self.sample())
                self._print_minute(len(self.minutes) - 1)
                self.minutes.append(Minute())
                if self.args.checkpoint_min and len(self.samples) % self.args.checkpoint_min == 0:
                    write(self, self.args.out, None)  # (a run cut short keeps what it measured)
        finally:
            self.stop.set()
            for t in threads:
                t.join(60)
        self.minutes.pop()  # (the one begun at the end)
        self.problems += growth(self.samples) + self.unplanned()
        return 1 if self.problems else 0

    def unplanned(self) -> list[str]:
        """Sidecar restarts no fault of ours explains: a watchdog that fired, or an exit, of a
        sidecar process no kill -9 or SIGSTOP of ours hit (a loop stalled past WatchdogSec, a
        crash)."""
        out = []
        for which, side in self.sides.items():
            events = side.events()
            for prev, e in zip([{}, *events], events, strict=False):
                if prev.get("event") == "watchdog":  # (its exit: the same restart)
                    continue
                if e["event"] in ("watchdog", "exited") and e["pid"] not in self.signalled:
                    what = (f"silent {e['silent_s']:.1f}s" if e["event"] == "watchdog"
                            else f"status {e['status']}")
                    if "ran_s" in e:  # (the supervisor's reading: busy, starved, or stopped/blocked)
                        what += (f"; its loop thread ran {e['ran_s']:.2f}s, "
                                 f"waited {e['waited_s']:.2f}s for a CPU")
                    out.append(f"sidecar {which} {e['event']} ({what}) at "
                               f"{time.strftime('%H:%M:%S', time.gmtime(e['t']))} UTC, no fault of ours")
        return out

    def _print_minute(self, i: int) -> None:
        m, s = self.minutes[i], self.samples[-1]
        lat = sorted(m.latencies)
        p50 = lat[len(lat) // 2] * 1e3 if lat else 0.0
        p99 = lat[int(len(lat) * 0.99)] * 1e3 if lat else 0.0
        print(f"min {i + 1:3d}: ok {m.ok:5d} failed {m.failed:3d} unsettled {m.unsettled} "
              f"p50 {p50:6.1f} ms p99 {p99:7.1f} ms | p rss {s['p.rss_mib']:.0f} fds {s['p.fds']:.0f} | "
              f"d rss {s['d.rss_mib']:.0f} fds {s['d.fds']:.0f} agents {s['d.agents']:.0f} | "
              f"leases {s['p.leases']:.0f} | faults {','.join(m.faults) or '-'}", flush=True)

    def close(self) -> None:
        for side in self.sides.values():
            if side.engine is not None:
                side.engine.close()
        self.f.close()
        if self.netns:
            for ns in NS:
                ip("netns", "del", ns)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _proc(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds and memfd bytes (MiB) of a process (-1 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, StopIteration):
        return {"rss_mib": -1.0, "fds": -1.0, "memfd_mib": -1.0}
    memfd = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                memfd += os.stat(f"/proc/{pid}/fd/{fd}").st_size
    return {"rss_mib": rss, "fds": float(len(fds)), "memfd_mib": memfd / 2**20}


def growth(samples: list[dict[str, float]]) -> list[str]:
    """Resources whose last quarter's median is above both 1.5x and SLACK over the second
    quarter's: a leak grows without bound, where a count a fault raises for a while (leases a
    killed decode left to expire) comes back down. (The last quarter's largest sample flagged
    such spikes: a 40-minute run with a fault every 30 s read 24 leases once.)"""
    n = len(samples)
    if n < 8:
        return []
    base, last = samples[n // 4:n // 2], samples[3 * n // 4:]
    out = []
    for key in samples[0]:
        kind = key.rsplit(".", 1)[-1]
        if kind not in SLACK:
            continue
        ref = statistics.median(s[key] for s in base)
        top = statistics.median(s[key] for s in last)
        if ref >= 0 and top > max(1.5 * ref, ref + SLACK[kind]):
            out.append(f"{key} grew: median {ref:.1f} in the second quarter, {top:.1f} in the last")
    return out


def write(soak: Soak, out: str, code: int | None) -> None:
    """<out>.json (every minute and sample), <out>.txt (the summary), <out>.png (the plot);
    ``code`` None: a checkpoint of a run still going (verdict "running")."""
    rows = []
    for i, (m, smp) in enumerate(zip(soak.minutes, soak.samples, strict=False)):
        lat = sorted(m.latencies)
        rows.append({"minute": i + 1, "ok": m.ok, "failed": m.failed, "unsettled": m.unsettled,
                     "p50_ms": lat[len(lat) // 2] * 1e3 if lat else None,
                     "p99_ms": lat[int(len(lat) * 0.99)] * 1e3 if lat else None, "faults": m.faults,
                     **{k: v for k, v in smp.items() if k != "t"}})
    verdict = "running" if code is None else "ok" if code == 0 else "failed"
    problems = soak.problems + (soak.unplanned() if code is None else [])  # (run() adds them at the end)
    doc = {"args": vars(soak.args), "netns": soak.netns, "verdict": verdict,
           "problems": problems, "minutes": rows}
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    ok, failed = sum(r["ok"] for r in rows), sum(r["failed"] for r in rows)
    faults = [k for r in rows for k in r["faults"]]
    lines = [f"soak {time.strftime('%Y-%m-%d')}: {len(rows)} minutes, {ok} transfers ok (bytes verified), "
             f"{failed} failed, {sum(r['unsettled'] for r in rows)} unsettled; {len(faults)} faults "
             f"({', '.join(f'{k} {faults.count(k)}' for k in sorted(set(faults)))}); "
             f"{'two hosts (netns, UCX over TCP)' if soak.netns else 'one host (UCX over CMA)'}",
             f"verdict: {doc['verdict']}", *[f"  {p}" for p in problems[:50]]]
    if rows:
        first, last = rows[0], rows[-1]
        for key in ("p.rss_mib", "p.fds", "p.memfd_mib", "d.rss_mib", "d.fds", "d.memfd_mib", "d.agents",
                    "p.leases", "harness.rss_mib", "harness.fds", "shm_mib"):
            lines.append(f"  {key}: minute 1 {first.get(key, -1):.1f}, last {last.get(key, -1):.1f}, "
                         f"max {max(r.get(key, -1) for r in rows):.1f}")
    with open(out + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(rows, out + ".png")


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    x = [r["minute"] for r in rows]
    fig, ax = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ax[0].plot(x, [r["ok"] for r in rows], label="ok")
    ax[0].plot(x, [r["failed"] for r in rows], label="failed")
    ax[0].set_ylabel("transfers / minute")
    for r in rows:
        for k in r["faults"]:
            ax[0].annotate(k, (r["minute"], 0), fontsize=6, rotation=90)
    ax[1].plot(x, [r["p50_ms"] or 0 for r in rows], label="p50")
    ax[1].plot(x, [r["p99_ms"] or 0 for r in rows], label="p99")
    ax[1].set_ylabel("latency ms")
    for key in ("p.rss_mib", "d.rss_mib", "harness.rss_mib", "p.fds", "d.fds", "d.agents", "p.leases"):
        ax[2].plot(x, [r.get(key, -1) for r in rows], label=key)
    ax[2].set_ylabel("MiB / count")
    ax[2].set_xlabel("minute")
    for a in ax:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/soak.py")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    ap.add_argument("--deadline-s", type=float, default=5.0, help="each transfer's deadline")
    ap.add_argument("--settle-s", type=float, default=10.0, help="an answer may come this much later")
    ap.add_argument("--recover-s", type=float, default=45.0, help="a success this soon after each fault")
    ap.add_argument("--inflight", type=int, default=4, help="requests in flight at once")
    ap.add_argument("--pause-ms", type=float, default=0.0, help="a pause after each batch (a lighter load)")
    ap.add_argument("--checkpoint-min", type=int, default=10,
                    help="write the results so far every this many minutes (0: only at the end)")
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument("--netns", action=argparse.BooleanOptionalAction, default=True,
                    help="two hosts joined by a veth pair, UCX over TCP, link cuts (needs root)")
    ap.add_argument("--out", default="benchmarks/soak_latest")
    args = ap.parse_args()
    soak = Soak(args)
    try:
        code = soak.run()
    finally:
        soak.close()
    write(soak, args.out, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
