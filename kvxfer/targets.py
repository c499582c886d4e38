"""Listener addresses as the configuration and the control plane spell them: pure string
checks, no sockets. Kept below ``config`` so that the configuration can validate its
targets without importing the control plane that serves them."""

from __future__ import annotations

import ipaddress

# who may call the control API's mutating verbs (kvxfer.control.access tells them apart)
MUTATING_MODES = ("local", "authenticated", "any", "none")


def split_targets(spec: str) -> list[str]:
    return [t.strip() for t in spec.split(",") if t.strip()]


def is_unix(target: str) -> bool:
    return target.startswith("unix:")


def is_loopback(host_port: str) -> bool:
    """True for "127.0.0.1:5", "[::1]:5", "[::ffff:127.0.0.1]:5", "localhost:5"."""
    host = host_port.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def is_local_peer(peer: str) -> bool:
    """True for gRPC peer strings of unix sockets and loopback TCP ("ipv4:127.0.0.1:5",
    "ipv6:[::1]:5", "ipv6:[::ffff:127.0.0.1]:5", "unix:/run/x.sock", "unix:")."""
    if peer.startswith("unix"):
        return True
    kind, _, rest = peer.partition(":")
    return kind in ("ipv4", "ipv6") and is_loopback(rest)


def is_local_target(target: str) -> bool:
    """True for listener targets only this host can reach: unix sockets and loopback TCP."""
    return is_unix(target) or is_loopback(target)
