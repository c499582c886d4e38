"""Scheduler-side connector logic: one control message per request, sent the moment
the scheduler knows it. vLLM objects are duck-typed (``request.request_id``,
``request.kv_transfer_params``, ``request.status``); nothing here imports vLLM.

Why the scheduler and not the workers drives transfers: on decode the ``Recv`` leaves in
``update_state_after_alloc``, a whole engine step before a worker's ``start_load_kv``
could send it (NixlConnector's timing), and it is one message per request per rank from
one place instead of one per worker. On prefill the ``Hold`` leaves in
``request_finished``, so the lease starts when the blocks stop changing. Workers still
register their own memory and report their own rank's completions (vLLM's
``KVOutputAggregator`` counts one report per worker): the sidecar routes ``Done`` /
``Failed`` to the worker that registered the rank and ``Released`` to every worker.
Each message is mirrored into the step's connector metadata with a deadline, so a
worker can fail or release on its own if the sidecar dies and never answers.

A sidecar outage never raises into vLLM's scheduler: a ``Recv`` that cannot be sent at all
fails its load at once (vLLM recomputes), a ``Hold`` that cannot be sent frees the blocks at
once (no kv_transfer_params: the decode computes the prompt), heartbeat and drain errors
are logged. Every message carries the wall-clock moment the engine gives up on it
(``expires_unix``), so one queued while the sidecar was frozen is refused when it arrives
late instead of reading into, or holding, blocks the engine has reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

from kvxfer.auth import new_token
from kvxfer.client import SEND_ERRORS, Drained, GroupedLoad, RemoteBlocks, SidecarClient
from kvxfer.connector.groups import Pairs, held_blocks
from kvxfer.connector.loads import pair_load, unpaired
from kvxfer.connector.params import InvalidTransferParams, parse_push, parse_remote, transfer_id_of
from kvxfer.connector.push import StreamedHolds
from kvxfer.connector.settings import ConnectorSettings
from kvxfer.connector.step import FINISHED_OK, StepPlan
from kvxfer.errors import ErrorCode
from kvxfer.protocol import Cancel

log = logging.getLogger(__name__)
# A Hold refused with one of these made no lease (nothing else the scheduler sends under a
# lease's name is refused so: a Release of an ended lease is UNKNOWN_REQUEST)
HOLD_REFUSED = frozenset({ErrorCode.DRAINING, ErrorCode.NOT_REGISTERED, ErrorCode.BLOCK_OUT_OF_RANGE,
                          ErrorCode.EXPIRED, ErrorCode.MALFORMED,
                          # (the sender does not speak for the engine: e.g. Ray workers without
                          # engine_ownership uid; every hold pinned its blocks: found by a review)
                          ErrorCode.UNAUTHORIZED})


class SentHolds:
    """The holds this scheduler sent, until their engine-side deadline: one the sidecar
    refused made no lease, so no Released will come, and its blocks are freed at once
    (``StepPlan.unheld``; a live sidecar's refusal, draining, pinned them for ever: found by
    a review). vLLM-free."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._next_prune = 0.0

    def refused(self, errors: list[Any], plan: StepPlan, now: float) -> list[Any]:
        """Record ``plan``'s holds; move the refused ones into ``plan.unheld``; the other errors.
        (Every engine step: what is past its deadline is dropped once a second, not each step.)"""
        self._until.update(plan.holds)
        if now >= self._next_prune:
            self._next_prune = now + 1.0
            self._until = {r: d for r, d in self._until.items() if d > now}
        if not errors:
            return errors
        rest = []
        for ev in errors:
            if ev.code in HOLD_REFUSED and self._until.pop(ev.req_id, None) is not None:
                plan.unheld.append(ev.req_id)
                log.warning("sidecar refused to hold %s ([%s] %s): its blocks are freed, the decode "
                            "will compute the prompt", ev.req_id, ev.code, ev.message)
            else:
                rest.append(ev)
        return rest


