"""Encoding any message, and one decoder per conversation (each a tagged union).

No I/O; never imports NIXL, ZMQ, torch or vLLM (see ``kvxfer.protocol``).
"""

from __future__ import annotations

import msgspec

from kvxfer.protocol.base import _Msg
from kvxfer.protocol.engine import EngineRequest, SidecarEvent
from kvxfer.protocol.peer import HandshakeReply, HandshakeRequest, ReadNotice

# --------------------------------------------------------------------------- codecs

# Everything a decoder may raise on hostile bytes: msgspec's own errors, ValueError
# subclasses it lets through (UnicodeDecodeError for invalid UTF-8 in a str field), and
# RecursionError for nesting deeper than the interpreter's limit (msgspec checks the depth
# itself and raises it cleanly: 5,000 nested arrays used to end the sidecar's engine loop).
DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, ValueError, RecursionError)

_encoder = msgspec.msgpack.Encoder()


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


engine_request_decoder = msgspec.msgpack.Decoder(EngineRequest)
sidecar_event_decoder = msgspec.msgpack.Decoder(SidecarEvent)
handshake_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
handshake_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)
read_notice_decoder = msgspec.msgpack.Decoder(ReadNotice)
