"""Shared-secret handshake authentication (HMAC-SHA256). Pure functions, no I/O.

With a secret configured (``--secret-file`` or ``KVXFER_SECRET``), a ``Hello`` carries a
fresh nonce, a timestamp and an HMAC over both and its identity; the listener refuses it
(``unauthorized``) unless the HMAC checks, the timestamp is within ``WINDOW_S`` and the
nonce is new, so an outsider who reaches the port learns no NIXL metadata. The ``Welcome``
carries an HMAC over the dialer's nonce and a digest of the metadata frame, so the dialer
knows the answer (and the memory it describes) comes from a holder of the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import TypeVar

from kvxfer.protocol import DigestRequest, Hello, LeaseRenew, Welcome, encode

WINDOW_S = 60.0


def _mac(secret: bytes, *parts: object) -> str:
    return hmac.new(secret, "|".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def sign_hello(secret: bytes, hello: Hello) -> Hello:
    import msgspec

    nonce, ts = secrets.token_hex(16), time.time()
    mac = _mac(secret, "hello", hello.version, hello.compat_hash, hello.engine_id, hello.agent_name,
               nonce, ts)
    return msgspec.structs.replace(hello, nonce=nonce, ts=ts, mac=mac)


class ReplayGuard:
    """Remembers nonces for twice the window; a nonce is accepted once."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def check_hello(self, secret: bytes, hello: Hello, now: float | None = None) -> str | None:
        """None if the hello is authentic and fresh, else the reason to refuse it."""
        now = time.time() if now is None else now
        if not hello.mac or not hello.nonce:
            return "this sidecar requires the shared secret"
        want = _mac(secret, "hello", hello.version, hello.compat_hash, hello.engine_id, hello.agent_name,
                    hello.nonce, hello.ts)
        if not hmac.compare_digest(want, hello.mac):
            return "bad handshake signature (wrong shared secret?)"
        if abs(now - hello.ts) > WINDOW_S:
            return f"handshake timestamp off by {now - hello.ts:.0f}s (clocks skewed or replayed)"
        for nonce, seen in list(self._seen.items()):
            if now - seen > 2 * WINDOW_S:
                del self._seen[nonce]
        if hello.nonce in self._seen:
            return "replayed handshake"
        self._seen[hello.nonce] = now
        return None


def sign_welcome(secret: bytes, welcome: Welcome, nonce: str, metadata: bytes) -> Welcome:
    import msgspec

    digest = hashlib.sha256(metadata).hexdigest()
    return msgspec.structs.replace(
        welcome, mac=_mac(secret, "welcome", nonce, welcome.engine_id, welcome.agent_name, digest)
    )


def check_welcome(secret: bytes, welcome: Welcome, nonce: str, metadata: bytes) -> bool:
    digest = hashlib.sha256(metadata).hexdigest()
    want = _mac(secret, "welcome", nonce, welcome.engine_id, welcome.agent_name, digest)
    return bool(welcome.mac) and hmac.compare_digest(want, welcome.mac)


SignedRequest = TypeVar("SignedRequest", DigestRequest, LeaseRenew)


def _request_mac(secret: bytes, req: DigestRequest | LeaseRenew) -> str:
    import msgspec

    body = encode(msgspec.structs.replace(req, mac=""))  # canonical and length-safe; tagged by kind
    return hmac.new(secret, b"digest\0" + body, hashlib.sha256).hexdigest()


def sign_request(secret: bytes, req: SignedRequest) -> SignedRequest:
    """Sign a digest request or lease renewal (a peer answers only holders of the secret)."""
    import msgspec

    return msgspec.structs.replace(req, mac=_request_mac(secret, req))


def check_request(secret: bytes, req: DigestRequest | LeaseRenew) -> bool:
    return bool(req.mac) and hmac.compare_digest(_request_mac(secret, req), req.mac)


sign_digest_request = sign_request
check_digest_request = check_request
