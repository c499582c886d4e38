"""Lease words: a proof that a lease held after a read landed, without a round trip (#38).

A read is delivered only with proof that the prefill still held the blocks after the data
landed: then nothing could have reused them while they were read (the prefill engine was
told of the hold before the decode could even name the request, and it reuses held blocks
only once told they are released). The claim (``kvxfer.sidecar.claim``) proves it with a
round trip to the prefill sidecar (~0.5 ms here), which a small read waits for.

A lease word proves it with one 16-byte NIXL READ instead, posted once the data landed. The
prefill sidecar keeps a table of words in memory registered with its NIXL agent (advertised
in its ``Welcome``): a lease on a request that has a token is written into slot ``tag %
slots`` as ``(tag, engine deadline)`` when it is held, and zeroed *before* its ``Released``
is sent, whichever way it ends. ``tag`` is a keyed hash of the request (the token is the
key: no other peer can compute it, and a retried hold of the request gets another token);
the engine deadline is ``Hold.expires_unix``, when the prefill engine frees the blocks on its
own if its sidecar says nothing (frozen: its memory still answers READs). The reader
computes the same tag, reads the slot after its data landed, and trusts the read when it
holds its tag and the deadline is more than ``MARGIN_S`` away on its own clock (hosts'
clocks agree to well within that). Anything else (a slot taken by another lease, a word
read that fails, an older prefill without a table) proves nothing: the claim, sent as
before, decides.

Pure bookkeeping over a numpy array: the NIXL port registers its memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

import numpy as np

WORD_BYTES = 16  # (tag, deadline in unix milliseconds), little-endian u64 each
MARGIN_S = 2.0  # a deadline closer than this (reader's clock) proves nothing
NO_DEADLINE = (1 << 63) - 1
DEFAULT_SLOTS = 1 << 16  # 1 MiB: collisions among 1,000 held requests ~1.5 % (those use the claim)


def lease_tag(engine: str, req_id: str, token: str) -> int:
    """The request's tag (0: no token, no tag); never 0 otherwise."""
    if not token:
        return 0
    h = hashlib.blake2b(f"{engine}\0{req_id}".encode(), key=token.encode()[:64], digest_size=8)
    return int.from_bytes(h.digest(), "little") | 1


def deadline_ms(expires_unix: float) -> int:
    return int(expires_unix * 1000) if expires_unix > 0 else NO_DEADLINE


def proves(word: tuple[int, int], tag: int, now_unix: float, margin_s: float = MARGIN_S) -> bool:
    """Whether a word read after the data landed proves the lease still held then."""
    return tag != 0 and word[0] == tag and now_unix + margin_s < word[1] / 1000


class LeaseWords:
    def __init__(self, slots: int = DEFAULT_SLOTS) -> None:
        self.slots = slots
        self.mem = np.zeros(2 * slots, dtype=np.uint64)  # registered with NIXL by the port
        self._slot_of: dict[Hashable, int] = {}
        self._holder: dict[int, Hashable] = {}
        self.collisions = 0

    @property
    def addr(self) -> int:
        return int(self.mem.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.mem.nbytes)

    def put(self, key: Hashable, tag: int, deadline: int) -> bool:
        """Publish a held lease (False: no tag, or its slot belongs to another lease). A lease
        published already under this tag gets the new deadline (a prompt held in chunks: each
        chunk's Hold renews its engine's deadline; it kept the first, and a long prefill's
        reads were refused past it: found by a review)."""
        if not tag:
            return False
        if (mine := self._slot_of.get(key)) is not None:
            if int(self.mem[2 * mine]) != tag:
                return False
            self.mem[2 * mine + 1] = np.uint64(deadline)
            return True
        slot = tag % self.slots
        if slot in self._holder:
            self.collisions += 1
            return False
        self.mem[2 * slot + 1] = np.uint64(deadline)  # (the deadline first: a reader that sees
        self.mem[2 * slot] = np.uint64(tag)  # the tag sees its deadline)
        self._slot_of[key] = slot
        self._holder[slot] = key
        return True

    def clear(self, key: Hashable) -> None:
        """The lease ended: zero its word (before the engine is told)."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return
        self.mem[2 * slot] = 0
        self.mem[2 * slot + 1] = 0
        del self._holder[slot]

    def word(self, key: Hashable) -> tuple[int, int] | None:
        slot = self._slot_of.get(key)
        return None if slot is None else (int(self.mem[2 * slot]), int(self.mem[2 * slot + 1]))

    def __len__(self) -> int:
        return len(self._slot_of)
