"""What the sidecar tells the outside world: totals, Prometheus metrics and an event feed.

The sidecar calls one method per thing that happened; this module counts it, updates
the ``kvxfer_*`` metrics (histogram buckets as vLLM's NIXL connector uses, so dashboards
compare) and fans an ``Event`` out to every ``WatchEvents`` subscriber (bounded queues:
a slow watcher loses events, never the sidecar's memory). No sockets, no NIXL; the
``/metrics`` HTTP server is started by ``start_metrics_server``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family

log = logging.getLogger(__name__)
TIME_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]
# Every kind of event the sidecar emits (WatchEvents refuses a kind not here: a typo would
# otherwise wait for ever; tests/test_control.py checks every emitted kind is listed)
EVENT_KINDS = frozenset({
    "transfer_done", "transfer_failed", "lease_released", "lease_expired", "lease_expired_before_read",
    "peer_connected", "peer_disconnected", "peer_stalled", "peer_refused", "handshake_refused",
    "stray_notice", "integrity_failure", "loop_stalled", "drain_started", "drained", "resumed",
    "engine_gone", "engine_socket_lost",
})
WARN_EVERY_S = 10.0  # a listener refusing connections says so at most this often
DESC_BUCKETS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]


@dataclass
class Event:
    kind: str
    request_id: str = ""
    peer: str = ""
    code: str = ""
    reason: str = ""
    bytes: int = 0
    seconds: float = 0.0
    tp_rank: int = 0
    time_unix: float = field(default_factory=time.time)


@dataclass
class Totals:
    bytes: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    handshakes: int = 0
    handshake_failures: int = 0
    bad_messages: int = 0
    stray_notices: int = 0
    control_denied: int = 0
    integrity_checks: int = 0
    integrity_failures: int = 0
    loop_stalls: int = 0
    loop_lag_worst_s: float = 0.0


class Observer:
    def __init__(self) -> None:
        self.totals = Totals()
        self.registry = CollectorRegistry()
        self._engines_of: dict[str, str] = {}  # reading agent -> its engine id (from its handshake)
        self._subscribers: list[tuple[asyncio.Queue[Event], frozenset[str]]] = []
        self._warn_lock = threading.Lock()  # (connection_refused is called from other threads)
        self._warned_at: dict[str, float] = {}
        self._unwarned: dict[str, int] = {}
        # declared in this order, the order /metrics lists them in
        self._declare_transfer_metrics(self.registry)
        self._declare_lease_and_peer_metrics(self.registry)
        self._declare_integrity_metrics(self.registry)
        self._declare_state_gauges(self.registry)
        self._declare_serving_metrics(self.registry)
        self._declare_resource_gauges(self.registry)

    def _declare_transfer_metrics(self, r: CollectorRegistry) -> None:
        """Receives: how long, how many bytes and descriptors, by result."""
        self.m_duration = Histogram("kvxfer_transfer_duration_seconds",
                                    "Duration of one receive (NIXL READs of a request on one rank).",
                                    buckets=TIME_BUCKETS, registry=r)
        self.m_bytes = Histogram("kvxfer_transfer_bytes", "Bytes moved per receive.",
                                 buckets=BYTES_BUCKETS, registry=r)
        self.m_descs = Histogram("kvxfer_transfer_descriptors", "NIXL descriptors per receive.",
                                 buckets=DESC_BUCKETS, registry=r)
        self.m_transfers = Counter("kvxfer_transfers", "Receives finished, by result.", ["result"],
                                   registry=r)
        self.m_failures = Counter("kvxfer_transfer_failures", "Failed receives, by reason code.",
                                  ["reason"], registry=r)
        self.m_bytes_total = Counter("kvxfer_transferred_bytes", "Bytes received over NIXL.", registry=r)

    def _declare_lease_and_peer_metrics(self, r: CollectorRegistry) -> None:
        """Leases, handshakes and the messages refused or unmatched."""
        self.m_leases = Counter("kvxfer_leases_released", "Prefill holds released, by reason.",
                                ["reason"], registry=r)
        self.m_expired = Counter("kvxfer_leases_expired", "Prefill holds whose lease ran out.", registry=r)
        self.m_handshakes = Counter("kvxfer_handshakes", "Peer handshakes by result.", ["result"], registry=r)
        self.m_stalls = Counter("kvxfer_peer_stalls", "Peers dropped as stalled: they owed an answer and "
                                "said nothing for --peer-stall-s (their reads were stopped).", registry=r)
        self.m_loop_stalls = Counter("kvxfer_loop_stalls", "Times this sidecar's event loop ran more "
                                     "than its heartbeat period late (the log line says whether it ran, "
                                     "waited for a CPU or was blocked).", registry=r)
        self.g_loop_lag = Gauge("kvxfer_loop_lag_worst_seconds", "The most this sidecar's event loop's "
                                "heartbeat has run late since it started.", registry=r)
        self.g_loop_lag.set_function(lambda: self.totals.loop_lag_worst_s)
        self.m_handshake_s = Histogram("kvxfer_handshake_duration_seconds", "Peer handshake duration.",
                                       buckets=TIME_BUCKETS, registry=r)
        self.m_bad = Counter("kvxfer_bad_messages", "Messages refused as malformed or unknown.",
                             ["socket"], registry=r)
        self.m_stray = Counter("kvxfer_stray_notices", "Read notices from peers that match no held "
                               "lease, by kind: expired_lease (a read started after the lease "
                               "ran out), unknown, malformed.", ["kind"], registry=r)

    def _declare_integrity_metrics(self, r: CollectorRegistry) -> None:
        """Sampled integrity checks (--verify-sample)."""
        self.m_integrity = Counter("kvxfer_integrity_checks", "Sampled receives whose bytes were "
                                   "digested on both sides (--verify-sample), by result: ok, "
                                   "mismatch, unverified (no answer from the prefill).", ["result"],
                                   registry=r)
        self.m_integrity_failures = Counter("kvxfer_integrity_failures", "Receives whose bytes "
                                            "differed from the prefill's; the load failed.", registry=r)
        self.m_integrity_s = Histogram("kvxfer_integrity_check_seconds", "Time to digest and compare "
                                       "one sampled receive (both sides).", buckets=TIME_BUCKETS, registry=r)

    def _declare_state_gauges(self, r: CollectorRegistry) -> None:
        """What is in flight, held and up now, and the build (always 1)."""
        self.g_inflight = Gauge("kvxfer_inflight_transfers", "Receives in flight (handshake or reading).",
                                registry=r)
        self.g_inflight_bytes = Gauge("kvxfer_inflight_bytes", "Bytes of receives in flight.", registry=r)
        self.g_leases = Gauge("kvxfer_held_leases", "Prefill holds waiting for a read.", registry=r)
        self.g_peers = Gauge("kvxfer_peers", "Peers with a completed handshake.", registry=r)
        self.m_proofs = Counter("kvxfer_lease_word_proofs_total", "Reads whose lease word was read after "
                                "they landed, by whether it proved the lease held (else the claim "
                                "decided).", ["proved"], registry=r)
        self.m_stream_layers = Counter("kvxfer_push_layers_total", "Push mode: layers a decode read, early "
                                       "(its prefill computing) or final.", ["when"], registry=r)
        self.m_stream_chunks = Counter("kvxfer_push_chunk_blocks_total", "Push mode: blocks a decode read "
                                       "whole while its prefill computed the next chunks.", registry=r)
        self.m_watches = Counter("kvxfer_push_watches_total", "Push mode, prefill side: layer watches "
                                 "received, by whether the lease they name was held yet (no: the watch "
                                 "waits for its Hold).", ["held"], registry=r)
        self.g_rings = Gauge("kvxfer_engine_rings", "Engine connections talking over an engine ring "
                             "(shared memory and eventfds) rather than the ZMQ socket.", registry=r)
        self.m_rings_dropped = Counter("kvxfer_engine_rings_dropped_total", "Engine rings the sidecar "
                                       "dropped while their engine still held them, by why (corrupt: a "
                                       "counter or frame length that cannot be right, either way). What "
                                       "was in such a ring is lost: its requests end at their deadlines.",
                                       ["why"], registry=r)
        self.g_agents = Gauge("kvxfer_nixl_remote_agents", "Peer agents this sidecar reads from (a "
                              "dropped peer whose reads still settle is no longer counted).", registry=r)
        self.g_ready = Gauge("kvxfer_ready", "1 when NIXL is up and the engine socket listens.", registry=r)
        self.g_build = Gauge("kvxfer_build_info", "Always 1; the labels say what runs: kvxfer, its wire "
                             "protocol, NIXL, UCX and Python versions.",
                             ["version", "protocol", "nixl", "ucx", "python"], registry=r)
        self.g_build.labels(**build_info()).set(1)

    def _declare_serving_metrics(self, r: CollectorRegistry) -> None:
        """Control RPCs refused, and what peers read from or asked of this sidecar."""
        self.m_denied = Counter("kvxfer_control_denied", "Control RPCs refused, by method and status.",
                                ["method", "code"], registry=r)
        self.m_served_reads = Counter("kvxfer_served_reads", "Reads peers finished from blocks this "
                                      "sidecar held, by the reading engine (one per reading rank).",
                                      ["peer"], registry=r)
        self.m_served_blocks = Counter("kvxfer_served_blocks", "Held blocks peers read, by the reading "
                                       "engine (once per request).", ["peer"], registry=r)
        self.m_hs_accepted = Counter("kvxfer_handshakes_accepted", "Handshakes this sidecar's listener "
                                     "accepted (peers that may now read its held blocks).", registry=r)
        self.m_hs_refused = Counter("kvxfer_handshakes_refused", "Handshake-listener requests refused "
                                    "(hellos, renewals, digests), by error code.", ["code"], registry=r)
        self.m_conn_refused = Counter("kvxfer_connections_refused", "Connections a listener closed "
                                      "because it held its maximum, by listener: memory (the oldest "
                                      "connection without a pool, or the new one), metrics.",
                                      ["listener"], registry=r)
        self.m_peer_refused = Counter("kvxfer_peer_refused", "Peer messages about held leases refused "
                                      "(read notices, renewals, digests), by message and reason: "
                                      "bad_token, unauthenticated, capped (a duration cut to the "
                                      "sidecar's maximum).", ["message", "reason"], registry=r)

    def _declare_resource_gauges(self, r: CollectorRegistry) -> None:
        """The sidecar's exposure, NIXL descriptor lists, ranks and pools; the process's own
        (``process_open_fds``, ``process_resident_memory_bytes``...: NIXL 1.5.1 with UCX peer
        error handling keeps the sockets of every live peer it removed, README "Known limits")."""
        ProcessCollector(registry=r)
        self.g_insecure = Gauge("kvxfer_insecure", "1 when the handshake listener takes anyone: "
                                "no shared secret and no host key (--insecure).", registry=r)
        self.g_dlists = Gauge("kvxfer_descriptor_lists_prepared", "NIXL descriptor-list pairs this "
                              "sidecar prepared (prep_xfer_dlist), ever: one per (peer, rank pair, "
                              "region span), reused by every later read.", registry=r)
        self.g_ranks = Gauge("kvxfer_registered_ranks", "Engine ranks (engine, DP, PP, TP) registered "
                             "with live engines.", registry=r)
        self.g_orphans = Gauge("kvxfer_orphaned_ranks", "Ranks whose engine died, kept only while "
                               "leases still hold blocks in them.", registry=r)
        self.g_pools = Gauge("kvxfer_pools", "KV pools this sidecar holds for its engines (memory "
                             "channel).", registry=r)
        self.g_pool_bytes = Gauge("kvxfer_pool_bytes", "Bytes of the KV pools this sidecar holds for "
                                  "its engines (memory channel).", registry=r)

    # ---------------------------------------------------------------- events

    @contextmanager
    def subscribe(
        self, kinds: frozenset[str] = frozenset(), maxsize: int = 1024
    ) -> Iterator[asyncio.Queue[Event]]:
        q: asyncio.Queue[Event] = asyncio.Queue(maxsize)
        entry = (q, kinds)
        self._subscribers.append(entry)
        try:
            yield q
        finally:
            self._subscribers.remove(entry)

    def emit(self, ev: Event) -> None:
        for q, kinds in self._subscribers:
            if (not kinds or ev.kind in kinds) and not q.full():
                q.put_nowait(ev)

    # ---------------------------------------------------------------- what happened

    def transfer_done(
        self, req_id: str, peer: str, rank: int, nbytes: int, seconds: float, descs: int
    ) -> None:
        t = self.totals
        t.transfers_ok += 1
        t.bytes += nbytes
        self.m_transfers.labels("ok").inc()
        self.m_bytes_total.inc(nbytes)
        self.m_duration.observe(seconds)
        self.m_bytes.observe(nbytes)
        self.m_descs.observe(descs)
        self.emit(Event("transfer_done", req_id, peer, bytes=nbytes, seconds=seconds, tp_rank=rank))

    def transfer_failed(self, req_id: str, peer: str, rank: int, code: str, reason: str) -> None:
        self.totals.transfers_failed += 1
        self.m_transfers.labels("failed").inc()
        self.m_failures.labels(code).inc()
        self.emit(Event("transfer_failed", req_id, peer, code=code, reason=reason, tp_rank=rank))

    def stray_notice(self, peer: str, req_id: str, kind: str) -> None:
        self.totals.stray_notices += 1
        self.m_stray.labels(kind).inc()
        self.emit(Event("stray_notice", req_id, peer, code=kind))
        if kind == "expired_lease":
            log.warning("peer %s started reading request %s after its lease expired: its blocks "
                        "may have been reused", peer, req_id)
        else:
            log.info("stray read notice (%s) for %r from %s", kind, req_id, peer)

    def handshake_accepted(self, agent: str = "", engine: str = "") -> None:
        self.m_hs_accepted.inc()
        if agent:
            if len(self._engines_of) > 4096:  # (agent names change with every peer restart)
                self._engines_of.clear()
            self._engines_of[agent] = engine

    def served(self, agent: str, blocks: int) -> None:
        """A peer's rank read a held request (``blocks``: its blocks, with the first notice)."""
        peer = self._engines_of.get(agent, "") or "unknown"
        self.m_served_reads.labels(peer).inc()
        if blocks:
            self.m_served_blocks.labels(peer).inc(blocks)

    def handshake_refused(self, sender: str, code: str) -> None:
        self.m_hs_refused.labels(code).inc()
        self.emit(Event("handshake_refused", peer=sender, code=code))

    def peer_refused(self, agent: str, req_id: str, message: str, reason: str) -> None:
        """A peer's message about a lease was refused (or, for ``capped``, cut down)."""
        self.m_peer_refused.labels(message, reason).inc()
        self.emit(Event("peer_refused", req_id, agent, code=reason, reason=message))
        if reason == "capped":  # policy at work, not an attack: a decode whose receive deadline
            if due(self._warned_at, "capped"):  # is over --max-read-s asks that much with every read
                log.info("%s for request %r from agent %s: cut to --max-read-s (said every %.0f s)",
                         message, req_id, agent, WARN_EVERY_S)
        else:
            log.warning("%s for request %r from agent %s refused: %s", message, req_id, agent, reason)

    def integrity_checked(self, result: str, seconds: float) -> None:
        self.totals.integrity_checks += 1
        self.m_integrity.labels(result).inc()
        self.m_integrity_s.observe(seconds)

    def integrity_failure(self, req_id: str, peer: str, rank: int, local: list[str], remote: list[str],
                          seconds: float) -> None:
        self.integrity_checked("mismatch", seconds)
        self.totals.integrity_failures += 1
        self.m_integrity_failures.inc()
        self.emit(Event("integrity_failure", req_id, peer, code="integrity", tp_rank=rank,
                        reason=f"decode digests {local} != prefill digests {remote}"))

    def lease_released(self, req_id: str, reason: str) -> None:
        if reason == "expired":
            self.totals.leases_expired += 1
            self.m_expired.inc()
        else:
            self.totals.leases_released += 1
        self.m_leases.labels(reason).inc()
        self.emit(Event("lease_expired" if reason == "expired" else "lease_released", req_id, reason=reason))

    def handshake(self, peer: str, ok: bool, seconds: float, reason: str = "") -> None:
        if ok:
            self.totals.handshakes += 1
            self.m_handshake_s.observe(seconds)
            self.emit(Event("peer_connected", peer=peer, seconds=seconds))
        else:
            self.totals.handshake_failures += 1
            self.emit(Event("peer_disconnected", peer=peer, reason=reason))
        self.m_handshakes.labels("ok" if ok else "failed").inc()

    def stream_layers(self, early: int, final: int, chunk_blocks: int = 0) -> None:
        self.m_stream_layers.labels("early").inc(early)
        self.m_stream_layers.labels("final").inc(final)
        self.m_stream_chunks.inc(chunk_blocks)

    def layer_watch(self, held: bool) -> None:
        self.m_watches.labels("yes" if held else "no").inc()

    def lease_word(self, proved: bool) -> None:
        self.m_proofs.labels("yes" if proved else "no").inc()

    def peer_dropped(self, peer: str, reason: str) -> None:
        self.emit(Event("peer_disconnected", peer=peer, reason=reason))

    def peer_stalled(self, peer: str, reason: str) -> None:
        self.m_stalls.inc()
        log.warning("%s", reason)
        self.emit(Event("peer_stalled", peer=peer, code="peer_stalled", reason=reason))

    def loop_stalled(self, late_s: float, why: str) -> None:
        """The event loop ran ``late_s`` late (``kvxfer.sidecar.loop_lag``: ``why`` says why)."""
        self.m_loop_stalls.inc()
        self.totals.loop_stalls += 1
        log.warning("%s", why)
        self.emit(Event("loop_stalled", seconds=late_s, reason=why))

    def control_denied(self, method: str, code: str, peer: str, reason: str) -> None:
        self.totals.control_denied += 1
        self.m_denied.labels(method, code).inc()
        log.warning("control %s from %s refused: %s", method, peer, reason)

    def connection_refused(self, listener: str, cap: int) -> None:
        """A listener at its ``cap`` closed a connection (any thread): counted, and a WARNING
        at most every WARN_EVERY_S per listener, with the count since the last."""
        self.m_conn_refused.labels(listener).inc()
        now = time.monotonic()
        with self._warn_lock:
            self._unwarned[listener] = self._unwarned.get(listener, 0) + 1
            if now - self._warned_at.get(listener, -WARN_EVERY_S) < WARN_EVERY_S:
                return
            self._warned_at[listener] = now
            n = self._unwarned.pop(listener)
        log.warning("%s listener: %d connection(s) closed, it holds its maximum of %d (a connection "
                    "storm?)", listener, n, cap)

    def bad_message(self, socket: str) -> None:
        self.totals.bad_messages += 1
        self.m_bad.labels(socket).inc()