def fail_unposted(plan: StepPlan, req_id: str, block_ids: Any, tokens: int) -> None:
    """A load of ``tokens`` vLLM waits for that will not be posted: failed, every block it was
    given (one list, or one per group), so vLLM computes the prompt (none: nothing to fail)."""
    if tokens > 0:
        plan.failed[req_id] = [b for g in block_ids for b in (g if isinstance(g, list | tuple) else [g]) if b]


class SchedulerSide:
    def __init__(
        self, settings: ConnectorSettings, tp_size: int, client: SidecarClient | None = None, *,
        engine_id: str = "", pp_size: int = 1,
    ) -> None:
        self.settings = settings
        self.tp_size = tp_size
        self.backoff = 0  # prompt tokens the prefill leaves to the decode (windowed or state groups)
        self.block_size = 0  # tokens per block, one KV cache group (0: the prefill's lists are not cut)
        self.grouped = False  # block ids travel per KV cache group (Groups.grouped)
        self.state_groups: tuple[bool, ...] = ()  # per transferable group: a state (Mamba/GDN) group
        self.state_split = ""  # how the state splits over TP ranks (StateSplit.signature; "": it does not)
        self._hetero_warned: set[str] = set()  # prefill engines of another TP size (state models)
        self.pp_size = pp_size  # each (pp, tp) worker receives its own layers and reports its own Done
        self.client = client or SidecarClient(settings.sidecar, send_queue=settings.send_queue,
                                              ring=settings.engine_channel == "ring")
        pong = self.client.ping(settings.sidecar_timeout_s)
        self.local_engine = engine_id  # vLLM's ("<id>_dp<k>": DP): keys ranks, holds, receives ("": ours)
        self.engine_id = engine_id or pong.engine_id
        self.handshake_host = pong.handshake_host
        self.handshake_port = pong.handshake_port
        self.generation = pong.generation  # the sidecar's registrations (kv_transfer_params)
        self.grouped_push = pong.grouped_streams  # it pairs a push load's groups (Recv.groups)
        self._claimed: dict[str, int] = {}  # push loads: the prompt tokens claimed from the prefill
        self._remote: dict[str, RemoteBlocks] = {}  # decode requests with usable params
        self._waiting: dict[str, RemoteBlocks] = {}  # ... not given blocks yet: their leases are kept alive
        self._next_keepalive = time.monotonic() + settings.keepalive_period_s
        self._plan = StepPlan()
        self._loads: dict[str, float] = {}  # loads posted, until their engine-side deadline
        self._holds_sent = SentHolds()
        self._next_prune = 0.0
        self._next_heartbeat = time.monotonic() + settings.heartbeat_s
        self.errors: dict[str, str] = {}  # request id -> why its params were refused
        self.push = StreamedHolds(settings, self.client, tp_size, engine_id, pong)  # (prefill)

    # ---------------------------------------------------------------- decode side

    def _remote_for(self, request: Any) -> RemoteBlocks | None:
        req_id = request.request_id
        if req_id in self._remote:
            return self._remote[req_id]
        if req_id in self.errors:
            return None
        params = request.kv_transfer_params
        try:
            streamed = self.settings.mode == "push" and params.get("remote_block_ids") is None
            remote = parse_push(params) if streamed else parse_remote(params)
        except InvalidTransferParams as e:
            self.errors[req_id] = str(e)
            log.warning("request %s: %s; computing the prompt locally", req_id, e)
            return None
        self._remote[req_id] = remote
        return remote

    def on_new_request(self, request: Any) -> None:
        """A prefill request (``do_remote_decode``) stops ``backoff`` tokens short of its
        prompt, once (a preempted request comes back here)."""
        params = request.kv_transfer_params
        b = self.backoff
        if not b or not params or not params.get("do_remote_decode") or params.get("_kvxfer_backoff"):
            return
        skip = getattr(request, "get_skip_reading_prefix_cache", None)
        if request.num_prompt_tokens <= b or request.prompt_token_ids is None or (skip and skip()):
            return
        del request.prompt_token_ids[-b:]
        del request._all_token_ids[-b:]  # (vLLM's own list behind all_token_ids)
        request.num_prompt_tokens -= b
        request.max_tokens = 1
        params["_kvxfer_backoff"] = b

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        remote = self._remote_for(request)
        if remote is None:
            return 0, False
        if any(self.state_groups) and not splits_alike(self.state_split, params, remote, self.tp_size):
            # (a state that cannot move between these TP sizes: computed here, not claimed and failed)
            warn_once(self._hetero_warned, remote.engine_id, "prefill engine %s runs TP %d, this one TP %d; "
                      "their states do not split alike: computing prompts here", remote.tp_size, self.tp_size)
            return 0, False
        computed = params.get("remote_num_tokens")
        prompt = len(request.prompt_token_ids or ())
        if computed is None and remote.streamed:  # (push: the prefill computes what this engine
            computed = max(prompt - self.backoff, 0)  # loads; its sidecar is asked, Recv.num_tokens)
            if self.grouped and not self.grouped_push:  # (a sidecar that would read it as one group)
                log.warning("request %s: an older sidecar, no push of several KV cache groups; computing "
                            "it here", request.request_id)
                return 0, False
        n = self._claimed[request.request_id] = tokens_to_load(prompt, self.backoff, computed,
                                                               any(self.state_groups), self.grouped)
        if n < 0:
            log.info("request %s: the prefill computed %s tokens, this engine would load %d (a state, or "
                     "several groups): computing the prompt here", request.request_id, computed, -n)
        count, groups = n - num_computed_tokens, len(self.state_groups) or 1  # (a flag per group moved)
        if count > 0 and (why := unpaired(remote, self.block_size, num_computed_tokens, groups)):
            log.warning("request %s: %s; computing the prompt here", request.request_id, why)
            self.errors[request.request_id] = why
            return 0, False  # (its update_state_after_alloc, 0 tokens: the prefill is told to release)
        if count > 0:
            self._waiting[request.request_id] = remote  # until it gets blocks: keep its lease alive
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Any, unhashed_block_ids: list[int] | list[list[int]], num_external_tokens: int
    ) -> None:
        """``unhashed_block_ids``: this engine's new blocks, or for a hybrid model one list
        per KV cache group (each sliding-window group already cut to its window)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        self._waiting.pop(request.request_id, None)  # from now on its read claims the lease
        remote = self._remote_for(request)
        if remote is None:  # (params refused, or its lease expired while it waited: found by a review)
            return fail_unposted(self._plan, request.request_id, unhashed_block_ids, num_external_tokens)
        if num_external_tokens == 0:
            # Full local prefix hit: nothing to read, but the prefill side still holds.
            release_remote(self.client, self._ranks(), self.local_engine, request.request_id, remote)
            return
        hybrid = bool(unhashed_block_ids) and isinstance(unhashed_block_ids[0], list | tuple)
        mine = [list(g) for g in unhashed_block_ids] if hybrid else [list(unhashed_block_ids)]  # type: ignore[arg-type]
        # the prefill's block size as it said it (kv_transfer_params), else taken to be this one's
        remote = dataclasses.replace(remote, block_size=remote.block_size or self.block_size)
        try:
            pairs = pair_load(mine, remote, self.state_groups if hybrid else None, self.block_size,
                              self._claimed.get(request.request_id, 0), num_external_tokens)
        except ValueError as e:
            self.errors[request.request_id] = str(e)
            log.warning("request %s: %s; computing the prompt locally", request.request_id, e)
            release_remote(self.client, self._ranks(), self.local_engine, request.request_id, remote)
            fail_unposted(self._plan, request.request_id, mine, 1)
            return
        local = pairs.local + pairs.state_local  # every block the load writes
        grouped = None
        claimed = self._claimed.pop(request.request_id, 0)
        if remote.streamed and hybrid:  # (its sidecar pairs them, the state too, and may write fewer)
            local = [b for g in mine for b in g if b]
            grouped = GroupedLoad(mine, list(self.state_groups), claimed)
        give_up = self.settings.transfer_timeout_s + self.settings.grace_s
        if not post_loads(self.client, self.settings, self._ranks(), request.request_id, pairs, remote,
                          grouped, self.local_engine, time.time() + give_up, self._plan):
            self._plan.failed[request.request_id] = local  # (nothing was sent: vLLM recomputes)
            return
        self._plan.recvs[request.request_id] = (local, time.monotonic() + give_up)
        self._loads[request.request_id] = time.monotonic() + give_up

    def _decode_finished(self, req_id: str, params: dict[str, Any], remote: RemoteBlocks | None, status: str,
                         error: str | None) -> dict[str, Any] | None:
        """A decode's request ended. Before it got blocks (aborted while waiting): the prefill is
        told to release. With its load running and not finished well (an abort): ``Cancel``."""
        if params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False
            with contextlib.suppress(InvalidTransferParams):  # (a push request's: parse_push, kept)
                release_remote(self.client, self._ranks(), self.local_engine, req_id,
                               remote or parse_remote(params))
        elif req_id in self._loads and status not in FINISHED_OK:
            try:  # (a load that ended already: the sidecar has nothing to cancel)
                self.client.send(Cancel(req_id=req_id, engine_id=self.local_engine))
            except SEND_ERRORS as e:  # its deadline ends it
                log.warning("request %s: cancel of its KV load not sent: %s", req_id, e)
        return {"kvxfer_error": error} if error else None

    def loads_ended(self, req_ids: set[str] | None) -> None:
        """Loads the workers reported (``finished_recving``): an abort after them cancels nothing."""
        for req_id in req_ids or ():
            self._loads.pop(req_id, None)

    def _ranks(self) -> list[tuple[int, int]]:
        """(pp, tp) of every worker: each receives into its own memory."""
        return [(pp, tp) for pp in range(self.pp_size) for tp in range(self.tp_size)]

    # ---------------------------------------------------------------- prefill side

    def request_finished(
        self, request: Any, block_ids: list[int] | list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks, or for a hybrid model one list per KV cache
        group (sliding-window groups cut to their window): the hold covers every real block,
        and the params carry the lists as they are (positions matter to the decode)."""
        params = request.kv_transfer_params
        req_id = request.request_id
        remote = self._remote.pop(req_id, None)
        self._waiting.pop(req_id, None)
        self._claimed.pop(req_id, None)
        error = self.errors.pop(req_id, None)
        status = getattr(request.status, "name", str(request.status))
        if not params:
            return False, None
        if not params.get("do_remote_decode"):  # (a decode's request)
            return False, self._decode_finished(req_id, params, remote, status, error)
        if error:
            return False, {"kvxfer_error": error}
        if self.push.held(req_id):
            return self.push.finish(request)
        grouped = bool(block_ids) and isinstance(block_ids[0], list | tuple)
        held = held_blocks(block_ids) if grouped else list(block_ids)  # type: ignore[arg-type]
        tid = transfer_id_of(params) if self.settings.mode == "push" else ""
        if status not in FINISHED_OK or not held or (tid and self.push.taken(tid, req_id)):
            return False, None  # aborted / errored prefill, or its transfer id held: free at once
        give_up = self.settings.lease_s + self.settings.grace_s
        token = new_token()  # only the decode this request's params reach can read or release it
        lease, groups, tokens = req_id, None, 0
        if tid:
            lease = token = tid  # (a push request not streamed: a chunked prompt; read as it is now)
            self._plan.names[tid] = req_id
            if grouped:  # (its decode pairs its lists with these: Hold.groups)
                groups, tokens = [list(g) for g in block_ids], request.num_prompt_tokens
        try:
            self.client.hold(lease, held, self.settings.lease_s, reads=self.tp_size, notify_ranks=True,
                             expires_unix=time.time() + give_up, engine_id=self.local_engine, token=token,
                             groups=groups, num_tokens=tokens)
        except SEND_ERRORS as e:
            log.warning("request %s: hold not sent (%s); blocks freed, decode computes", req_id, e)
            return False, None
        self._plan.holds[lease] = time.monotonic() + give_up
        self.push.held_at_finish(req_id, tid)  # (its transfer id taken until Released: a review)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req_id,
            "remote_block_ids": [list(g) for g in block_ids] if grouped else list(block_ids),
            "remote_host": self.handshake_host,
            "remote_port": self.handshake_port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "remote_num_tokens": getattr(request, "num_computed_tokens", 0),
            "remote_generation": self.generation,
            "remote_lease_token": token,
            **({"remote_block_size": self.block_size} if self.block_size else {}),
            **({"remote_state_split": self.state_split} if self.state_split else {}),
        }

    # ---------------------------------------------------------------- per step

    @property
    def plan(self) -> StepPlan:
        """This step's plan so far (what the next metadata carries)."""
        return self._plan

    def take_plan(self) -> StepPlan:
        """This step's additions for the workers; also drains what the sidecar told us."""
        now = time.monotonic()
        try:
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + self.settings.heartbeat_s
                self.client.heartbeat()
            drained = self.client.poll()
        except SEND_ERRORS as e:
            log.warning("sidecar %s: %s", self.settings.sidecar, e)
            drained = Drained()
        for pong in drained.pongs:
            self._follow(pong)
        for ev in self._holds_sent.refused(drained.errors, self._plan, now):
            if ev.code == ErrorCode.EXPIRED and ev.req_id in self._waiting:
                # The prefill gave the blocks up while this request waited: compute it here.
                del self._waiting[ev.req_id]
                self._remote.pop(ev.req_id, None)
                self.errors[ev.req_id] = f"prefill lease expired while waiting: {ev.message}"
                log.warning("request %s: %s; computing the prompt locally", ev.req_id, ev.message)
                continue
            log.warning("sidecar refused a request %s: [%s] %s", ev.req_id, ev.code, ev.message)
        if self._waiting and now >= self._next_keepalive:
            self._next_keepalive = now + self.settings.keepalive_period_s
            send_keepalives(self.client, self._waiting)
        self._refused(drained.failed, now)
        plan, self._plan = self._plan, StepPlan()
        return plan

    def _follow(self, pong: Any) -> None:
        """A Pong (a heartbeat's answer; a restarted sidecar's): where it listens, its
        registrations, and what it can do (one rolled back may not push by chunk or by group:
        a request is held and loaded as the last Pong says)."""
        endpoint = (pong.handshake_host, pong.handshake_port)
        if endpoint != (self.handshake_host, self.handshake_port):
            log.warning("sidecar handshake endpoint is now %s:%d", *endpoint)
        self.engine_id, self.handshake_host, self.handshake_port = (
            self.local_engine or pong.engine_id, pong.handshake_host, pong.handshake_port)
        self.generation, self.grouped_push = pong.generation, pong.grouped_streams
        self.push.follow(pong)

    def _refused(self, failed: list[Any], now: float) -> None:
        """Failed receives that came here: a load refused to a rank not registered with the
        sidecar (it restarted) goes to that rank's worker (else it waits for its deadline)."""
        if now >= self._next_prune:
            self._next_prune = now + 1.0
            self._loads = {r: d for r, d in self._loads.items() if d > now}
        for ev in failed:
            if ev.req_id in self._loads and ev.tp_rank >= 0 and ev.pp_rank >= 0:
                log.warning("KV load of %s refused to rank pp%d/tp%d: [%s] %s", ev.req_id, ev.pp_rank,
                            ev.tp_rank, ev.code, ev.reason)
                self._plan.refused.setdefault(ev.req_id, []).append((ev.pp_rank, ev.tp_rank))
            else:
                log.warning("release of %s on the prefill side failed: [%s] %s", ev.req_id, ev.code,
                            ev.reason)

    def shutdown(self) -> None:
        self.client.close()


