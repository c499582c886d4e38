"""The connector's settings, read from vLLM's ``kv_connector_extra_config``. vLLM-free.

    {"sidecar": "ipc:///run/kvxfer/engine.sock",   # or env KVXFER_SIDECAR
     "lease_s": 30,            # prefill hold lease (alias: vLLM's "kv_lease_duration")
     "transfer_timeout_s": 30, # decode receive deadline, handshake included
     "sidecar_timeout_s": 60,  # how long start-up waits for the sidecar to answer
     "grace_s": 5,             # the engine's own deadline = sidecar's + grace, when the
                               # sidecar is silent that long (dead or wedged)
     "settle_s": 25,           # ... and at the latest + settle_s while it still answers
                               # (> its settle_timeout_s: a failed read waits for its chunks)
     "heartbeat_s": 1,         # how often a worker pings its sidecar (restart detection)
     "keepalive_s": 0,         # decode: how often the prefill leases of requests still
                               # waiting for local blocks are renewed (0: lease_s / 6)
     "send_queue": 1000,       # messages queued for a sidecar that does not read before
                               # sends fail (the request then recomputes / frees at once)
     "engine_channel": "ring", # "ring": messages to and from an ipc:// sidecar go through
                               # shared-memory rings with eventfd doorbells (one wake-up per
                               # message; ZMQ where none is granted); "zmq": the ZMQ socket only
     "shm_dir": "/dev/shm",    # CPU engines without a memory channel: KV cache files
     "gpu_memory": "ipc",      # GPU engines: "ipc" (the engine allocates, the sidecar opens
                               # a CUDA IPC handle; measured) or "vmm" (the sidecar's CUDA
                               # VMM pools over the memory channel; NOT yet run on a GPU)
     "model_identity": "",     # overrides the model identity checked at handshake (default:
                               # architecture, model, revision, dtype, KV cache dtype), e.g.
                               # when P and D load the same weights from different paths
     "mode": "pull",           # "push": requests a router sends to both engines at once with
                               # a shared "transfer_id" move layer by layer while the prefill
                               # computes (README "Push mode"); others, and "pull", as before
     "kv_cache_layout": ""}    # ask vLLM for this KV cache layout (get_required_kvcache_layout):
                               # "BLHNC" / "BLNHC" (block-outermost: one block of every layer
                               # is one run, one descriptor per block between equal TP sizes),
                               # "LBHNC" / "LBNHC"; vLLM uses it when every attention backend
                               # supports it and warns and keeps its own otherwise. "": none
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_SIDECAR = "ipc:///run/kvxfer/engine.sock"
# vLLM's KVCacheLayout names kvxfer can move (a layer's block must be one run: LHBNC and
# BHLNC put heads outside it)
KV_CACHE_LAYOUTS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")


@dataclass(frozen=True)
class ConnectorSettings:
    sidecar: str = DEFAULT_SIDECAR
    lease_s: float = 30.0
    transfer_timeout_s: float = 30.0
    sidecar_timeout_s: float = 60.0
    grace_s: float = 5.0
    settle_s: float = 25.0
    heartbeat_s: float = 1.0
    keepalive_s: float = 0.0  # 0: lease_s / 6, as vLLM's NixlConnector heartbeats
    send_queue: int = 1000
    engine_channel: str = "ring"
    shm_dir: str = "/dev/shm"
    gpu_memory: str = "ipc"
    model_identity: str = ""
    kv_cache_layout: str = ""
    mode: str = "pull"

    def __post_init__(self) -> None:
        if not self.sidecar.startswith(("ipc://", "tcp://")):
            raise ValueError(f"kvxfer: sidecar must be an ipc:// or tcp:// endpoint (e.g. ipc:///run/kvxfer/"
                             f"engine.sock, as kvxfer serve --engine-socket), not {self.sidecar!r}")
        for name in ("lease_s", "transfer_timeout_s", "sidecar_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kvxfer: {name} must be above 0, not {getattr(self, name)!r}")
        for name in ("grace_s", "settle_s", "keepalive_s", "send_queue"):  # (send_queue 0: ZMQ's no limit)
            if not getattr(self, name) >= 0:
                raise ValueError(f"kvxfer: {name} must be 0 or more, not {getattr(self, name)!r}")
        if self.mode not in ("pull", "push"):
            raise ValueError(f"kvxfer: mode must be 'pull' or 'push', not {self.mode!r}")
        if self.engine_channel not in ("ring", "zmq"):
            raise ValueError(f"kvxfer: engine_channel must be 'ring' or 'zmq', not {self.engine_channel!r}")
        if self.gpu_memory not in ("ipc", "vmm"):
            raise ValueError(f"kvxfer: gpu_memory must be 'ipc' or 'vmm', not {self.gpu_memory!r}")
        if self.kv_cache_layout and self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kvxfer: kv_cache_layout must be one of {', '.join(KV_CACHE_LAYOUTS)} (or "
                             f"empty: vLLM's choice), not {self.kv_cache_layout!r}")

    @property
    def keepalive_period_s(self) -> float:
        return self.keepalive_s or self.lease_s / 6

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Raises ValueError naming the key of a value it cannot take; a key it does not know is
        logged (a WARNING naming the nearest known one) and ignored: kv_connector_extra_config
        may carry keys of another connector, but a typo must not pass unseen."""
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)} | {"kv_lease_duration"}
        for key in sorted(set(extra) - known, key=str):
            near = difflib.get_close_matches(str(key), known, 1)
            hint = f"did you mean {near[0]!r}?" if near else f"kvxfer's: {', '.join(sorted(known))}"
            log.warning("kvxfer: kv_connector_extra_config key %r is not one of kvxfer's: ignored (%s)",
                        key, hint)

        def num(key: str, default: float, kind: type = float) -> Any:
            value = extra.get(key, default)
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"kvxfer: kv_connector_extra_config {key} must be a "
                                 f"{'whole ' if kind is int else ''}number, not {value!r}") from None

        lease = num("lease_s", num("kv_lease_duration", cls.lease_s))
        return cls(
            sidecar=str(extra.get("sidecar") or os.environ.get("KVXFER_SIDECAR") or DEFAULT_SIDECAR),
            lease_s=lease,
            transfer_timeout_s=num("transfer_timeout_s", cls.transfer_timeout_s),
            sidecar_timeout_s=num("sidecar_timeout_s", cls.sidecar_timeout_s),
            grace_s=num("grace_s", cls.grace_s),
            settle_s=num("settle_s", cls.settle_s),
            heartbeat_s=num("heartbeat_s", cls.heartbeat_s),
            keepalive_s=num("keepalive_s", cls.keepalive_s),
            send_queue=num("send_queue", cls.send_queue, int),
            engine_channel=str(extra.get("engine_channel", cls.engine_channel)),
            shm_dir=str(extra.get("shm_dir", cls.shm_dir)),
            gpu_memory=str(extra.get("gpu_memory", cls.gpu_memory)),
            model_identity=str(extra.get("model_identity", "")),
            kv_cache_layout=str(extra.get("kv_cache_layout") or "").upper(),
            mode=str(extra.get("mode") or cls.mode),
        )
