"""What one shared secret buys between sidecars. Pure functions and small tables, no I/O.

With a secret configured (``--secret-file`` or ``KVXFER_SECRET``):

- **Challenge, then Hello.** A listener answers an unsigned ``Hello`` with a ``Challenge``
  (a fresh nonce and its own agent name). The dialer signs its ``Hello`` over that
  challenge, the listener's agent name, its own nonce and every field it vouches for. A
  listener accepts a challenge it issued itself, once, within ``CHALLENGE_S``: a captured
  Hello replays neither to the same sidecar nor to another one that shares the secret, and
  no two clocks need to agree.
- **Welcome.** Signed over the protocol version, compatibility hash, both engine ids and
  agents, both nonces, the advertised ranks (addresses, block lengths, layouts), the
  registration generation, a digest of the NIXL metadata frame, its staging arena and, for a
  dialer that asks (``welcome_cover``), its lease words and push-mode flags: the dialer knows
  the answer, and the memory it describes, comes from a holder of the secret.
- **Requests after the handshake** (``LeaseRenew``, ``DigestRequest``): signed over their
  whole encoding. Each names per-request tokens that only the engine that held the blocks
  handed out (``kvxfer.sidecar.holds``), so a replay to another sidecar names nothing it holds.
- **Encryption.** Both ends derive a CURVE key pair for the handshake listener from the
  secret (``curve_server_keys``): ZMQ's CurveZMQ encrypts and authenticates the channel, so
  the NIXL metadata (which grants remote access to registered memory) never crosses a
  network in clear, and only a holder of the secret can answer as a listener.

Every MAC is HMAC-SHA256 over a msgpack array (``_mac``): canonical and length-prefixed,
so no two different field lists sign alike (``("a|b", "c")`` and ``("a", "b|c")`` differ).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Iterable
from typing import Any, TypeVar

import msgspec

from kvxfer.protocol import DigestRequest, Hello, LayerWatch, LeaseRenew, StageRequest, Welcome

CHALLENGE_S = 30.0  # a challenge must be answered within this
CHALLENGES_MAX = 4096  # outstanding challenges kept (oldest forgotten first)
# How much of a Welcome its MAC covers (``welcome_cover``): 0, the fields of protocol 6 as first
# released (through staging_bytes); 1, also the lease words and the push-mode flags; 2, also
# compat_tp and reader_engines, and the compat_tp of the Hello it answers (which the Hello's own
# MAC leaves out: its fields are fixed for every 6, and an older listener checks those only).
WELCOME_COVER = 2


def _mac(secret: bytes, label: str, *fields: Any) -> str:
    body = msgspec.msgpack.encode([label, *fields])
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def _hello_fields(hello: Hello) -> tuple[Any, ...]:
    return (hello.version, hello.compat_hash, hello.engine_id, hello.agent_name, hello.model,
            hello.nonce, hello.challenge, hello.target)


def sign_hello(secret: bytes, hello: Hello, challenge: str, target: str) -> Hello:
    """The Hello answering a listener's challenge (``target``: its agent name)."""
    hello = msgspec.structs.replace(hello, nonce=f"w{WELCOME_COVER}.{secrets.token_hex(16)}", ts=time.time(),
                                    challenge=challenge, target=target, mac="")
    return msgspec.structs.replace(hello, mac=_mac(secret, "hello", *_hello_fields(hello)))