def due(warned_at: dict[str, float], key: str) -> bool:
    """Whether ``key`` was last said WARN_EVERY_S ago or more (then it is, now)."""
    now = time.monotonic()
    if now - warned_at.get(key, -WARN_EVERY_S) < WARN_EVERY_S:
        return False
    warned_at[key] = now
    return True


def build_info() -> dict[str, str]:
    """Versions for ``kvxfer_build_info`` (UCX: the library NIXL's wheel ships, asked directly;
    "unknown" when it cannot be found)."""
    import ctypes
    import glob
    import importlib.metadata
    import importlib.util
    import os
    import platform

    from kvxfer import __version__
    from kvxfer.protocol import PROTOCOL_VERSION

    nixl = ucx = "unknown"
    for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
        try:
            nixl = f"{dist} {importlib.metadata.version(dist)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        for mod in ("nixl_cu12", "nixl_cu13"):
            spec = importlib.util.find_spec(mod)
            if spec is None or spec.origin is None:
                continue
            libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "..", f"{mod}.libs", "libucp*.so*"))
            if libs:
                lib = ctypes.CDLL(libs[0])
                lib.ucp_get_version_string.restype = ctypes.c_char_p
                ucx = lib.ucp_get_version_string().decode()
                break
    except (OSError, AttributeError):
        pass
    return {"version": __version__, "protocol": str(PROTOCOL_VERSION), "nixl": nixl, "ucx": ucx,
            "python": platform.python_version()}


