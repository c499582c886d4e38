"""What the NIXL port keeps beside its agent: the host memory registered before any
handshake (``host_extras``), and per peer it loads, the lease word reader and the fences
(``PeerExtras``)."""

from __future__ import annotations

import logging
from typing import Any

from kvxfer.sidecar.nixl_agent import create_agent
from kvxfer.sidecar.nixl_fences import Fences
from kvxfer.sidecar.nixl_reads import ProofScratch
from kvxfer.sidecar.nixl_staging import Arenas, warm_copies
from kvxfer.sidecar.nixl_types import TransferOptions

log = logging.getLogger("kvxfer.transfer")


class PeerExtras:
    """Loaded and unloaded with each peer of the main agent: the agent that reads lease words
    (``ProofScratch``, when there is one) and the fences after notifications (``Fences``, which
    send them)."""

    def __init__(self, scratch: ProofScratch | None, fences: Fences) -> None:
        self.scratch, self.fences = scratch, fences

    def loaded(self, name: str, metadata: bytes, words_addr: int) -> None:
        self.fences.target(name, words_addr)
        if self.scratch is not None:
            self.scratch.add_peer(name, metadata)

    def unloaded(self, name: str) -> None:
        if self.scratch is not None:
            self.scratch.remove_peer(name)
        self.fences.forget(name)

    def close(self) -> None:
        if self.scratch is not None:
            self.scratch.close()
        self.fences.close()


def host_extras(agent: Any, options: TransferOptions, name: str = "") -> tuple[PeerExtras, Arenas]:
    """Host memory registered before any handshake (so every Welcome's metadata covers it):
    the lease words this sidecar publishes, where the words it reads land (with an agent of
    their own, ``name``-words, that copies inline: ``ProofScratch``), and the staging arenas
    (host memory now; with CUDA, one per device as its first rank registers), and where
    fences land (host memory and UCX peer mode only: ``kvxfer.sidecar.nixl_fences``)."""
    addr, nbytes = options.lease_words
    if nbytes:
        agent.register_memory([(addr, nbytes, 0, "")], "DRAM")
    host = not options.cuda
    scratch = None
    if options.proof_slots > 0 and host:
        inline = None
        if name and options.num_threads > 0:  # (without worker threads the main agent copies inline)
            try:
                inline = create_agent(f"{name}-words", options.ucx_error_mode, 0)
            except Exception as e:
                log.warning("no agent of their own for lease word reads (%s): the main agent reads them", e)
        try:
            scratch = ProofScratch(agent, options.proof_slots, inline)
        except Exception as e:  # (its memory not registered with it: the main agent reads the words)
            log.warning("lease word reads by the main agent: %s", e)
            scratch = ProofScratch(agent, options.proof_slots)
    arenas = Arenas(agent, options.staging_bytes * host, options.vram_staging_bytes * (not host))
    warm_copies(arenas)  # (at start: a staged read in the import's second would wait for it)
    fences = Fences(agent, options.notice_fences and host and options.ucx_error_mode == "peer")
    return PeerExtras(scratch, fences), arenas