def warn_once(seen: set[str], key: str, message: str, *args: Any) -> None:
    """``message`` (its first argument ``key``) logged the first time ``key`` is seen."""
    if key not in seen:
        seen.add(key)
        log.warning(message, key, *args)


def release_remote(client: SidecarClient, ranks: list[tuple[int, int]], engine: str, req_id: str,
                   remote: RemoteBlocks) -> None:
    """An empty Recv to every (pp, tp) rank: the prefill's blocks are not needed (its lease
    frees them if this cannot be sent)."""
    try:
        for pp, rank in ranks:
            client.recv(req_id, [], remote, tp_rank=rank, engine_id=engine, pp_rank=pp,
                        streamed=remote.streamed)
    except SEND_ERRORS as e:
        log.warning("request %s: release of the prefill blocks not sent: %s", req_id, e)


def post_loads(client: SidecarClient, settings: ConnectorSettings, ranks: list[tuple[int, int]], req_id: str,
               pairs: Pairs, remote: RemoteBlocks, grouped: GroupedLoad | None, engine: str,
               expires: float, plan: StepPlan) -> bool:
    """A load's Recv to every (pp, tp) rank: False when none could be sent (the load fails now;
    when some were, their deadlines settle it: ``expires`` bounds them). A rank whose Recv could
    not be sent fails now (``plan.refused``; it waited for its deadline and ``settle_s``, ~60 s:
    found by a review)."""
    unposted = []
    for pp, rank in ranks:
        try:
            client.recv(req_id, pairs.local,
                        dataclasses.replace(remote, block_ids=pairs.remote, groups=()),
                        streamed=remote.streamed, groups=grouped, tp_rank=rank,
                        deadline_s=settings.transfer_timeout_s, reply_to_rank=True, expires_unix=expires,
                        engine_id=engine, pp_rank=pp, state=(pairs.state_local, pairs.state_remote))
        except SEND_ERRORS as e:
            log.warning("request %s: KV load not posted to the sidecar (rank pp%d/tp%d): %s", req_id, pp,
                        rank, e)
            unposted.append((pp, rank))
    if unposted and len(unposted) < len(ranks):
        plan.refused.setdefault(req_id, []).extend(unposted)
    return len(unposted) < len(ranks)


