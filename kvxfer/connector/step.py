"""What one engine step's connector metadata tells the workers (the scheduler builds it).
vLLM-free."""

from __future__ import annotations

from dataclasses import dataclass, field

# a request finished with these statuses has its prefill blocks held for a decode
FINISHED_OK = {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"}


@dataclass
class StepPlan:
    """What this step's connector metadata tells the workers."""

    recvs: dict[str, tuple[list[int], float]] = field(default_factory=dict)  # id -> (blocks, deadline)
    holds: dict[str, float] = field(default_factory=dict)  # id -> deadline
    failed: dict[str, list[int]] = field(default_factory=dict)  # loads that could not be posted
    # loads a sidecar refused to a rank not registered with it yet (its Failed came here):
    # request id -> the (pp, tp) ranks whose worker fails it now
    refused: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # push mode (prefill): the lease id (the transfer id) -> vLLM's request id, and the
    # leases whose prompt this step computes (each layer computed is reported)
    names: dict[str, str] = field(default_factory=dict)
    streamed: list[str] = field(default_factory=list)
    # leases whose Hold the sidecar refused (no lease was made, no Released will come): the
    # workers free their blocks now (a live sidecar's refusal, draining, pinned them for ever)
    unheld: list[str] = field(default_factory=list)
    # push mode (prefill), a prompt computed in chunks: the lease -> its blocks computed whole
    # once this step's chunk is (reported by the workers when the forward is over)
    chunks: dict[str, int] = field(default_factory=dict)
    # push mode (prefill): leases whose Hold this step extends (a chunk's): a worker that saw
    # the lease end already does not hold it again (no Released would come: found by a review)
    extended: list[str] = field(default_factory=list)
