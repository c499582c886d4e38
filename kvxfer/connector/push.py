"""Push mode, the prefill side of the connector (README "Push mode"): a request a router sent
to both engines at once with a ``transfer_id`` is held as soon as its blocks are allocated,
before its KV is computed (``Hold.streamed``), so the decode's sidecar reads each layer as
the workers report it (``WorkerSide.save_layer``). vLLM-free; duck-typed requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from kvxfer.client import SidecarClient
from kvxfer.connector.params import transfer_id_of
from kvxfer.connector.settings import ConnectorSettings
from kvxfer.connector.step import StepPlan
from kvxfer.errors import KvxferError

SEND_ERRORS = (KvxferError, zmq.ZMQError)
FINISHED_OK = {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"}

log = logging.getLogger(__name__)


class StreamedHolds:
    def __init__(self, settings: ConnectorSettings, client: SidecarClient, tp_size: int,
                 engine_id: str) -> None:
        self.settings = settings
        self.client = client
        self.tp_size = tp_size
        self.local_engine = engine_id
        self._streams: dict[str, str] = {}  # request id -> transfer id (its lease, held)

    def streams(self, request: Any) -> bool:
        """A push-mode prefill request (``transfer_id``): held as soon as its blocks are."""
        params = request.kv_transfer_params
        return (self.settings.mode == "push" and bool(params) and bool(params.get("do_remote_decode"))
                and bool(transfer_id_of(params)))

    def hold(self, request: Any, block_ids: list[int], whole: bool, plan: StepPlan) -> None:
        """Push mode: hold the blocks now, before their KV is computed (``Hold.streamed``), when
        this step computes the whole prompt (``whole``: a chunked prompt is held when it
        finishes, every layer ready at once). The lease is the transfer id, which is also its
        token: the decode was given it by the router."""
        req_id = request.request_id
        if not whole or req_id in self._streams or not block_ids:
            return
        tid = transfer_id_of(request.kv_transfer_params)
        give_up = self.settings.lease_s + self.settings.grace_s
        try:
            self.client.hold(tid, block_ids, self.settings.lease_s, reads=self.tp_size, notify_ranks=True,
                             expires_unix=time.time() + give_up, engine_id=self.local_engine, token=tid,
                             streamed=True)
        except SEND_ERRORS as e:
            log.warning("request %s: streamed hold not sent to the sidecar (%s); held when it finishes",
                        req_id, e)
            return
        self._streams[req_id] = tid
        plan.holds[tid] = time.monotonic() + give_up
        plan.names[tid] = req_id
        plan.streamed.append(tid)

    def held(self, req_id: str) -> bool:
        return req_id in self._streams

    def finish(self, request: Any) -> tuple[bool, None]:
        """A streamed request ended: its blocks stay until the sidecar says Released (a decode
        may be reading them); an aborted one is released now, and freed once that is done."""
        tid = self._streams.pop(request.request_id)
        status = getattr(request.status, "name", str(request.status))
        if status not in FINISHED_OK:
            try:
                self.client.release(tid, engine_id=self.local_engine)
            except SEND_ERRORS as e:  # (its lease frees it)
                log.warning("request %s: release not sent: %s", request.request_id, e)
        return True, None

