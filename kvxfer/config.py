"""One frozen configuration object for ``kvxfer serve``.

Precedence: command-line flags > ``KVXFER_<FIELD>`` environment variables > an optional
TOML file (``--config`` / ``KVXFER_CONFIG``, keys = field names) > the defaults below.
Every field is documented where it is declared; ``add_arguments`` turns the fields into
flags (``engine_id`` -> ``--engine-id``), so the three sources can never drift apart.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import socket
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvxfer import hostkey
from kvxfer.errors import ConfigError
from kvxfer.targets import MUTATING_MODES, is_unix, split_targets

log = logging.getLogger("kvxfer.config")

ENV_PREFIX = "KVXFER_"


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


@dataclass(frozen=True)
class Config:
    engine_id: str = _doc("Engine id this sidecar serves; peers address it by this name "
                          "(vLLM's remote_engine_id). Default: <hostname>-<pid>.", default="")
    engine_socket: str = _doc("ZMQ endpoint for local engine workers (ipc:// path; the "
                              "socket file is made 0600).", default="ipc:///run/kvxfer/engine.sock")
    handshake_host: str = _doc("Address the peer handshake listener binds.", default="127.0.0.1")
    handshake_port: int = _doc("TCP port of the peer handshake listener (0: any free port).",
                               default=5700)
    advertise_host: str = _doc("Host peers should dial (goes into kv_transfer_params' "
                               "remote_host). Default: handshake_host, or this host's name "
                               "when that is 0.0.0.0.", default="")
    control_target: str = _doc("gRPC control/health listener: host:port or unix:///path "
                               "('' disables it); several, comma-separated. TCP listeners use "
                               "TLS when control_tls_cert is set; unix:// ones never do.",
                               default="127.0.0.1:5701")
    control_tls_cert: str = _doc("PEM certificate (chain) for the gRPC control listeners; set "
                                 "it whenever control listens beyond loopback.", default="")
    control_tls_key: str = _doc("PEM private key of control_tls_cert.", default="")
    control_tls_client_ca: str = _doc("PEM CA bundle: when set, TCP control callers must present "
                                      "a client certificate it signed (mutual TLS).", default="")
    control_mutating: str = _doc("Who may call ConnectPeer, DisconnectPeer, CancelTransfer, Drain "
                                 "and Resume: local (callers on a unix control socket, and "
                                 "authenticated ones: a token, an admitted client cert, or a call "
                                 "signed with this host's key, which `kvxfer` CLI verbs do), "
                                 "authenticated (those only), any, or none. Listing request ids "
                                 "(ListTransfers, ListPeers, WatchEvents, GetStatus's leases and "
                                 "transfers) needs the same as local.",
                                 default="local")
    control_token_file: str = _doc("File holding a bearer token that authenticates a control "
                                   "caller (also KVXFER_CONTROL_TOKEN).", default="")
    control_admins: str = _doc("Client-certificate names (CN or SAN, comma-separated) admitted to "
                               "the mutating RPCs; empty: any certificate the CA signed.", default="")
    health_target: str = _doc("Extra plaintext listener serving only gRPC health (kubelet "
                              "probes cannot do TLS), e.g. 0.0.0.0:5702 ('' : none).", default="")
    metrics_host: str = _doc("Address the Prometheus /metrics listener binds.", default="0.0.0.0")
    metrics_port: int = _doc("Port of the Prometheus /metrics listener (0 disables it). Not "
                             "9400, dcgm-exporter's default on GPU hosts: kvxfer's ports are "
                             "5700-5703.", default=5703)
    role: str = _doc("What this engine does, for status and routers: prefill, decode or both.",
                     default="both")
    drain_timeout_s: float = _doc("How long SIGTERM waits for in-flight work before exiting.",
                                  default=20.0)
    secret_file: str = _doc("File holding the shared secret peers must prove at handshake "
                            "(HMAC); also KVXFER_SECRET. Unset: loopback handshakes prove this "
                            "host's key (--host-key-file), and none beyond loopback is allowed "
                            "without --insecure.", default="")
    handshake_encryption: str = _doc("With a shared secret, 'auto' encrypts the handshake channel "
                                     "(CurveZMQ, keys derived from the secret: the NIXL metadata "
                                     "never crosses a network in clear); 'none' sends it in clear "
                                     "(only for peers that cannot do CURVE).", default="auto")
    host_key_file: str = _doc("Without a shared secret, handshakes on loopback are authenticated "
                              "with this host's key instead: a file only this sidecar's user can "
                              "read, made on first use (0600); the CLI signs control calls with it. "
                              "Default (also KVXFER_HOST_KEY_FILE): /run/kvxfer/host.key for root or "
                              "the owner of /run/kvxfer, else $XDG_RUNTIME_DIR/kvxfer/host.key, else "
                              "/tmp/kvxfer-<uid>/host.key.", default="")
    insecure: bool = _doc("Run the handshake listener with no authentication at all: without a "
                          "shared secret beyond loopback, and without the host key on loopback "
                          "(anyone who reaches it, any local user included, can read and release "
                          "this engine's KV). Shown in status and as kvxfer_insecure 1.", default=False)
    max_pool_bytes: int = _doc("The most KV-pool memory engines may have this sidecar create on "
                               "the memory channel, in bytes (0: what the machine has available).",
                               default=0)
    max_read_s: float = _doc("The longest a peer may extend a lease at once (a read's claim, a "
                             "started notice, a keep-alive); longer asks are cut and counted.",
                             default=300.0)
    max_lease_s: float = _doc("No lease outlives its hold by more than this, however often peers "
                              "renew it: no peer can pin an engine's blocks for ever.", default=600.0)
    shm_dirs: str = _doc("Directories (comma-separated) whose kvxfer-* files engines may register "
                         "as KV memory (subdirectories too; no symlinks; owned by the engine's uid).",
                         default="/dev/shm")
    engine_ownership: str = _doc("Who may hold, release, receive or unregister for an engine on the "
                                 "engine socket: 'process' (a connection from the process that "
                                 "registered one of its ranks, or an ancestor of it: vLLM's "
                                 "scheduler is the parent of its multiproc workers, the very "
                                 "process of a uniproc one) or 'uid' (any process of the ranks' "
                                 "uid: for executors whose workers are not the scheduler's "
                                 "children, such as Ray). Processes in another PID namespace are "
                                 "told apart by uid only, either way.", default="process")
    engine_check_s: float = _doc("How often to check that registered engine processes live.",
                                 default=1.0)
    lease_s: float = _doc("Default lease on held prefill blocks; released when it expires "
                          "with no read.", default=30.0)
    transfer_timeout_s: float = _doc("Default deadline of one receive (handshake included).",
                                     default=30.0)
    handshake_timeout_s: float = _doc("How long a peer handshake may take.", default=5.0)
    peer_stall_s: float = _doc("A peer sidecar that owes this one an answer (a claim, a keep-alive, "
                               "a probe while reads from it run) and says nothing for this long is "
                               "stalled (frozen, wedged): its reads are stopped and settled, they "
                               "fail peer_stalled, and it is handshaked again, within this long, "
                               "before its next use. 0: off (wait for each deadline).", default=2.0)
    peer_idle_probe_s: float = _doc("A peer sidecar that nothing was asked of for this long is probed "
                                    "(a renewal of no lease); one that does not answer within "
                                    "--peer-stall-s is let go: its link, its handshake and its NIXL "
                                    "agent (a dead or moved-away prefill is otherwise kept until a "
                                    "read from it fails). 0: off.", default=30.0)
    lease_word_slots: int = _doc("Slots of this sidecar's lease words (kvxfer.sidecar.lease_words: "
                                 "16 bytes each, registered with NIXL): a reader proves a lease held "
                                 "after its read landed with one 16-byte READ instead of waiting for its "
                                 "claim's round trip. 0: none (every read waits for its claim's answer).",
                                 default=65536)
    settle_timeout_s: float = _doc("A failed read is reported once its in-flight NIXL chunks "
                                   "stopped (they could still write into its blocks); if they "
                                   "have not after this long, the sidecar exits (status 3) so "
                                   "that they die with it.", default=20.0)
    ucx_error_mode: str = _doc("UCX ucx_error_handling_mode: 'peer' surfaces remote failures "
                               "(use on RDMA), 'none' is faster on one host (CMA).",
                               default="peer")
    nixl_threads: int = _doc("UCX backend worker threads (0: copy inside transfer()). With "
                             "threads, the chunks of large receives copy in parallel (measured "
                             "on 2 cores: 256 MiB 1.4x faster with 2 than with 0).", default=2)
    chunk_mib: int = _doc("Largest NIXL request posted at once, MiB; large receives are split "
                          "and interleaved so small ones are not stuck behind them.", default=64)
    max_inflight_chunks: int = _doc("Chunks in flight at once across all receives.", default=8)
    merge_runs: bool = _doc("Move consecutive blocks that map to consecutive remote blocks as one "
                            "NIXL descriptor per run (an un-prepared transfer, used when it saves "
                            "at least 32 descriptors); --no-merge-runs reads every block with "
                            "its own prepared descriptor.", default=True)
    inline_read_kib: int = _doc("Receives of up to this many KiB are planned and posted by the "
                                "sidecar's event loop itself, with no hand-off to the NIXL thread "
                                "and back (on one host the copy runs inside the post, holding the "
                                "loop: ~0.3 ms per 2 MiB here); larger ones, and every one while "
                                "the NIXL thread is in NIXL, go through the NIXL thread. 0: all "
                                "do. Not used with --cuda on.", default=4096)
    inline_alone_read_kib: int = _doc("And up to this many KiB while nothing else waits for the loop "
                                      "(no other receive, no engine message unread, no read in "
                                      "flight; none with --inline-read-kib 0).", default=32768)
    notice_fences: bool = _doc("After each NIXL notification to a peer, read 16 bytes from it (a fence), "
                               "so that the next read from that peer completes inside its post: in UCX "
                               "peer mode a transfer posted after a notification otherwise waits for "
                               "the peer's next progress poll (host memory only).", default=True)
    staging_mib: int = _doc("Staging arena, MiB of host memory registered with NIXL (0: none). A "
                            "read of many small descriptors (a head slice between different TP "
                            "sizes, equal TP > 1 in NHD) is copied by the prefill sidecar into "
                            "its arena, moved as one large transfer into the decode's, and "
                            "copied into the blocks there; a read too large for its share of the "
                            "arena is read in windows through one slot. "
                            "Both sidecars need one. Not used with --cuda on. Off by default "
                            "until its per-rank "
                            "costs are fixed (#35): 256 is what the TP matrix ran with.", default=0)
    vram_staging_mib: int = _doc("With --cuda on: a staging arena of this many MiB of VRAM per CUDA "
                                 "device, allocated by the sidecar (cudaMalloc) at the first "
                                 "registration on that device; every VRAM read is staged through "
                                 "the arenas of both sides (gather, one transfer, scatter; in "
                                 "windows when larger than half an arena). UCX moves only memory "
                                 "its registering process cudaMalloc'ed over cuda_ipc on a machine "
                                 "without IMEX; the engine's memory as the sidecar imports it goes "
                                 "over tcp, ~100x slower (README 'GPU paths'). A read finding an "
                                 "arena full reads directly. 0: never stage VRAM (machines whose "
                                 "fabric handles let UCX export any memory).", default=1024)
    stage_below_kib: int = _doc("Stage a read when its direct descriptors average under this many "
                                "KiB times the engine's TP size (each rank's direct read pays a "
                                "read's fixed cost; one staged request serves them all) and it has "
                                "at least --stage-min-descs of them; 0: never stage.",
                                default=8)
    stage_min_descs: int = _doc("Never stage a read of fewer direct descriptors than this (it costs a "
                                "few ms at most either way, and staging adds a round trip and two "
                                "copies before the data lands).", default=128)
    idle_poll_ms: float = _doc("NIXL progress poll period when idle (bounds notification "
                               "latency).", default=2.0)
    active_poll_ms: float = _doc("NIXL progress poll period while blocks are held for peers "
                                 "or reads are in flight. In UCX peer mode a READ completes "
                                 "only once its target makes progress, so the prefill's period "
                                 "adds to every read.", default=0.5)
    cuda: str = _doc("Expect VRAM registrations over CUDA IPC: 'auto' (when /dev/nvidiactl "
                     "exists), 'on' or 'off'. On, UCX's memory-type cache is disabled: it "
                     "classifies IPC-imported VRAM as host memory and NIXL refuses to register "
                     "it (measured on H100, UCX 1.23). Off saves ~10%% on host-memory reads.",
                     default="auto")
    verify_sample: int = _doc("End-to-end integrity check of 1 in N receives (0: off): the "
                              "decode digests the bytes it received, the prefill the same bytes "
                              "it still holds; a mismatch fails the load (code 'integrity', "
                              "recomputed). The first read from each new peer is always checked.",
                              default=100)
    log_level: str = _doc("Logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL (also "
                          "KVXFER_LOG_LEVEL). SIGHUP re-reads it (from the config file or the "
                          "environment the daemon started with; a flag wins). UCX and NIXL log "
                          "at the matching level unless UCX_LOG_LEVEL / NIXL_LOG_LEVEL are set.",
                          default="INFO")
    log_format: str = _doc("Log lines as 'text' or 'json' (one object per line: time, level, "
                           "logger, message).", default="text")

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format must be text or json, not {self.log_format!r}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")
        check_engine_socket(self.engine_socket)
        for name in ("control_target", "health_target"):
            for target in split_targets(getattr(self, name)):
                check_target(name, target)
        if self.ucx_error_mode not in ("peer", "none"):
            raise ConfigError(f"ucx_error_mode must be 'peer' or 'none', not {self.ucx_error_mode!r}")
        if not 0 <= self.handshake_port < 65536:
            raise ConfigError(f"handshake_port out of range: {self.handshake_port}")
        for name in ("lease_s", "transfer_timeout_s", "handshake_timeout_s", "idle_poll_ms",
                     "active_poll_ms", "settle_timeout_s", "max_read_s", "max_lease_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if not 0 <= self.lease_word_slots <= 1 << 24:
            raise ConfigError("lease_word_slots must be between 0 and 16777216")
        if self.peer_stall_s < 0 or self.peer_idle_probe_s < 0:
            raise ConfigError("peer_stall_s and peer_idle_probe_s must be >= 0 (0: off)")
        if self.role not in ("prefill", "decode", "both"):
            raise ConfigError(f"role must be prefill, decode or both, not {self.role!r}")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port out of range: {self.metrics_port}")
        if self.cuda not in ("auto", "on", "off"):
            raise ConfigError(f"cuda must be auto, on or off, not {self.cuda!r}")
        if self.control_mutating not in MUTATING_MODES:
            raise ConfigError(f"control_mutating must be one of {', '.join(MUTATING_MODES)}, "
                              f"not {self.control_mutating!r}")
        if bool(self.control_tls_cert) != bool(self.control_tls_key):
            raise ConfigError("control_tls_cert and control_tls_key go together")
        if self.control_tls_client_ca and not self.control_tls_cert:
            raise ConfigError("control_tls_client_ca needs control_tls_cert and control_tls_key")
        if self.chunk_mib <= 0 or self.max_inflight_chunks <= 0:
            raise ConfigError("chunk_mib and max_inflight_chunks must be > 0")
        for name in ("nixl_threads", "inline_read_kib", "inline_alone_read_kib", "verify_sample"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.engine_ownership not in ("process", "uid"):
            raise ConfigError(f"engine_ownership must be process or uid, not {self.engine_ownership!r}")
        if self.handshake_encryption not in ("auto", "none"):
            raise ConfigError(f"handshake_encryption must be auto or none, not {self.handshake_encryption!r}")
        if self.max_lease_s < self.lease_s:
            raise ConfigError(f"max_lease_s ({self.max_lease_s}) must be >= lease_s ({self.lease_s})")

    @property
    def resolved_engine_id(self) -> str:
        return self.engine_id or f"{socket.gethostname()}-{os.getpid()}"

    def load_secret(self, env: Mapping[str, str] | None = None) -> bytes:
        """The handshake secret: the file's content (stripped), else KVXFER_SECRET."""
        env = os.environ if env is None else env
        if self.secret_file:
            try:
                with open(self.secret_file, "rb") as fh:
                    secret = fh.read().strip()
            except OSError as e:
                raise ConfigError(f"secret_file {self.secret_file}: {e}") from e
            if not secret:
                raise ConfigError(f"secret_file {self.secret_file} is empty")
            secret_warnings(self.secret_file, secret)
            return secret
        return env.get(ENV_PREFIX + "SECRET", "").encode()

    def require_secret(self, secret: bytes) -> None:
        """ConfigError when the handshake listener would bind beyond loopback with no secret
        (on loopback the host key stands in; --insecure runs open on purpose)."""
        if not secret and not self.handshake_is_local and not self.insecure:
            raise ConfigError(
                f"the handshake listener would bind {self.handshake_host!r}, beyond loopback, with no "
                "shared secret: anyone who reaches it could read and release this engine's KV cache. "
                "Set secret_file (--secret-file) or KVXFER_SECRET on every sidecar, or pass --insecure "
                "to run open on purpose")

    def preflight(self) -> None:
        """What the start checks of the files and the secret, without starting (``serve
        --check``): ConfigError for a secret file that cannot be read, a handshake listener
        beyond loopback with no secret (short of --insecure), a control TLS or token file
        that is not there. (The host key, made on first start, is not made here.)"""
        self.require_secret(self.load_secret())
        for name in ("control_tls_cert", "control_tls_key", "control_tls_client_ca", "control_token_file"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{name} {path}: not a readable file")

    @property
    def resolved_host_key_file(self) -> str:
        return self.host_key_file or hostkey.default_path()

    @property
    def shm_dir_list(self) -> list[str]:
        return [d.strip() for d in self.shm_dirs.split(",") if d.strip()]

    @property
    def handshake_is_local(self) -> bool:
        """Does the handshake listener bind loopback only?"""
        host = self.handshake_host.strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    @property
    def cuda_enabled(self) -> bool:
        if self.cuda == "auto":
            return os.path.exists("/dev/nvidiactl")
        return self.cuda == "on"

    @property
    def resolved_advertise_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.handshake_host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return self.handshake_host


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def secret_warnings(path: str, secret: bytes) -> None:
    """WARNINGs for a secret file others may read, or a secret short enough to guess."""
    with contextlib.suppress(OSError):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            log.warning("secret_file %s is readable by others (mode %04o): `chmod 600` it; whoever reads "
                        "it can handshake as a peer and reach registered KV memory", path, mode)
    if len(secret) < 16:
        log.warning("secret_file %s holds a %d-byte secret: use at least 16 random bytes (e.g. "
                    "`openssl rand -hex 32`)", path, len(secret))


def check_engine_socket(endpoint: str) -> None:
    """ipc:// and an absolute path (a relative one binds where the sidecar was started: / under
    systemd), or tcp://host:port."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc" and rest.startswith("/") and rest.strip("/"):
        return
    if scheme == "tcp" and _host_port(rest):
        return
    raise ConfigError(f"engine_socket must be ipc:// and an absolute path (ipc:///run/kvxfer/engine.sock) "
                      f"or tcp://host:port, not {endpoint!r}")


def check_target(name: str, target: str) -> None:
    """A gRPC listener address: unix:PATH (as the control server tells them: ``is_unix``) or
    host:port (IPv6 as [addr]:port)."""
    if is_unix(target):
        path = target[len("unix:"):]
        path = path[2:] if path.startswith("//") else path  # (unix:///abs, unix:/abs; unix://rel is relative)
        if not path.lstrip("/") or not path.startswith("/"):
            raise ConfigError(f"{name}: {target!r} names no absolute socket path (unix:///run/kvxfer/x.sock)")
        return
    if not _host_port(target):
        raise ConfigError(f"{name}: {target!r} is neither host:port nor unix:///path")


def _host_port(text: str) -> bool:
    """``host:port`` (IPv6 as [addr]:port) with a port in 1..65535."""
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def _convert(name: str, raw: Any, kind: type) -> Any:
    """An environment value (a string) as the field's type."""
    if kind is bool:
        v = str(raw).strip().lower()
        if v not in _TRUE + _FALSE:
            raise ConfigError(f"{name}: {raw!r} is not a boolean (true/false, 1/0, yes/no, on/off)")
        return v in _TRUE
    try:
        return kind(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: cannot read {raw!r} as {kind.__name__}") from e


_TOML_NAMES = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}


def _typed(path: str, name: str, value: Any, kind: type) -> Any:
    """A TOML value, which must already have the field's type (``lease_s = true`` is refused,
    not read as 1; an integer is a valid float)."""
    ok = (isinstance(value, bool) if kind is bool
          else isinstance(value, int) and not isinstance(value, bool) if kind is int
          else isinstance(value, int | float) and not isinstance(value, bool) if kind is float
          else isinstance(value, str))
    if not ok:
        shown = json.dumps(value) if isinstance(value, bool | int | float | str) else repr(value)
        raise ConfigError(f"config file {path}: {name} = {shown}: expected {_TOML_NAMES[kind]}")
    return kind(value)


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file with any of the fields below "
                        f"(also {ENV_PREFIX}CONFIG).")
    parser.add_argument("--check", action="store_true",
                        help="validate the configuration, print every effective value and where "
                             "it came from (flag, env, file, default), and exit (0: valid, 2: not)")
    for f in dataclasses.fields(Config):
        if str(f.type) == "bool":
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                                action=argparse.BooleanOptionalAction,
                                help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}; default "
                                     f"{f.default!r}]")
            continue
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_TYPES[str(f.type)],
            default=None,
            help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}; default {f.default!r}]",
        )