METRICS_CONNECTIONS = 16  # scrapes served at once; more are closed at once (and counted)
METRICS_TIMEOUT_S = 5.0  # a scrape that sends no request within this is dropped


class _SilentHandler(WSGIRequestHandler):
    timeout = METRICS_TIMEOUT_S  # (prometheus_client's has none: one thread per idle connection, for ever)

    def log_message(self, format: str, *args: object) -> None:
        """Log nothing."""


class _MetricsServer(ThreadingWSGIServer):
    """prometheus_client's threaded server, capped: a thread per connection, at most
    METRICS_CONNECTIONS of them; a storm of idle connections used to cost one thread each
    until it ended, and the default backlog of 5 made scrapes wait seconds behind it."""

    request_queue_size = 1024  # (the default of 5 drops scrapers' SYNs during a storm: 1-3 s retries)
    observer: Observer

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            self.observer.connection_refused("metrics", METRICS_CONNECTIONS)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("/metrics connection from %s failed", client_address, exc_info=True)


def start_metrics_server(observer: Observer, host: str, port: int) -> None:
    """Serve ``/metrics`` from a daemon thread (prometheus_client's WSGI app)."""
    family, addr = _get_best_family(host, port)
    server = type("MetricsServer", (_MetricsServer,), {"address_family": family, "observer": observer})
    httpd = make_server(addr, port, make_wsgi_app(observer.registry), server, handler_class=_SilentHandler)
    threading.Thread(target=httpd.serve_forever, name="kvxfer-metrics", daemon=True).start()