def splits_alike(ours: str, params: Any, remote: Any, tp_size: int) -> bool:
    """Whether a prefill's state can move to this engine of ``tp_size``: the same TP size, or
    one that splits its state as this engine does (``ours``: StateSplit.signature), as its
    kv_transfer_params say. A push load's come from the router, so there only this side can
    say (a prefill that cannot fails the load, which is then computed here)."""
    if getattr(remote, "tp_size", tp_size) == tp_size:
        return True
    theirs = ours if getattr(remote, "streamed", False) else params.get("remote_state_split")
    return bool(ours) and theirs == ours


def tokens_to_load(prompt: int, backoff: int, computed: Any, state: bool, grouped: bool = False) -> int:
    """The prompt tokens a decode loads from its prefill (``computed``: what the prefill says
    it computed, ``remote_num_tokens``; ``state``: the model has state groups; ``grouped``:
    several KV cache groups). Negative: a load that cannot be paired (minus the tokens it would
    have covered): compute it all here."""
    n = prompt - backoff if prompt > backoff else 0  # (the prefill stopped short of ``backoff``)
    known = isinstance(computed, int) and not isinstance(computed, bool)
    if state and n and not (known and computed == n):
        # A state is the state after exactly ``computed`` tokens: loaded under any other claim
        # it would be recomputed on top of itself (a prefill that did not stop short, e.g.
        # prompt logprobs asked there, or another prompt here).
        return -n
    if grouped and n and known and computed > n:
        # Several groups' lists line up at their tails: a prefill that computed more holds
        # blocks past the ones loaded here (and its window ends elsewhere), and every block
        # would get another position's KV (a review; one group is cut: ``cut_to_load``)
        return -n
    return computed if known and 0 < computed < n else n  # (never more than the prefill computed)


def send_keepalives(client: SidecarClient, waiting: dict[str, RemoteBlocks]) -> None:
    """One KeepAlive per prefill engine for the requests still waiting for blocks here."""
    groups: dict[tuple[str, str, int], list[tuple[str, str, str]]] = {}
    for req_id, r in waiting.items():
        groups.setdefault((r.engine_id, r.host, r.port), []).append((req_id, r.req_id or req_id, r.token))
    for (engine, host, port), ids in groups.items():
        for i in range(0, len(ids), 4096):
            part = ids[i:i + 4096]
            try:
                client.keepalive(RemoteBlocks(engine, host, port, []), [r for _, r, _ in part],
                                      [q for q, _, _ in part], [t for _, _, t in part])
            except SEND_ERRORS as e:  # the leases may run out; the reads then fail and recompute
                log.warning("keep-alive for %d requests not sent: %s", len(part), e)
                return