def load_config(
    flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
    sources: dict[str, str] | None = None, warnings: list[str] | None = None,
) -> Config:
    """The effective configuration. ``sources`` (when given) is filled with where each
    value came from ("flag", "env KVXFER_X", "file PATH", "default"); ``warnings`` with an
    environment variable that shadows a key of the file."""
    flags = dict(flags or {})
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    src: dict[str, str] = {} if sources is None else sources
    toml_path = flags.pop("config", None) or env.get(ENV_PREFIX + "CONFIG")
    known = {f.name: _TYPES[str(f.type)] for f in dataclasses.fields(Config)}
    in_file: set[str] = set()
    if toml_path:
        try:
            with open(toml_path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {toml_path}: {e}") from e
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"config file {toml_path}: unknown keys {unknown}")
        values.update({k: _typed(toml_path, k, v, known[k]) for k, v in data.items()})
        in_file = set(data)
        src.update({k: f"file {toml_path}" for k in data})
    for name, kind in known.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _convert(ENV_PREFIX + name.upper(), raw, kind)
            src[name] = f"env {ENV_PREFIX}{name.upper()}"
            if name in in_file and warnings is not None and flags.get(name) is None:
                warnings.append(f"{ENV_PREFIX}{name.upper()} shadows {name} of {toml_path}")
    for name, value in flags.items():
        if name in known and value is not None:
            values[name] = value
            src[name] = "flag"
    for name in known:
        src.setdefault(name, "default")
    return Config(**values)


def describe(config: Config, sources: Mapping[str, str]) -> str:
    """``kvxfer serve --check``: every field, its effective value and where it came from
    (secrets are files or environment variables: never printed)."""
    rows = [(f.name, repr(getattr(config, f.name)), sources.get(f.name, "default"))
            for f in dataclasses.fields(Config)]
    w = max(len(r[0]) for r in rows)
    v = min(48, max(len(r[1]) for r in rows))
    return "\n".join(f"{n:<{w}}  {val:<{v}}  ({where})" for n, val, where in rows)