class ChallengeBook:
    """The challenges a listener issued: each accepted once, within ``CHALLENGE_S``."""

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self._issued: collections.OrderedDict[str, float] = collections.OrderedDict()

    def issue(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        self._forget(now)
        nonce = secrets.token_hex(16)
        self._issued[nonce] = now
        while len(self._issued) > CHALLENGES_MAX:
            self._issued.popitem(last=False)
        return nonce

    def _forget(self, now: float) -> None:
        while self._issued:
            nonce, at = next(iter(self._issued.items()))
            if now - at <= CHALLENGE_S:
                break
            del self._issued[nonce]

    def check_hello(self, secret: bytes, hello: Hello, now: float | None = None) -> str | None:
        """None if the hello is authentic and answers a live challenge of ours (which it then
        uses up), else the reason to refuse it."""
        now = time.monotonic() if now is None else now
        if not hello.mac or not hello.nonce:
            return "this sidecar requires the shared secret"
        if not hmac.compare_digest(_mac(secret, "hello", *_hello_fields(hello)), hello.mac):
            return "bad handshake signature (wrong shared secret?)"
        if hello.target != self.agent_name:
            return f"handshake addressed to {hello.target!r}, not to this sidecar (replayed?)"
        self._forget(now)
        if self._issued.pop(hello.challenge, None) is None:
            return "handshake answers no live challenge of this sidecar (replayed, or too slow)"
        return None


def welcome_cover(hello: Hello) -> int:
    """How much of the Welcome the dialer of ``hello`` checks (``WELCOME_COVER``; 0: the fields
    of protocol 6 as first released). Carried in the nonce's prefix (``w<N>.``): the nonce is
    under the Hello's MAC since protocol 4, so a listener of any 6 accepts it and nobody without
    the secret can strip it to make a listener sign less."""
    head, dot, _ = hello.nonce.partition(".")
    digits = head[1:]
    if not dot or head[:1] != "w" or not (digits.isascii() and digits.isdigit() and len(digits) <= 4):
        return 0
    return min(int(digits), WELCOME_COVER)


def _welcome_fields(welcome: Welcome, hello: Hello, metadata: bytes, cover: int) -> tuple[Any, ...]:
    ranks = msgspec.msgpack.encode(welcome.ranks)
    fields: tuple[Any, ...] = (
        welcome.version, welcome.compat_hash, welcome.engine_id, welcome.agent_name, hello.engine_id,
        hello.agent_name, hello.nonce, hello.challenge, ranks, welcome.generation,
        hashlib.sha256(metadata).hexdigest(), welcome.staging_bytes)
    if cover >= 1:  # what was appended to Welcome within protocol 6, after staging_bytes
        fields += (cover, welcome.lease_words_addr, welcome.lease_words_slots, welcome.layer_streams,
                   welcome.grouped_streams, welcome.chunk_streams)
    if cover >= 2:  # (which TP-independent layout each side said it has: what the handshake matched)
        fields += (welcome.compat_tp, welcome.reader_engines, hello.compat_tp)
    return fields


def sign_welcome(secret: bytes, welcome: Welcome, hello: Hello, metadata: bytes) -> Welcome:
    """Signed over as much as ``hello``'s dialer checks (a dialer of an older 6 checks less)."""
    fields = _welcome_fields(welcome, hello, metadata, welcome_cover(hello))
    return msgspec.structs.replace(welcome, mac=_mac(secret, "welcome", *fields))


def check_welcome(secret: bytes, welcome: Welcome, hello: Hello, metadata: bytes) -> bool:
    """The Welcome is signed over everything our Hello asked to be covered, or (a listener of an
    older 6, which covers less) over less: what it knows. Only a
    holder of the secret chooses which: a listener that read our ask signs the whole, and a MAC
    over the whole does not check as one over the part, so nobody can make us accept a
    Welcome whose later fields (lease words, stream flags) were changed on the way."""
    if not welcome.mac:
        return False
    return any(hmac.compare_digest(_mac(secret, "welcome", *_welcome_fields(welcome, hello, metadata, c)),
                                   welcome.mac) for c in range(welcome_cover(hello), -1, -1))


SignedRequest = TypeVar("SignedRequest", DigestRequest, LeaseRenew, StageRequest, LayerWatch)


_REQUEST_HEAD = msgspec.msgpack.encode(["request", b""])[:-2]  # (the array's header and the label)
_unsigned = msgspec.msgpack.Encoder()
_local = threading.local()  # (each thread's reused buffer: a StageRequest's runs run to a MiB)


def _request_mac(secret: bytes, req: DigestRequest | LeaseRenew | StageRequest | LayerWatch) -> str:
    """``_mac(secret, "request", msgpack(req without its mac))``, tagged by kind, computed as
    a stream: the unsigned request is encoded once, into a reused buffer, and hashed behind
    the bytes msgpack would put before it (a MiB of runs: 1.4-1.6 ms, 0.6 with this).
    Over the request as this side decoded it, not the bytes sent: a field appended to one of
    these kinds would change every MAC between a sidecar that knows it and one that does not
    (one drops it, the other adds its default), so they are never appended to within a
    protocol version (``tests/test_protocol.py`` pins their fields)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = bytearray()
    _unsigned.encode_into(msgspec.structs.replace(req, mac=""), buf)
    n = len(buf)
    head = b"\xc4" + n.to_bytes(1, "big") if n < 1 << 8 else (
        b"\xc5" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xc6" + n.to_bytes(4, "big"))
    h = hmac.new(secret, _REQUEST_HEAD + head, hashlib.sha256)
    h.update(buf)
    return h.hexdigest()


def sign_request(secret: bytes, req: SignedRequest) -> SignedRequest:
    """Sign a digest request or lease renewal (a peer answers only holders of the secret)."""
    return msgspec.structs.replace(req, mac=_request_mac(secret, req))


def check_request(secret: bytes, req: DigestRequest | LeaseRenew | StageRequest | LayerWatch) -> bool:
    return bool(req.mac) and hmac.compare_digest(_request_mac(secret, req), req.mac)


def curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys of every handshake listener sharing this secret."""
    import zmq
    from zmq.utils import z85

    raw = hmac.new(secret, b"kvxfer handshake curve key v1", hashlib.sha256).digest()
    secret_key = z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def new_token() -> str:
    """A per-request capability: unguessable, printable (it travels in kv_transfer_params)."""
    return secrets.token_urlsafe(18)


def same_token(want: str, got: str) -> bool:
    return hmac.compare_digest(want.encode(), got.encode())


# ----------------------------------------------------------------- control calls (host key)

CALL_S = 60.0  # a signed control call must arrive within this of its time (one host, one clock)
CALL_HEADER = "x-kvxfer-host-auth"  # gRPC metadata key of a call signed with the host key


def call_audience(target: str) -> str:
    """Whom a call to ``target`` is for, as both ends can name it: ``unix:<path>`` for a
    unix socket, ``tcp:<port>`` for TCP (host-key calls come over loopback only, where the
    port alone names the listener, however the caller spelled 127.0.0.1)."""
    if target.startswith("unix:"):
        return "unix:" + target[len("unix:"):].removeprefix("//")
    return "tcp:" + target.rsplit(":", 1)[-1]


def sign_call(key: bytes, method: str, audience: str, now: float | None = None) -> str:
    """The ``CALL_HEADER`` value for one call of ``method`` (the RPC's short name) to the
    listener ``audience`` (``call_audience``): its time, a fresh nonce and their MAC under
    this host's key (``kvxfer.hostkey``). Unlike a bearer token, it is worth nothing to
    whoever captures it: it names one method at one listener, once, briefly (a relay that
    got it cannot replay it to another sidecar)."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(12)
    return f"v1.{ts}.{nonce}.{_mac(key, 'control call', method, audience, ts, nonce)}"


class CallBook:
    """The signed control calls a sidecar took: each accepted once, within ``CALL_S``."""

    def __init__(self) -> None:
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()

    def check(self, key: bytes, method: str, value: str, audiences: Iterable[str],
              now: float | None = None) -> str | None:
        """None when ``value`` signs this call to one of ``audiences`` (this sidecar's
        listeners), else why not."""
        now = time.time() if now is None else now
        version, _, rest = value.partition(".")
        ts, nonce, mac = _split_call(rest)
        if version != "v1" or not ts or not nonce or not mac:
            return "a malformed host-key signature"
        try:
            when = float(ts)
        except ValueError:
            return "a malformed host-key signature"
        if not any(hmac.compare_digest(_mac(key, "control call", method, a, ts, nonce), mac)
                   for a in audiences):
            return ("a host-key signature that does not verify (another key, another method, or "
                    "signed for another sidecar's listener)")
        if abs(now - when) > CALL_S:
            return "a host-key signature too old or from the future (replayed?)"
        while self._seen and now - next(iter(self._seen.values())) > 2 * CALL_S:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return "a host-key signature already used (replayed)"
        self._seen[nonce] = now
        while len(self._seen) > CHALLENGES_MAX * 4:
            self._seen.popitem(last=False)
        return None


def _split_call(rest: str) -> tuple[str, str, str]:
    """"<ts>.<ms>.<nonce>.<mac>" after the version: (ts, nonce, mac); ts keeps its dot."""
    parts = rest.split(".")
    if len(parts) != 4:
        return "", "", ""
    return f"{parts[0]}.{parts[1]}", parts[2], parts[3]
