"""Is a peer sidecar stalled? Pure bookkeeping of one peer link, no I/O (#37).

A peer is *stalled* when it owes this sidecar an answer (a claim, a keep-alive's renewal,
a probe) and has said nothing at all for ``stall_s``: a live sidecar answers a renewal in
milliseconds, even loaded, because its loop does nothing slow. A stopped process
(SIGSTOP, a frozen cgroup), a wedged loop or a half-open connection looks like this; a
slow network does not (anything heard resets the clock). A peer that owes nothing cannot
be judged: while reads from it run it is *probed* after ``stall_s / 4`` of silence, so a
peer that froze after answering a read's claim, whose read now never ends (in UCX peer
mode a READ completes only once its target progresses), is found as fast. A link nothing
uses is probed too, after --peer-idle-probe-s: a peer that died or moved away then owes an
answer, and what is kept for it (the link, its book entry, its NIXL agent) is let go.

The link (``peer_link.PeerLink``) feeds it: ``asked`` when a request goes out,
``answered`` / ``heard`` when a frame comes in, ``dropped`` when a caller stopped waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Liveness:
    stall_s: float  # 0: never judged stalled, never probed
    heard_at: float  # monotonic: the last frame from the peer (or the link's opening)
    owed: dict[int, float] = field(default_factory=dict)  # seq -> when it was asked
    asked_at: float = 0.0  # the last request sent

    def asked(self, seq: int, now: float) -> None:
        self.owed[seq] = now
        self.asked_at = now

    def answered(self, seq: int, now: float) -> None:
        self.owed.pop(seq, None)
        self.heard_at = now

    def heard(self, now: float) -> None:
        """A frame that answers no request of ours in particular (a refusal)."""
        self.heard_at = now

    def dropped(self, seq: int) -> None:
        """Its caller stopped waiting: nobody is owed that answer any more."""
        self.owed.pop(seq, None)

    def silent_s(self, now: float) -> float:
        """How long the peer has said nothing while it owed an answer (0: it owes none)."""
        if not self.owed:
            return 0.0
        return max(0.0, now - max(self.heard_at, min(self.owed.values())))

    def stalled(self, now: float) -> bool:
        return self.stall_s > 0 and self.silent_s(now) >= self.stall_s

    def probe_due(self, now: float, after_s: float = 0.0) -> bool:
        """Nothing owed, and neither a word from it nor a request to it for ``after_s`` (by
        default stall_s / 4, for a peer that reads run against): a probe now makes it owe one."""
        return (self.stall_s > 0 and not self.owed
                and now - max(self.heard_at, self.asked_at) >= (after_s or self.stall_s / 4))
