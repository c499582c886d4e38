"""The lease words' own NIXL agent lets go of a peer the main agent removed, even when that
peer's removal was refused at first (a word read still in flight): it stayed loaded, and
could still be read, until the peer came back, if ever (found by a review)."""

from __future__ import annotations

from typing import Any

import pytest

from kvxfer.sidecar.nixl_reads import ProofScratch


class Agent:
    """Stands in for the inline NIXL agent: a removal is refused while ``busy``."""

    def __init__(self) -> None:
        self.busy = False
        self.loaded: set[str] = set()

    def register_memory(self, *_a: Any) -> object:
        return object()

    def add_remote_agent(self, metadata: bytes) -> None:
        self.loaded.add(metadata.decode())

    def remove_remote_agent(self, name: str) -> None:
        if self.busy:
            raise RuntimeError("a transfer is in flight")
        self.loaded.discard(name)


def test_a_refused_removal_is_done_later_and_nothing_is_read_from_it_meanwhile() -> None:
    agent = Agent()
    scratch = ProofScratch(None, 4, inline=agent)
    scratch.add_peer("p", b"p")
    agent.busy = True
    scratch.remove_peer("p")  # (refused: a word read in flight)
    assert "p" in agent.loaded
    with pytest.raises(RuntimeError, match="not loaded"):  # (no word read from a removed peer)
        scratch.post(0, 0x1000, "p")
    agent.busy = False
    scratch.retry()
    assert "p" not in agent.loaded, "the removed peer stays loaded for good"


def test_a_peer_added_again_while_its_removal_waits_is_read_again() -> None:
    agent = Agent()
    scratch = ProofScratch(None, 4, inline=agent)
    scratch.add_peer("p", b"p")
    agent.busy = True
    scratch.remove_peer("p")
    scratch.add_peer("p", b"p")  # (the same process handshakes again)
    agent.busy = False
    scratch.retry()
    assert "p" in agent.loaded
