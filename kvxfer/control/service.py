"""The gRPC servicer: a thin translation between ``Control`` RPCs and the sidecar.

It builds replies from the sidecar's ``snapshot()`` and calls its operations (``connect_peer``,
``disconnect_peer``, ``cancel``, ``drain``); it never touches NIXL or ZMQ itself. Health:
"" and "liveness" are SERVING while the loop runs; "readiness" (and "") only while NIXL is
up, the engine socket listens and the sidecar is not draining (the engine starts after
that); "engine" only while, in addition, an engine rank is registered (for routers: this
sidecar can move KV now). Who may call what:
``kvxfer/control/access.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvxfer.auth import call_audience
from kvxfer.control.access import AccessPolicy
from kvxfer.control.v1 import control_pb2 as pb
from kvxfer.control.v1 import control_pb2_grpc as pb_grpc
from kvxfer.errors import ErrorCode, RequestError
from kvxfer.observe import EVENT_KINDS
from kvxfer.targets import is_local_target, is_unix, split_targets

if TYPE_CHECKING:
    from kvxfer.observe import Event
    from kvxfer.sidecar.lifecycle import LifecycleView
    from kvxfer.sidecar.operations import Operations
    from kvxfer.sidecar.peer_book import Peer
    from kvxfer.status import Snapshot

ENGINE = "engine"  # health service: SERVING while an engine rank is registered and not draining
log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["Control"].full_name
_GRPC_CODE = {
    ErrorCode.NOT_REGISTERED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.INCOMPATIBLE: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.HANDSHAKE_FAILED: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DRAINING: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNAUTHORIZED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.BUSY: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.PEER_STALLED: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNKNOWN_PEER: grpc.StatusCode.FAILED_PRECONDITION,
}


def peer_proto(p: Peer) -> pb.Peer:
    tp = next(iter(p.ranks.values())).layout.tp_size if p.ranks else 0
    return pb.Peer(endpoint=p.endpoint, engine_id=p.engine_id, agent_name=p.agent_name,
                   state="connected", last_handshake_unix=p.connected_unix,
                   handshake_ms=p.handshake_s * 1e3, tp_size=tp, reads=p.reads, bytes=p.bytes,
                   failures=p.failures)


def transfers_proto(snap: Snapshot, req_id: str = "", state: str = "") -> list[pb.Transfer]:
    return [
        pb.Transfer(request_id=t.req_id, tp_rank=t.tp_rank, peer=t.peer, state=t.state,
                    num_blocks=t.num_blocks, bytes=t.nbytes, age_s=t.age_s, deadline_in_s=t.deadline_in_s)
        for t in snap.transfers_of(req_id, state)
    ]


def status_proto(snap: Snapshot) -> pb.Status:
    ident = pb.Identity(
        engine_id=snap.engine_id, role=snap.role, version=snap.version, nixl_backends=snap.nixl_backends,
        handshake_endpoint=snap.handshake_endpoint, agent_name=snap.agent_name,
        protocol_version=snap.protocol_version, ucx_error_mode=snap.ucx_error_mode,
    )
    ranks = []
    for entry in snap.ranks:
        info = entry.info
        lay = info.layout
        ranks.append(pb.RankRegistration(
            engine_id=entry.key.engine, dp_rank=entry.key.dp, pp_rank=lay.pp_rank, pp_size=lay.pp_size,
            first_layer=lay.first_layer, pid=entry.pid,
            tp_rank=lay.tp_rank, tp_size=lay.tp_size, num_layers=lay.num_layers,
            num_blocks=lay.num_blocks, block_size=lay.block_size, num_kv_heads=lay.num_kv_heads,
            local_kv_heads=lay.local_kv_heads, head_dim=lay.head_dim, dtype=lay.dtype,
            kv_parts=lay.kv_parts, mla=lay.mla, head_layout=lay.head_layout,
            bytes_registered=sum(x.block_len for x in info.regions) * lay.num_blocks,
            mem_type=info.mem_type, state_regions=lay.state_regions, state_bytes=lay.state_bytes,
            state_splits=bool(lay.state_parts),
            groups=[pb.KVCacheGroup(kind=g.kind, block_size=g.block_size, num_layers=g.layers,
                                    window=g.window, state_bytes=g.state_bytes, state_kind=g.state_kind)
                    for g in entry.groups],
        ))
    leases = [
        pb.Lease(request_id=x.req_id, num_blocks=x.num_blocks, age_s=x.age_s, expires_in_s=x.expires_in_s,
                 reads_seen=x.reads_seen, reads_expected=x.reads_expected, engine_id=x.engine)
        for x in snap.leases
    ]
    t = snap.totals
    totals = pb.Totals(bytes=t.bytes, transfers_ok=t.transfers_ok, transfers_failed=t.transfers_failed,
                       leases_released=t.leases_released, leases_expired=t.leases_expired,
                       handshakes=t.handshakes, handshake_failures=t.handshake_failures,
                       bad_messages=t.bad_messages, control_denied=t.control_denied,
                       loop_stalls=t.loop_stalls, loop_lag_worst_s=t.loop_lag_worst_s)
    return pb.Status(identity=ident, ranks=ranks, peers=[peer_proto(p) for p in snap.peers],
                     leases=leases, transfers=transfers_proto(snap), totals=totals,
                     uptime_s=snap.uptime_s, ready=snap.ready, draining=snap.draining,
                     insecure=snap.insecure, authenticated=snap.authenticated, encrypted=snap.encrypted,
                     host_key=snap.host_key)


def load_proto(snap: Snapshot) -> pb.Load:
    queued = [t for t in snap.transfers if t.state == "handshake"]
    reading = [t for t in snap.transfers if t.state != "handshake"]  # reading or verifying
    return pb.Load(
        queued_requests=len(queued), queued_bytes=sum(t.nbytes for t in queued),
        inflight_requests=len(reading), inflight_bytes=sum(t.nbytes for t in reading),
        held_requests=len(snap.leases), held_blocks=sum(x.num_blocks for x in snap.leases),
        draining=snap.draining,
    )


def event_proto(ev: Event) -> pb.Event:
    return pb.Event(time_unix=ev.time_unix, kind=ev.kind, request_id=ev.request_id, peer=ev.peer,
                    code=ev.code, reason=ev.reason, bytes=ev.bytes, seconds=ev.seconds,
                    tp_rank=ev.tp_rank)


class ControlService(pb_grpc.ControlServicer):
    def __init__(self, ops: Operations, policy: AccessPolicy) -> None:
        self.sc = ops
        self.policy = policy

    def _verdict(self, method: str, context: Any) -> tuple[str, str] | None:
        return self.policy.decide(method, context.peer() or "", context.invocation_metadata() or (),
                                  context.auth_context() or {})

    async def _authorize(self, method: str, context: Any) -> None:
        """Abort the call unless ``method`` may run for this caller."""
        verdict = self._verdict(method, context)
        if verdict is not None:
            code, reason = verdict
            self.sc.observer.control_denied(method, code, context.peer() or "", reason)
            await context.abort(getattr(grpc.StatusCode, code), reason)

    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.Status:
        """Everyone the transport let in gets the status; what names requests only whom
        ``control_mutating=local`` admits (the others: left out, and why)."""
        status = status_proto(self.sc.snapshot())
        status.host_key_file = self.policy.host_key_file
        verdict = self._verdict("GetStatus", context)
        if verdict is not None:
            for name in ("leases", "transfers", "peers"):
                status.ClearField(name)
            status.redacted = True
            status.redacted_why = verdict[1]
        return status

    async def ListPeers(self, request: pb.ListPeersRequest, context: Any) -> pb.ListPeersResponse:
        await self._authorize("ListPeers", context)
        return pb.ListPeersResponse(peers=[peer_proto(p) for p in self.sc.snapshot().peers])

    async def ConnectPeer(self, request: pb.ConnectPeerRequest, context: Any) -> pb.Peer:
        await self._authorize("ConnectPeer", context)
        if not request.host or not 0 < request.port < 65536:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "host and a port in 1..65535 are required")
        try:
            return peer_proto(await self.sc.connect_peer(request.host, request.port))
        except RequestError as e:
            await context.abort(_GRPC_CODE.get(e.code, grpc.StatusCode.UNKNOWN), f"[{e.code}] {e.reason}")
            raise  # unreachable: abort raises

    async def DisconnectPeer(
        self, request: pb.DisconnectPeerRequest, context: Any
    ) -> pb.DisconnectPeerResponse:
        await self._authorize("DisconnectPeer", context)
        done = await self.sc.disconnect_peer(request.endpoint)
        log.warning("peer %s disconnected over the control API by %s: %s", request.endpoint, context.peer(),
                    "done" if done else "no such peer")
        return pb.DisconnectPeerResponse(disconnected=done)

    async def ListTransfers(self, request: pb.ListTransfersRequest, context: Any) -> pb.ListTransfersResponse:
        await self._authorize("ListTransfers", context)
        snap = self.sc.snapshot()
        return pb.ListTransfersResponse(transfers=transfers_proto(snap, request.request_id, request.state))

    async def CancelTransfer(
        self, request: pb.CancelTransferRequest, context: Any
    ) -> pb.CancelTransferResponse:
        await self._authorize("CancelTransfer", context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        cancelled = await self.sc.cancel(request.request_id)
        log.warning("transfer %s cancelled over the control API by %s: %s", request.request_id,
                    context.peer(), f"{cancelled} receives" if cancelled else "none in flight")
        return pb.CancelTransferResponse(cancelled=cancelled)

    async def Drain(self, request: pb.DrainRequest, context: Any) -> pb.DrainResponse:
        await self._authorize("Drain", context)
        timeout = request.timeout_s if request.timeout_s > 0 else self.sc.config.drain_timeout_s
        log.warning("drain requested over the control API by %s (timeout %.0fs)", context.peer(), timeout)
        drained, failed, released, took = await self.sc.drain(timeout)
        log.warning("drain done in %.1fs: %d receives failed, %d holds released", took, failed, released)
        return pb.DrainResponse(drained=drained, failed=failed, released=released, seconds=took)

    async def Resume(self, request: pb.ResumeRequest, context: Any) -> pb.ResumeResponse:
        await self._authorize("Resume", context)
        try:
            resumed = await self.sc.resume()
        except RequestError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"[{e.code}] {e.reason}")
            raise  # unreachable: abort raises
        log.warning("resume requested over the control API by %s: %s", context.peer(),
                    "taking new work again" if resumed else "was not draining")
        return pb.ResumeResponse(resumed=resumed)

    async def WatchEvents(self, request: pb.WatchEventsRequest, context: Any) -> Any:
        await self._authorize("WatchEvents", context)
        unknown = sorted(set(request.kinds) - EVENT_KINDS)
        if unknown:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown event kinds {unknown}; known: "
                                f"{', '.join(sorted(EVENT_KINDS))}")
        with self.sc.observer.subscribe(frozenset(request.kinds)) as queue:
            while True:
                yield event_proto(await queue.get())

    async def GetLoad(self, request: pb.GetLoadRequest, context: Any) -> pb.Load:
        return load_proto(self.sc.snapshot())


# A connection storm costs neither memory nor service (#40): gRPC closes a new connection at
# once while it holds MAX_CONNECTIONS, one that sends no HTTP/2 preface within 5 s, one idle
# (no RPC) for 5 minutes, and one whose peer stops answering keepalive pings.
MAX_CONNECTIONS = 128
SERVER_OPTIONS = [
    ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
    ("grpc.server_handshake_timeout_ms", 5_000),
    ("grpc.max_connection_idle_ms", 300_000),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.max_concurrent_streams", 64),
    # gRPC sets SO_REUSEPORT by default: a second sidecar given the same control or health port
    # then bound it too, and the kernel shared the connections between the two (status, drain
    # and cancel reached either one: found by a new user's trial); now that second one refuses
    ("grpc.so_reuseport", 0),
]


def _listen(server: grpc.aio.Server, target: str, policy: AccessPolicy | None) -> None:
    """Bind ``target``; calls signed with the host key may then name it (``policy.audiences``)."""
    tls = policy.tls if policy is not None and not is_unix(target) else None
    if tls is None and is_unix(target):
        # 0600 from the start (no window for another user to connect): this socket lets its
        # callers list and change things without a token, so only this user and root may
        old = os.umask(0o177)
        try:
            port = server.add_insecure_port(target)
        finally:
            os.umask(old)
        path = target.split(":", 1)[1].removeprefix("//")
        if path and os.path.exists(path):
            os.chmod(path, 0o600)
    elif tls is None:
        port = server.add_insecure_port(target)
    else:
        creds = grpc.ssl_server_credentials(
            [(tls.key, tls.cert)], root_certificates=tls.client_ca,
            require_client_auth=tls.client_ca is not None,
        )
        port = server.add_secure_port(target, creds)
    if port == 0:
        raise OSError(f"cannot listen for gRPC on {target}")
    if policy is not None:
        policy.audiences.add(call_audience(target) if is_unix(target) else f"tcp:{port}")


async def start_control_server(
    ops: Operations, target: str, policy: AccessPolicy, health_target: str = ""
) -> list[grpc.aio.Server]:
    """The control server on each of ``target``'s listeners, plus a health-only plaintext
    server on ``health_target`` when set. Both report the same health states."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_ControlServicer_to_server(ControlService(ops, policy), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    for t in split_targets(target):
        _listen(server, t, policy)
        if policy.tls is None and not is_local_target(t):
            log.warning("gRPC control on %s is plaintext: set control_tls_cert/control_tls_key "
                        "when it is reachable from other hosts", t)
    servers = [server]
    healths = [health]
    if health_target:
        hserver = grpc.aio.server(options=SERVER_OPTIONS)
        hhealth = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hhealth, hserver)
        for t in split_targets(health_target):
            _listen(hserver, t, None)
        servers.append(hserver)
        healths.append(hhealth)
    for s in servers:
        await s.start()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def show(view: LifecycleView) -> None:
        for h in healths:
            for name in ("", "readiness", SERVICE):
                await h.set(name, serving if view.ready else not_serving)
            await h.set(ENGINE, serving if view.serving_engines else not_serving)

    await show(ops.lifecycle.view)
    for h in healths:
        await h.set("liveness", serving)
    # every later change (a drain, a resume, a lost engine socket, an engine registered or
    # gone) is shown in the order it happened (tasks start in the order they were created)
    pending: set[asyncio.Task[None]] = set()

    def changed(_before: LifecycleView, after: LifecycleView) -> None:
        try:
            task = asyncio.get_running_loop().create_task(show(after))
        except RuntimeError:  # no running loop: at teardown
            return
        pending.add(task)
        task.add_done_callback(pending.discard)

    ops.lifecycle.subscribe(changed)
    return servers
