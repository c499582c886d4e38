"""What the NIXL port is configured with and what it reports: plain data, no NIXL."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferOptions:
    ucx_error_mode: str = "peer"  # "peer" surfaces remote failures on RDMA; "none" is faster on CMA
    num_threads: int = 0  # UCX backend worker threads (0: copy inside transfer())
    chunk_bytes: int = 64 << 20  # largest single NIXL request posted at once
    max_inflight_chunks: int = 8
    merge_runs: bool = True  # consecutive blocks as one descriptor per run (plan.merge_runs)
    busy_poll_s: float = 50e-6  # first back-off step while reads are in flight
    active_poll_s: float = 5e-4  # longest step while reads are in flight or peers may read
    idle_poll_s: float = 2e-3  # poll period when nothing is in flight (notification latency)
    cuda: bool = False  # VRAM over CUDA IPC expected: UCX memtype cache off
    settle_timeout_s: float = 20.0  # a failed read's in-flight chunks must stop by then
    expect_read_s: float = 2e-3  # after a claim, poll at busy_poll_s this long (expect_reads)
    inline_bytes: int = 4 << 20  # reads up to this size are posted by the caller itself (NixlPort.read)
    inline_alone_bytes: int = 0  # and up to this size when the caller is alone (ReadSpec.alone)
    staging_bytes: int = 0  # the host staging arena (kvxfer.sidecar.nixl_staging); 0: none
    vram_staging_bytes: int = 0  # with cuda: an arena of this size per CUDA device; 0: none
    lease_words: tuple[int, int] = (0, 0)  # (address, bytes) of this sidecar's lease words, registered
    proof_slots: int = 4096  # 16-byte landing slots for the lease words this sidecar reads
    notice_fences: bool = True  # a 16-byte READ after each notification (kvxfer.sidecar.nixl_fences)


class PollPolicy:
    """How often the NIXL thread polls (``NixlPort``'s module docstring says why)."""

    def __init__(self, options: TransferOptions) -> None:
        self.options = options
        self.serving = False  # blocks are held for peers to read (poll at the active period)
        self.hot_until = 0.0  # poll at busy_poll_s until then (expect)

    def expect(self, now: float) -> bool:
        """A peer claimed held blocks: its READ is about to start, and in UCX peer mode a READ
        may complete only once its target (this agent) makes progress (measured here: every
        other READ after a NIXL notification waits for it). Poll at the busy period for
        ``expect_read_s``, starting now (in UCX's "none" mode READs need no target progress).
        Whether to wake the thread now."""
        if self.options.expect_read_s <= 0 or self.options.ucx_error_mode != "peer":
            return False
        self.hot_until = now + self.options.expect_read_s
        return True

    def serve(self, serving: bool) -> bool:
        """Whether to wake the thread now (serving started)."""
        wake = serving and not self.serving
        self.serving = serving
        return wake

    def next_delay(self, now: float, delay: float, progressed: bool, reads: int) -> float:
        o = self.options
        if now < self.hot_until:
            return o.busy_poll_s
        if reads:
            return o.busy_poll_s if progressed else min(delay * 2, o.active_poll_s)
        return o.active_poll_s if self.serving else o.idle_poll_s


@dataclass(frozen=True)
class ReadFinished:
    req_id: str
    peer: str
    ok: bool
    nbytes: int
    seconds: float
    code: str = ""
    reason: str = ""
    descriptors: int = 0
    trace: tuple[tuple[str, int], ...] = ()  # the NIXL thread's hops (traced reads only)
    proof: tuple[int, int] | None = None  # its lease word, read after it landed (lease_words)


@dataclass(frozen=True)
class ReadStuck:
    """A failed read whose chunks still run after settle_timeout_s: no way to stop them."""

    req_id: str
    peer: str
    seconds: float


@dataclass(frozen=True)
class NoticeReceived:
    agent: str
    payload: bytes


@dataclass(frozen=True)
class ReadRefused:
    """A read handed to the NIXL thread that could not start there (its plan or its lists
    failed): nothing was posted."""

    req_id: str
    error: BaseException


Event = ReadFinished | NoticeReceived | ReadStuck | ReadRefused
