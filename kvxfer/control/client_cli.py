"""``kvxfer status``, ``kvxfer peers ...``, ``kvxfer drain``, ``kvxfer cancel``: thin
command-line verbs over the gRPC control API. Exit codes: 0 fine, 1 the sidecar answered
but is not serving (or the operation failed), 2 the sidecar could not be reached."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvxfer import hostkey
from kvxfer.control.access import TOKEN_ENV
from kvxfer.control.local import host_key, local_channel, signed
from kvxfer.control.v1 import control_pb2 as pb
from kvxfer.control.v1 import control_pb2_grpc as pb_grpc
from kvxfer.targets import is_unix, split_targets

DEFAULT_TARGET = "127.0.0.1:5701"


def _default_target() -> str:
    # The sidecar's own KVXFER_CONTROL_TARGET may list several listeners: the first is ours
    # (put the unix socket first, so `kubectl exec ... kvxfer status` needs no certificate).
    targets = split_targets(os.environ.get("KVXFER_CONTROL_TARGET", ""))
    return targets[0] if targets else DEFAULT_TARGET


def add_target(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--target", default=_default_target(),
                   help=f"sidecar gRPC target, host:port or unix:///path (env KVXFER_CONTROL_TARGET, "
                        f"its first entry; default {DEFAULT_TARGET})")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per RPC")
    p.add_argument("--tls-ca", default=env("KVXFER_CLI_TLS_CA", ""),
                   help="PEM CA that signed the sidecar's control certificate: dial with TLS "
                        "(env KVXFER_CLI_TLS_CA; ignored for unix:// targets)")
    p.add_argument("--tls-cert", default=env("KVXFER_CLI_TLS_CERT", ""),
                   help="PEM client certificate for mutual TLS (env KVXFER_CLI_TLS_CERT)")
    p.add_argument("--tls-key", default=env("KVXFER_CLI_TLS_KEY", ""),
                   help="PEM key of --tls-cert (env KVXFER_CLI_TLS_KEY)")
    p.add_argument("--tls-server-name", default=env("KVXFER_CLI_TLS_SERVER_NAME", ""),
                   help="name to verify in the sidecar's certificate when it differs from the "
                        "target's host (env KVXFER_CLI_TLS_SERVER_NAME)")
    p.add_argument("--token-file", default=env("KVXFER_CONTROL_TOKEN_FILE", ""),
                   help="file with the control bearer token (env KVXFER_CONTROL_TOKEN_FILE, "
                        "or the token itself in KVXFER_CONTROL_TOKEN)")
    p.add_argument("--host-key-file", default="",
                   help="this host's key, to sign every call with when this user can read it "
                        f"(env {hostkey.ENV}; default where the sidecar keeps it: "
                        f"{hostkey.default_path()}); a sidecar of this user takes it as proof "
                        "for what lists or changes things")


class CliError(Exception):
    pass


def _file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise CliError(f"{what}: {e}") from e


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """An insecure channel, or a TLS one (client certificate included) when --tls-ca is set
    and the target is TCP."""
    if not args.tls_ca or is_unix(args.target):
        if args.tls_cert and not args.tls_ca:
            raise CliError("--tls-cert needs --tls-ca")
        return local_channel(args.target, args.host_key_file)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise CliError("--tls-cert and --tls-key go together")
    creds = grpc.ssl_channel_credentials(
        root_certificates=_file(args.tls_ca, "--tls-ca"),
        private_key=_file(args.tls_key, "--tls-key") if args.tls_key else None,
        certificate_chain=_file(args.tls_cert, "--tls-cert") if args.tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return signed(grpc.secure_channel(args.target, creds, options=options), args.target,
                  host_key(args.host_key_file))


def call_metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    token = ""
    if args.token_file:
        token = _file(args.token_file, "--token-file").decode().strip()
    elif os.environ.get(TOKEN_ENV):
        token = os.environ[TOKEN_ENV].strip()
    return [("authorization", f"Bearer {token}")] if token else []


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _dur(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _security(st: pb.Status) -> str:
    if st.insecure:
        return "INSECURE: handshake takes anyone (no shared secret, no host key)"
    if st.host_key:
        return "host key (loopback; peers: sidecars of this user on this host)"
    if not st.authenticated:
        return "no shared secret (handshake on loopback only)"
    return "shared secret, " + ("encrypted (CURVE)" if st.encrypted else "NOT encrypted")


def render(st: pb.Status, serving: bool, rate: float | None = None) -> str:
    i = st.identity
    state = "SERVING" if serving else ("DRAINING" if st.draining else "NOT SERVING")
    if serving and not any(r for r in st.ranks):
        state += " (no engine registered yet: nothing to move)"
    lines = [
        f"kvxfer sidecar {i.engine_id} (role {i.role}, v{i.version}, protocol {i.protocol_version}) "
        f"up {_dur(st.uptime_s)} - {state}",
        f"  handshake  {i.handshake_endpoint}   agent {i.agent_name}   NIXL {','.join(i.nixl_backends)} "
        f"({i.ucx_error_mode})",
        f"  security   {_security(st)}",
    ]
    if not st.ranks:
        lines.append("  ranks      none registered")
    for r in st.ranks:
        kv = "MLA" if r.mla else f"{r.local_kv_heads}/{r.num_kv_heads} heads"
        where = f"{r.engine_id} dp {r.dp_rank} pp {r.pp_rank}/{r.pp_size} " if r.engine_id else ""
        lines.append(
            f"  rank       {where}tp {r.tp_rank}/{r.tp_size}: {r.num_layers} layers x {r.num_blocks} "
            f"blocks x {r.block_size} tok, {kv} x {r.head_dim} {r.dtype} {r.head_layout}, "
            f"{_human_bytes(r.bytes_registered)} {r.mem_type}"
            + (f", {r.state_regions} state regions x {r.state_bytes} B ("
               + ("split over TP ranks)" if r.state_splits else "equal TP only)") if r.state_regions else "")
        )
        for g in r.groups:
            what = (f"{g.state_bytes} B per request per layer ({g.state_kind})" if g.kind == "state"
                    else f"{g.block_size} tok blocks" + (f", window {g.window}" if g.window else ""))
            lines.append(f"    group    {g.kind}: {g.num_layers} layers, {what}")
    if st.redacted:  # never let it read as an idle sidecar
        lines.append(f"  REDACTED   peers, leases and in-flight work not shown to this caller: "
                     f"{st.redacted_why}")
        if st.host_key_file:
            lines.append(f"             (as the sidecar's user or root: --host-key-file {st.host_key_file}; "
                         "or its unix socket, or a token)")
    else:
        _requests(lines, st)
    _totals(lines, st, rate)
    return "\n".join(lines)


def _requests(lines: list[str], st: pb.Status) -> None:
    lines.append(f"  peers      {len(st.peers)}")
    if st.peers:
        lines.append(f"    {'ENDPOINT':<24}{'ENGINE':<20}{'STATE':<11}{'HANDSHAKE':>10}{'READS':>8}"
                     f"{'BYTES':>12}{'FAILED':>8}")
        for p in st.peers:
            lines.append(f"    {p.endpoint:<24}{p.engine_id[:19]:<20}{p.state:<11}{p.handshake_ms:>8.1f}ms"
                         f"{p.reads:>8}{_human_bytes(p.bytes):>12}{p.failures:>8}")
    if st.leases:
        oldest = max(x.age_s for x in st.leases)
        nxt = min(x.expires_in_s for x in st.leases)
        lines.append(f"  leases     {len(st.leases)} held, {sum(x.num_blocks for x in st.leases)} blocks "
                     f"(oldest {oldest:.1f}s, next expiry in {nxt:.1f}s)")
    else:
        lines.append("  leases     0 held")
    n = {s: sum(t.state == s for t in st.transfers) for s in ("reading", "handshake")}
    checking = len(st.transfers) - n["reading"] - n["handshake"]  # (landed: proof or digest awaited)
    lines.append(f"  in-flight  {n['reading']} reading, {n['handshake']} in handshake"
                 f"{f', {checking} verifying' if checking else ''}, "
                 f"{_human_bytes(sum(t.bytes for t in st.transfers))}")


def _totals(lines: list[str], st: pb.Status, rate: float | None) -> None:
    t = st.totals
    avg = t.bytes / st.uptime_s / 1e9 if st.uptime_s > 0 else 0.0
    thr = f"{rate:.2f} GB/s now" if rate is not None else f"{avg:.3f} GB/s average since start"
    lines.append(f"  totals     {t.transfers_ok} transfers ok, {t.transfers_failed} failed, "
                 f"{_human_bytes(t.bytes)} received ({thr})")
    lines.append(f"             leases {t.leases_released} released, {t.leases_expired} expired; "
                 f"handshakes {t.handshakes} ok, {t.handshake_failures} failed; "
                 f"{t.bad_messages} bad messages; {t.control_denied} control calls refused")
    if t.loop_stalls:  # (the log says why, each time)
        lines.append(f"             event loop late {t.loop_stalls} times, at most {t.loop_lag_worst_s:.2f}s "
                     "(see the log: busy, short of CPU, or stopped)")


def _fetch(args: argparse.Namespace) -> tuple[pb.Status, bool]:
    md = call_metadata(args)
    with open_channel(args) as ch:
        st = pb_grpc.ControlStub(ch).GetStatus(pb.GetStatusRequest(), timeout=args.timeout, metadata=md)
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                 timeout=args.timeout, metadata=md)
    return st, h.status == health_pb2.HealthCheckResponse.SERVING


MAX_SERVER_DRAIN_S = 600.0  # how long `kvxfer drain` waits for a drain the sidecar times itself


def _unreachable(verb: str, target: str, e: grpc.RpcError) -> int:
    print(f"kvxfer {verb}: cannot reach sidecar at {target}: {e.code().name}: {e.details()}",
          file=sys.stderr)
    return 2


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def to_dict(msg: Any) -> dict[str, Any]:
    """A reply as JSON-ready data, every field present, 64-bit integers as numbers (proto3's
    JSON mapping writes them as strings; scripts compare them as numbers)."""
    d = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _numbers(msg.DESCRIPTOR, d)


def _numbers(desc: Any, d: dict[str, Any]) -> dict[str, Any]:
    for f in desc.fields:
        if f.name not in d:
            continue
        repeated = (f.is_repeated if hasattr(f, "is_repeated")
                    else f.label == FieldDescriptor.LABEL_REPEATED)  # (older protobuf)
        if f.message_type is not None and not f.message_type.GetOptions().map_entry:
            d[f.name] = ([_numbers(f.message_type, x) for x in d[f.name]] if repeated
                         else _numbers(f.message_type, d[f.name]))
        elif f.type in _INT64:
            d[f.name] = [int(x) for x in d[f.name]] if repeated else int(d[f.name])
    return d


def render_peers(peers: Any) -> str:
    if not peers:
        return "no peers"
    lines = [f"{'ENDPOINT':<24}{'ENGINE':<20}{'STATE':<11}{'HANDSHAKE':>10}{'READS':>8}{'BYTES':>12}"
             f"{'FAILED':>8}"]
    for p in peers:
        lines.append(f"{p.endpoint:<24}{p.engine_id[:19]:<20}{p.state:<11}{p.handshake_ms:>8.1f}ms"
                     f"{p.reads:>8}{_human_bytes(p.bytes):>12}{p.failures:>8}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    last: tuple[float, int] | None = None
    while True:
        try:
            st, serving = _fetch(args)
        except CliError as e:
            print(f"kvxfer status: {e}", file=sys.stderr)
            return 2
        except grpc.RpcError as e:
            return _unreachable("status", args.target, e)
        if args.json:
            print(json.dumps(to_dict(st) | {"serving": serving, "target": args.target}), flush=True)
        else:
            now = time.monotonic()
            rate = None
            if last is not None and now > last[0]:
                rate = (st.totals.bytes - last[1]) / (now - last[0]) / 1e9
            last = (now, st.totals.bytes)
            if args.watch:
                print("\033[2J\033[H", end="")
            print(render(st, serving, rate), flush=True)
        if not args.watch:
            if not serving:
                why = "draining" if st.draining else "not ready"
                print(f"kvxfer status: sidecar at {args.target} is not serving ({why})", file=sys.stderr)
                return 1
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:  # (how a watch ends: Ctrl-C, no traceback)
            return 0


def _call(args: argparse.Namespace, verb: str, fn: Any, render: Any = None) -> int:
    """Run ``fn(stub, metadata)``; print the reply (JSON with --json; else ``render(reply)``,
    or one ``field: value`` line per field)."""
    try:
        md = call_metadata(args)
        with open_channel(args) as ch:
            out = fn(pb_grpc.ControlStub(ch), md)
    except CliError as e:
        print(f"kvxfer {verb}: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        details = e.details() or ""
        if (e.code() == grpc.StatusCode.UNAVAILABLE and not details.startswith("[")) or (
                e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "refused" in details.lower()):
            return _unreachable(verb, args.target, e)  # (a sidecar's own errors read "[code] why")
        print(f"kvxfer {verb}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    d = to_dict(out)
    if args.json:
        print(json.dumps(d))
    elif render is not None:
        print(render(out))
    else:
        print("\n".join(f"{k}: {v}" for k, v in d.items()))
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    if args.peers_cmd == "connect":
        host, _, port = args.endpoint.rpartition(":")
        if not host or not port.isdigit():
            print(f"kvxfer peers connect: expected HOST:PORT, got {args.endpoint!r}", file=sys.stderr)
            return 2
        req = pb.ConnectPeerRequest(host=host, port=int(port))
        return _call(args, "peers connect",
                     lambda s, md: s.ConnectPeer(req, timeout=max(args.timeout, 10), metadata=md),
                     render=lambda out: render_peers([out]))
    if args.peers_cmd == "disconnect":
        req2 = pb.DisconnectPeerRequest(endpoint=args.endpoint)
        return _call(args, "peers disconnect", lambda s, md: s.DisconnectPeer(req2, timeout=args.timeout,
                                                                       metadata=md))
    return _call(args, "peers list", lambda s, md: s.ListPeers(pb.ListPeersRequest(), timeout=args.timeout,
                                                                  metadata=md),
                 render=lambda out: render_peers(out.peers))


def cmd_drain(args: argparse.Namespace) -> int:
    req = pb.DrainRequest(timeout_s=args.drain_timeout)  # (0: the sidecar's own --drain-timeout-s)
    wait = args.drain_timeout or MAX_SERVER_DRAIN_S
    return _call(args, "drain", lambda s, md: s.Drain(req, timeout=wait + args.timeout, metadata=md))


def cmd_resume(args: argparse.Namespace) -> int:
    return _call(args, "resume",
                 lambda s, md: s.Resume(pb.ResumeRequest(), timeout=args.timeout, metadata=md))


def cmd_cancel(args: argparse.Namespace) -> int:
    req = pb.CancelTransferRequest(request_id=args.request_id)
    return _call(args, "cancel", lambda s, md: s.CancelTransfer(req, timeout=args.timeout, metadata=md))


def add_commands(sub: Any) -> None:
    p = sub.add_parser("status", help="show a sidecar's peers, leases, in-flight work and totals")
    add_target(p)
    p.add_argument("--json", action="store_true", help="one JSON object (per poll with --watch)")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=0.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until interrupted")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("peers", help="list, pre-connect or forget peer sidecars")
    psub = p.add_subparsers(dest="peers_cmd", required=True)
    for name, helptext in (("list", "list peers"), ("connect", "handshake now with HOST:PORT"),
                           ("disconnect", "forget a peer (HOST:PORT or engine id)")):
        q = psub.add_parser(name, help=helptext)
        if name != "list":
            q.add_argument("endpoint")
        add_target(q)
        q.add_argument("--json", action="store_true")
        q.set_defaults(func=cmd_peers)
    p = sub.add_parser("drain", help="stop new work, finish or fail in-flight work")
    add_target(p)
    p.add_argument("--drain-timeout", type=float, default=0.0, help="seconds to wait for in-flight work "
                   "(default: the sidecar's --drain-timeout-s)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_drain)
    p = sub.add_parser("resume", help="undo a drain: take new holds and receives again")
    add_target(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_resume)
    p = sub.add_parser("cancel", help="fail a request's receive now")
    p.add_argument("request_id")
    add_target(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cancel)
