"""Push mode, the prefill side of the connector (README "Push mode"): a request a router sent
to both engines at once with a ``transfer_id`` is held as soon as the step that computes its
whole prompt is scheduled, before its KV is computed (``Hold.streamed``), so the decode's
sidecar reads each layer as the workers report it (``WorkerSide.save_layer``). vLLM-free;
duck-typed requests.

The rules that keep the prefill's blocks safe (found by review):
- streamed only when this step computes the whole prompt (``num_computed_tokens`` +
  this step's tokens reach the prompt: a chunk that merely *allocates* the last block is not
  the last chunk) and only the prompt's blocks are held (never lookahead blocks: the
  decode's suffix pairing would shift by one);
- a ``Released`` of a request vLLM has not finished yet (a prefill asked for more than one
  token, or a preempted one) is held back until it finishes, never handed to vLLM (which
  asserts the request is finished before it frees blocks);
- a transfer id already live is not streamed again (a router retry reusing it): the lease
  is keyed by it, and two requests must never share one;
- a streamed request preempted by vLLM (its blocks freed without asking) has its lease
  released at once and is not streamed again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvxfer.client import SEND_ERRORS, SidecarClient
from kvxfer.connector.groups import Groups
from kvxfer.connector.params import transfer_id_of
from kvxfer.connector.settings import ConnectorSettings
from kvxfer.connector.step import FINISHED_OK, StepPlan
from kvxfer.pairing import held_blocks

log = logging.getLogger(__name__)


class StreamedHolds:
    def __init__(self, settings: ConnectorSettings, client: SidecarClient, tp_size: int,
                 engine_id: str, pong: Any = None) -> None:
        """``pong``: the sidecar's, saying what it holds chunk by chunk (None: nothing)."""
        self.settings = settings
        self.client = client
        self.tp_size = tp_size
        self.local_engine = engine_id
        self._streams: dict[str, str] = {}  # request id -> transfer id (its lease, held)
        # finished requests whose lease lives on until its Released (a decode may read it):
        # their transfer ids are as taken as a running one's (a review: a retry held under
        # one got the only Released, and the first request's blocks leaked)
        self._ending: dict[str, str] = {}
        # allocated this step: (request, blocks, blocks per KV cache group or None: one group,
        # vLLM's lists of every group as allocated so far, or None)
        self._pending: dict[str, tuple[Any, list[int], list[list[int]] | None, list[list[int]] | None]] = {}
        self._released: set[str] = set()  # streamed requests whose lease ended before vLLM finished them
        self._spent: set[str] = set()  # request ids never to stream (again): preempted
        # preempted while streamed: vLLM freed their blocks, the Released of the lease given up
        # is not for it (a finished send of an unfinished request kills vLLM's scheduler)
        self._dropped: set[str] = set()
        # push of prompts computed in chunks (the sidecar's Pong says it holds them chunk by
        # chunk): request id -> (request, its blocks held so far)
        self.chunks = False
        self.block_size = 1
        self._chunked: dict[str, tuple[Any, list[int]]] = {}
        # ... with several KV cache groups (its sidecar's Pong says so): the model's groups, and
        # request id -> (request, vLLM's lists of every group allocated so far)
        self.groups: Groups | None = None
        self.grouped_chunks = False
        self._chunked_groups: dict[str, tuple[Any, list[list[int]]]] = {}
        self._instance = ""  # the sidecar's (Pong.instance): another one restarted it
        self.follow(pong)

    def follow(self, pong: Any) -> None:
        """What the sidecar's last Pong says it holds chunk by chunk (None: nothing); a request
        already held chunk by chunk goes on as it started, unless the Pong is a restarted
        sidecar's (another ``instance``): its lease died with the old one, and its next chunks
        are not sent as extensions (an older sidecar would take one for a new hold of part of
        the prompt); its end is the worker's, as for any lease lost in a restart."""
        self.chunks = bool(pong and pong.chunk_streams)
        self.grouped_chunks = bool(pong and pong.grouped_chunks)
        instance = getattr(pong, "instance", "") if pong else ""
        if instance != self._instance and self._instance:
            self._chunked.clear()
            self._chunked_groups.clear()
        self._instance = instance or self._instance

    def streams(self, request: Any) -> bool:
        """A push-mode prefill request (``transfer_id``): held as soon as its prompt is scheduled."""
        params = request.kv_transfer_params
        return (self.settings.mode == "push" and bool(params) and bool(params.get("do_remote_decode"))
                and bool(transfer_id_of(params)))

    def allocated(self, request: Any, block_ids: list[int], block_size: int) -> None:
        """Its blocks (the prompt's only: never lookahead ones); held in ``scheduled``."""
        n = -(-request.num_prompt_tokens // block_size)
        self.block_size = block_size
        if request.request_id not in self._streams and request.request_id not in self._spent:
            self._pending[request.request_id] = (request, list(block_ids[:n]), None, None)

    def allocated_groups(self, request: Any, raw: list[list[int]]) -> None:
        """A model of several KV cache groups (``groups`` set): vLLM's lists of every group as
        allocated; held in ``scheduled`` with the lists vLLM will hand to ``request_finished``
        once the prompt is computed (``Groups.at_finish``) and the prompt's tokens
        (``Hold.groups``), or, a first chunk, its full-attention groups' so far (``chunk_groups``)."""
        assert self.groups is not None
        if request.request_id not in self._streams and request.request_id not in self._spent:
            groups = self.groups.at_finish(raw, request.num_prompt_tokens)
            self._pending[request.request_id] = (request, held_blocks(groups), groups, raw)

    def scheduled(self, num_scheduled: dict[str, int], preempted: set[str] | None, plan: StepPlan,
                  cached: Any = None) -> None:
        """The step is scheduled: hold what it computes whole, or (``chunks``) the first chunk
        of a prompt computed in chunks and, with its next chunks' blocks (``cached``: vLLM's
        ``scheduled_cached_reqs``), the hold grown; release what vLLM preempted."""
        for req_id in preempted or ():
            self._chunked.pop(req_id, None)
            self._chunked_groups.pop(req_id, None)
            tid = self._streams.pop(req_id, None)
            if tid is not None:
                self._spent.add(req_id)
                self._dropped.add(req_id)
                log.warning("request %s preempted while streamed: its lease is released, the decode "
                            "recomputes", req_id)
                self._release(req_id, tid)
        for req_id in getattr(cached, "resumed_req_ids", ()) or ():  # (vLLM preempted it: its blocks
            self._chunked.pop(req_id, None)  # are new; never appended to the held ones; before what
            self._chunked_groups.pop(req_id, None)  # is held below: a resumed request may be held anew)
        pending, self._pending = self._pending, {}
        fresh = set(pending)  # (held below at this chunk: not extended by it too)
        for req_id, (request, blocks, groups, raw) in pending.items():
            done = request.num_computed_tokens + num_scheduled.get(req_id, 0)
            if done >= request.num_prompt_tokens:
                self._hold(request, blocks, groups, plan)
                continue
            if not self.chunks or req_id not in num_scheduled:
                continue
            if groups is None and self._hold(request, blocks, None, plan, partial=True):
                self._chunked[req_id] = (request, blocks)  # (a first chunk: read as it is done)
            elif raw is not None and self.grouped_chunks and self._hold_chunk_groups(request, raw, plan):
                self._chunked_groups[req_id] = (request, raw)
            else:
                continue
            plan.chunks[self._streams[req_id]] = done // self.block_size
        if cached is not None and (self._chunked or self._chunked_groups):
            for i, req_id in enumerate(cached.req_ids):
                if req_id in fresh or req_id not in num_scheduled:
                    continue
                if req_id in self._chunked:
                    self._next_chunk(req_id, cached.new_block_ids[i], num_scheduled[req_id], plan)
                elif req_id in self._chunked_groups:
                    self._next_chunk_groups(req_id, cached.new_block_ids[i], num_scheduled[req_id], plan)

    def _hold_chunk_groups(self, request: Any, raw: list[list[int]], plan: StepPlan) -> bool:
        """The first chunk of a prompt of several KV cache groups: its full-attention groups'
        blocks so far held (partial), the others' lists empty (``chunk_groups``)."""
        assert self.groups is not None
        groups = self.groups.chunk_groups(raw, request.num_prompt_tokens)
        self.block_size = self.groups.attention_block_size
        return self._hold(request, held_blocks(groups), groups, plan, partial=True)

    def _next_chunk(self, req_id: str, new: Any, scheduled: int, plan: StepPlan) -> None:
        """This step computes the next chunk of a prompt held chunk by chunk: its blocks held
        too (``Hold.extends``); the last chunk's layers are reported one by one (``streamed``),
        an earlier one's blocks once it is computed (``chunks``)."""
        request, blocks = self._chunked.pop(req_id)
        blocks = (blocks + list(new[0] if new else ()))[:-(-request.num_prompt_tokens // self.block_size)]
        self._extend(request, blocks, None, scheduled, plan,
                     lambda: self._chunked.__setitem__(req_id, (request, blocks)))

    def _next_chunk_groups(self, req_id: str, new: Any, scheduled: int, plan: StepPlan) -> None:
        """``_next_chunk`` with several KV cache groups: every group's list grows by its new
        blocks; an earlier chunk holds the full-attention groups' so far, the last the lists
        vLLM will hand to ``request_finished`` (``at_finish``: a window's tail, the state)."""
        assert self.groups is not None
        request, raw = self._chunked_groups.pop(req_id)
        raw = [list(g) + list(new[i] if new and i < len(new) else ()) for i, g in enumerate(raw)]
        final = request.num_computed_tokens + scheduled >= request.num_prompt_tokens
        groups = (self.groups.at_finish(raw, request.num_prompt_tokens) if final
                  else self.groups.chunk_groups(raw, request.num_prompt_tokens))
        self._extend(request, held_blocks(groups), groups, scheduled, plan,
                     lambda: self._chunked_groups.__setitem__(req_id, (request, raw)))

    def _extend(self, request: Any, blocks: list[int], groups: list[list[int]] | None, scheduled: int,
                plan: StepPlan, keep: Callable[[], None]) -> None:
        """The hold of a prompt computed in chunks extended to this step's chunk (``keep``: it
        stays chunked, for the next one)."""
        req_id = request.request_id
        tid = self._streams[req_id]
        done = request.num_computed_tokens + scheduled
        final = done >= request.num_prompt_tokens
        give_up = self.settings.lease_s + self.settings.grace_s  # (renewed: a long prompt outlives one)
        try:
            self.client.hold(tid, blocks, self.settings.lease_s, reads=self.tp_size, notify_ranks=True,
                             expires_unix=time.time() + give_up, engine_id=self.local_engine, token=tid,
                             streamed=True, extends=True, partial=not final, groups=groups,
                             num_tokens=request.num_prompt_tokens)
        except SEND_ERRORS as e:
            if final:  # (never to be complete: its decode fails now, not at its deadline)
                log.warning("request %s: its last chunk's blocks not held (%s); released", req_id, e)
                self._release(req_id, tid)
            else:  # (the next chunk's extension carries the whole list)
                keep()
            return
        plan.holds[tid] = time.monotonic() + give_up
        plan.extended.append(tid)
        if final:
            plan.streamed.append(tid)
        else:
            keep()
            plan.chunks[tid] = done // self.block_size

    def _hold(self, request: Any, block_ids: list[int], groups: list[list[int]] | None,
              plan: StepPlan, partial: bool = False) -> bool:
        """Hold the blocks now, before their KV is computed (``Hold.streamed``; ``partial``: the
        first chunk's of a prompt computed in chunks). The lease is the transfer id, which is
        also its token: the decode was given it by the router. False: not held."""
        req_id = request.request_id
        tid = transfer_id_of(request.kv_transfer_params)
        if not block_ids or self._live(tid):
            return False  # (nothing to hold; or its transfer id is live: never two leases under one)
        give_up = self.settings.lease_s + self.settings.grace_s
        try:
            self.client.hold(tid, block_ids, self.settings.lease_s, reads=self.tp_size, notify_ranks=True,
                             expires_unix=time.time() + give_up, engine_id=self.local_engine, token=tid,
                             streamed=True, groups=groups, num_tokens=request.num_prompt_tokens,
                             partial=partial)
        except SEND_ERRORS as e:
            log.warning("request %s: streamed hold not sent to the sidecar (%s); held when it finishes",
                        req_id, e)
            return False
        self._streams[req_id] = tid
        plan.holds[tid] = time.monotonic() + give_up
        plan.names[tid] = req_id
        if not partial:
            plan.streamed.append(tid)
        return True

    def held(self, req_id: str) -> bool:
        return req_id in self._streams or req_id in self._spent

    def taken(self, tid: str, req_id: str) -> bool:
        """Whether another request is held streamed under this transfer id now (a router's
        retry while the first is held): ``req_id`` is then not held under it (two leases under
        one name, one Released: one of the two leaked; found by a review)."""
        if not self._live(tid):
            return False
        log.warning("request %s: its transfer id %s is held for another request; its blocks are "
                    "freed, its decode reads that one's or computes", req_id, tid)
        return True

    def finish(self, request: Any) -> tuple[bool, None]:
        """A streamed request ended: its blocks stay until the sidecar says Released (a decode
        may be reading them), unless that came already; an aborted one is released now, and
        freed once that is done."""
        req_id = request.request_id
        self._spent.discard(req_id)
        self._chunked.pop(req_id, None)
        self._chunked_groups.pop(req_id, None)
        tid = self._streams.pop(req_id, None)
        if tid is None:
            return False, None  # (preempted: released already, nothing held now)
        if req_id in self._released:
            self._released.discard(req_id)
            return False, None  # (its lease ended while vLLM still ran it: free now)
        status = getattr(request.status, "name", str(request.status))
        if status not in FINISHED_OK:
            self._release(req_id, tid)
        self._ending[req_id] = tid
        return True, None

    def held_at_finish(self, req_id: str, tid: str) -> None:
        """A push request not streamed (its streamed Hold not sent, a chunked prompt at a
        sidecar without chunk streams) held as it finished, under its transfer id ("": pull)."""
        if tid:
            self._ending[req_id] = tid

    def _live(self, tid: str) -> bool:
        """A lease under this transfer id is held here: a running request's, or a finished
        one's whose Released has not come."""
        return tid in self._streams.values() or tid in self._ending.values()

    def hold_back(self, finished_sending: set[str] | None) -> set[str] | None:
        """The workers' finished sends, less those of requests vLLM has not finished (their
        lease ended early: freed when they finish, by ``finish``) and of leases given up when
        vLLM preempted their request (it freed those blocks itself; found by a review)."""
        if not finished_sending:
            return finished_sending
        for r in finished_sending:
            self._ending.pop(r, None)
        dropped = finished_sending & self._dropped
        self._dropped -= dropped
        early = {r for r in finished_sending if r in self._streams}
        self._released |= early
        for r in early:  # (its lease ended: no later chunk extends it, nor re-arms its deadline)
            self._chunked.pop(r, None)
            self._chunked_groups.pop(r, None)
        return finished_sending - early - dropped

    def _release(self, req_id: str, tid: str) -> None:
        try:
            self.client.release(tid, engine_id=self.local_engine)
        except SEND_ERRORS as e:  # (its lease frees it)
            log.warning("request %s: release not sent: %s", req_id, e)
