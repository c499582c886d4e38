"""The client end of host-key authentication (``kvxfer.hostkey``): a gRPC channel whose
every call carries a fresh signature of its method under this host's key, which the
sidecar's control plane takes as proof that the caller runs as the sidecar's user (or root)
on this host. What ``kvxfer status`` and the other CLI verbs dial with."""

from __future__ import annotations

import collections
from typing import Any

import grpc

from kvxfer import hostkey
from kvxfer.auth import CALL_HEADER, call_audience, sign_call
from kvxfer.targets import is_local_target


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class _Sign(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, key: bytes, audience: str) -> None:
        self.key = key
        self.audience = audience

    def _signed(self, d: grpc.ClientCallDetails) -> _Details:
        method = d.method.decode() if isinstance(d.method, bytes) else d.method
        value = sign_call(self.key, method.rsplit("/", 1)[-1], self.audience)
        metadata = [*(d.metadata or ()), (CALL_HEADER, value)]
        return _Details(d.method, d.timeout, metadata, d.credentials,
                        getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._signed(details), request)

    def intercept_unary_stream(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._signed(details), request)


def signed(channel: grpc.Channel, target: str, key: bytes | None) -> grpc.Channel:
    """``channel`` (to ``target``) with every call signed with ``key``; unchanged without a
    key, or when ``target`` is not on this host (a host key proves nothing beyond it, and
    is never offered there)."""
    if not key or not is_local_target(target):
        return channel
    return grpc.intercept_channel(channel, _Sign(key, call_audience(target)))


def host_key(key_file: str = "") -> bytes | None:
    """This host's key when this user can read it (``key_file``, else where the sidecar would
    look); None otherwise."""
    return hostkey.read_if_allowed(key_file or hostkey.default_path())


def local_channel(target: str, key_file: str = "") -> grpc.Channel:
    """A plaintext channel to a sidecar of this host, signed with the host key when this user
    can read it."""
    return signed(grpc.insecure_channel(target), target, host_key(key_file))
