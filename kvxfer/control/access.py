"""Who may reach the control API, and who may change things through it.

Transport: each ``control_target`` (comma-separated) is one listener. TCP listeners use TLS
when ``control_tls_cert``/``control_tls_key`` are set, and then demand a client certificate
signed by ``control_tls_client_ca`` when that is set (mutual TLS). ``unix://`` listeners are
always plaintext: the socket file's permissions are the access control. ``health_target``
is a separate plaintext listener that serves only ``grpc.health.v1`` (kubelet's gRPC probes
cannot speak TLS), so the control service itself never has to be exposed in the clear.

Authorization: health, GetLoad (counts) and GetStatus are open to whoever the transport let
in; but what names requests (``PRIVATE``: ListTransfers, ListPeers, WatchEvents, and
GetStatus's leases, transfers and peers, left out and ``redacted`` set) is shown only to
callers that ``local`` admits, or to anyone under ``any``. Mutating RPCs (``MUTATING``)
follow ``control_mutating``:

- ``local`` (default): callers on a unix control socket (its file is 0600: this user and
  root only) and authenticated callers. Loopback TCP is no proof of anything: every user of
  the host reaches it;
- ``authenticated``: only authenticated callers;
- ``any``: whoever the transport let in;
- ``none``: nobody (a read-only control plane).

A caller is authenticated by a bearer token (``authorization: Bearer <token>`` metadata;
the token from ``control_token_file`` or ``KVXFER_CONTROL_TOKEN``), by a verified client
certificate whose common name or a subject alternative name is in ``control_admins`` (any
verified certificate when that list is empty), or by a call signed with this host's key
(``kvxfer.hostkey``; ``x-kvxfer-host-auth`` metadata, ``kvxfer.auth.sign_call``: the CLI
of a user who can read the key signs every call). A wrong token or signature is refused
(UNAUTHENTICATED) even from a local caller, so a misconfigured client finds out at once.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvxfer import hostkey
from kvxfer.auth import CALL_HEADER, CallBook
from kvxfer.config import Config
from kvxfer.errors import ConfigError
from kvxfer.targets import MUTATING_MODES, is_local_peer

log = logging.getLogger("kvxfer.control")
MUTATING = frozenset({"ConnectPeer", "DisconnectPeer", "CancelTransfer", "Drain", "Resume"})
PRIVATE = frozenset({"ListTransfers", "ListPeers", "WatchEvents", "GetStatus"})  # name requests
MODES = MUTATING_MODES
TOKEN_ENV = "KVXFER_CONTROL_TOKEN"


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise ConfigError(f"{what} {path}: {e}") from e
    if not data.strip():
        raise ConfigError(f"{what} {path} is empty")
    return data


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes
    key: bytes
    client_ca: bytes | None


@dataclass(frozen=True)
class AccessPolicy:
    mode: str = "local"
    token: bytes = b""
    admins: frozenset[str] = frozenset()
    tls: TlsFiles | None = None
    host_key: bytes = b""  # b"": calls signed with a host key are refused
    host_key_file: str = ""  # where it is (shown in status: a CLI of another user learns where to look)
    calls: CallBook = field(default_factory=CallBook, compare=False)
    # this sidecar's listeners as signed calls name them (kvxfer.auth.call_audience), once bound
    audiences: set[str] = field(default_factory=set, compare=False)

    @property
    def mtls(self) -> bool:
        return self.tls is not None and self.tls.client_ca is not None

    def decide(
        self, method: str, peer: str, metadata: Iterable[tuple[str, Any]],
        identities: Mapping[str, Iterable[bytes]],
    ) -> tuple[str, str] | None:
        """None when ``method`` may run; else (grpc status name, reason). GetStatus denied
        (PERMISSION_DENIED) still runs, redacted."""
        if method not in MUTATING and method not in PRIVATE:
            return None
        if self.mode == "any" and method in PRIVATE:
            return None
        if method in MUTATING and self.mode == "any":
            return None
        if method in MUTATING and self.mode == "none":
            return "PERMISSION_DENIED", f"{method} is disabled on this sidecar (control_mutating=none)"
        presented = _bearer(metadata)
        if presented is not None and not (self.token and hmac.compare_digest(presented, self.token)):
            return "UNAUTHENTICATED", "the bearer token is not this sidecar's control token"
        signed = _header(metadata, CALL_HEADER)
        if signed is not None:
            if not self.host_key:
                return "UNAUTHENTICATED", "this sidecar takes no calls signed with a host key"
            if not is_local_peer(peer):
                return "UNAUTHENTICATED", ("a call signed with the host key must come from this host "
                                           "(a unix socket or loopback)")
            why = self.calls.check(self.host_key, method, signed, self.audiences)
            if why is not None:
                return "UNAUTHENTICATED", (f"{why}; this sidecar's host key is {self.host_key_file} "
                                           "(--host-key-file)")
        authenticated = presented is not None or signed is not None or self._cert_admin(identities)
        unix = peer.startswith("unix")
        if authenticated or (unix and (method in PRIVATE or self.mode == "local")):
            return None
        need = ("a control token, an admitted client certificate or a call signed with this "
                "host's key (the kvxfer CLI of the sidecar's user signs its calls)")
        if method in PRIVATE:
            return "PERMISSION_DENIED", f"{method} names requests: it needs {need}, or the unix socket"
        where = "" if self.mode == "authenticated" else ", or the unix control socket"
        return "PERMISSION_DENIED", f"{method} needs {need}{where} (control_mutating={self.mode})"

    def _cert_admin(self, identities: Mapping[str, Iterable[bytes]]) -> bool:
        if not self.mtls or list(identities.get("transport_security_type", [])) != [b"ssl"]:
            return False
        names = {n.decode(errors="replace") for key in ("x509_common_name", "x509_subject_alternative_name")
                 for n in identities.get(key, [])}
        return bool(names) and (not self.admins or bool(names & self.admins))


def _header(metadata: Iterable[tuple[str, Any]], name: str) -> str | None:
    for key, value in metadata:
        if key.lower() == name:
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return None


def _bearer(metadata: Iterable[tuple[str, Any]]) -> bytes | None:
    text = _header(metadata, "authorization")
    if text is None:
        return None
    scheme, _, token = text.partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b"\0invalid"


def load_policy(config: Config, env: Mapping[str, str] | None = None) -> AccessPolicy:
    """Read the token and TLS files named by the config; ConfigError when one is unusable."""
    env = os.environ if env is None else env
    token = b""
    if config.control_token_file:
        token = _read(config.control_token_file, "control_token_file").strip()
    elif env.get(TOKEN_ENV):
        token = env[TOKEN_ENV].strip().encode()
    tls = None
    if config.control_tls_cert:
        tls = TlsFiles(
            cert=_read(config.control_tls_cert, "control_tls_cert"),
            key=_read(config.control_tls_key, "control_tls_key"),
            client_ca=_read(config.control_tls_client_ca, "control_tls_client_ca")
            if config.control_tls_client_ca else None,
        )
    host_key = b""
    if config.control_target:
        try:
            host_key = hostkey.load(config.resolved_host_key_file)
        except ConfigError as e:  # only the control plane needs it here: run without, and say so
            log.warning("calls signed with the host key are refused: %s", e)
    policy = AccessPolicy(
        host_key=host_key, host_key_file=config.resolved_host_key_file if host_key else "",
        mode=config.control_mutating,
        token=token,
        admins=frozenset(a.strip() for a in config.control_admins.split(",") if a.strip()),
        tls=tls,
    )
    if policy.mode == "authenticated" and not policy.token and not policy.mtls:
        raise ConfigError("control_mutating=authenticated needs control_token_file (or "
                          f"{TOKEN_ENV}) or control_tls_client_ca: nobody could drain or cancel")
    return policy
