"""Whether a request may start: the checks an engine's ``Hold`` and ``Recv`` and a peer's
``DigestRequest`` pass before anything is held, read or digested.

Pure: the caller looks up what the checks need (the registered layout, whether the sidecar
drains, whether the engine gave the request up at a restart, the wall clock) and passes it
in; a refusal raises ``RequestError`` with the code the sender sees. Nothing here reads a
clock, a socket or the registry.
"""

from __future__ import annotations

from collections.abc import Callable

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import DigestRequest, Hold, KVLayout, Recv


def check_blocks(req_id: str, block_ids: list[int], num_blocks: int, side: str) -> None:
    """Every block id inside ``[0, num_blocks)`` (the wire type already forbids negatives)."""
    bad = [b for b in block_ids if b >= num_blocks]
    if bad:
        raise RequestError(ErrorCode.BLOCK_OUT_OF_RANGE,
                           f"{side} block ids {bad[:8]} outside [0, {num_blocks})", req_id)


def admit_hold(msg: Hold, engine: str, num_blocks: int | None, *, draining: bool, abandoned: bool,
               now_unix: float, registered: Callable[[], list[str]], missing: int = 0) -> None:
    """A prefill engine's Hold. ``num_blocks``: the fewest blocks of the engine's registered
    ranks (None: none registered); ``abandoned``: the engine freed these blocks when this
    sidecar restarted (``kvxfer.abandoned``); ``registered``: the engines that are (asked only
    for the refusal's message: the hot path does not pay for it); ``missing``: how many of the
    engine's tp x pp ranks are not registered (yet: after a restart they come one by one, and
    a rank registered after the lease ended would never get its ``Released``: the engine kept
    those blocks for ever, found by a review; refused, the connector frees them at once)."""
    if draining:
        raise RequestError(ErrorCode.DRAINING, "sidecar is draining; no new holds", msg.req_id)
    if num_blocks is None:
        raise RequestError(ErrorCode.NOT_REGISTERED, f"engine {engine!r} has no KV cache registered "
                           f"(registered: {registered()})", msg.req_id)
    if missing > 0:
        raise RequestError(ErrorCode.NOT_REGISTERED, f"{missing} rank(s) of engine {engine!r} are not "
                           "registered (yet): not held", msg.req_id)
    check_blocks(msg.req_id, msg.block_ids, num_blocks, "held")
    if msg.groups is not None:  # (push mode, several KV cache groups: what a decode pairs with)
        held = set(msg.block_ids)
        stray = [b for g in msg.groups for b in g if b and b not in held]
        if stray:
            raise RequestError(ErrorCode.MALFORMED, f"blocks {stray[:8]} in the hold's groups are not "
                               "among its blocks", msg.req_id)
    if msg.expires_unix and now_unix > msg.expires_unix:
        raise RequestError(ErrorCode.EXPIRED, "hold arrived after the engine freed its blocks "
                           f"({now_unix - msg.expires_unix:.1f}s late)", msg.req_id)
    if abandoned:
        raise RequestError(ErrorCode.EXPIRED, "the engine freed these blocks when this sidecar "
                           "restarted; not held", msg.req_id)


def admit_recv(msg: Recv, engine: str, local: KVLayout | None, *, draining: bool, abandoned: bool,
               now_unix: float, registered: Callable[[], str]) -> None:
    """A decode engine's Recv for one local rank. ``local``: that rank's layout (None: not
    registered); ``registered``: what is, for the message."""
    if draining:
        raise RequestError(ErrorCode.DRAINING, "sidecar is draining; no new receives")
    if local is None:
        raise RequestError(ErrorCode.NOT_REGISTERED,
                           f"rank pp{msg.pp_rank}/tp{msg.tp_rank} of engine {engine!r} not "
                           f"registered (registered: {registered()})")
    check_blocks(msg.req_id, msg.block_ids, local.num_blocks, "local")
    s_local, s_remote = msg.state_pairs
    check_blocks(msg.req_id, s_local, local.num_blocks, "local")
    if len(s_local) != len(s_remote):
        raise RequestError(ErrorCode.MALFORMED, f"{len(s_local)} local state blocks "
                           f"for {len(s_remote)} remote ones", msg.req_id)
    if s_local and not local.state_regions:
        raise RequestError(ErrorCode.INVALID_LAYOUT, "state blocks to receive, but this rank "
                           "registered no state layers", msg.req_id)
    if msg.expires_unix and now_unix > msg.expires_unix:
        raise RequestError(ErrorCode.EXPIRED, "receive arrived after the engine gave up on it "
                           f"({now_unix - msg.expires_unix:.1f}s late); not read")
    if abandoned:
        raise RequestError(ErrorCode.EXPIRED, "the engine gave this load up (when this sidecar "
                           "restarted, or its Cancel came first); not read")


def recv_deadline_s(msg: Recv, now_unix: float, default_s: float) -> float:
    """How long a receive may take: never past the moment its engine gives up on the load
    (``expires_unix``: then its own deadline if shorter, and never less than 1 ms), else
    its own deadline or the default."""
    if msg.expires_unix:
        left = max(0.001, msg.expires_unix - now_unix)
        return min(msg.deadline_s or left, left)
    return msg.deadline_s or default_s


def recv_bytes(local: KVLayout, block_bytes: int, msg: Recv) -> int:
    """Bytes a receive writes into this rank: its blocks in the attention regions (one
    block's bytes there: ``block_bytes``) and its state blocks in the state regions."""
    state = local.state_regions * local.state_bytes * len(msg.state_pairs[0])
    return block_bytes * len(msg.block_ids) + state


def admit_digest(req: DigestRequest, held: set[int], engine_ranks: int,
                 block_len: Callable[[int, int, int], int | None]) -> None:
    """A peer's request for digests of blocks held for it: only those blocks, each rank's
    regions once, and no more work than a read of the held blocks could ask for.
    ``block_len(pp, tp, region0)``: the bytes of one block in that region of a registered
    rank (None: the rank is not registered, 0: no such region)."""
    if (len({(r.pp_rank, r.rank, r.region0) for r in req.ranks}) != len(req.ranks)
            or len(req.ranks) > 2 * engine_ranks):  # (KV and state regions of a rank)
        raise RequestError(ErrorCode.MALFORMED, "each registered rank's regions at most once")
    for r in req.ranks:
        if any(b not in held for item in r.items for b in item.blocks):
            raise RequestError(ErrorCode.BLOCK_OUT_OF_RANGE, "digest of blocks the request does not hold")
        if any(len(run) != 2 or run[1] <= 0 for item in r.items for run in item.runs):
            raise RequestError(ErrorCode.MALFORMED, "a digest run is [offset, length > 0]")
        length = block_len(r.pp_rank, r.rank, r.region0)
        if length is None:
            raise RequestError(ErrorCode.NOT_REGISTERED, f"rank pp{r.pp_rank}/tp{r.rank} is not registered")
        # (each block once per block-size sub-position, each item's runs within one block)
        if (sum(len(item.blocks) for item in r.items) > 16 * len(held)
                or any(sum(n for _, n in item.runs) > length for item in r.items)):
            raise RequestError(ErrorCode.MALFORMED, "digest request larger than the held blocks")
        if any(off + n > length for item in r.items for off, n in item.runs):
            raise RequestError(ErrorCode.MALFORMED, f"a digest run ends beyond a {length}-byte block")
