"""Drive vLLM's real Scheduler with the kvxfer connector, as vLLM's own connector unit
tests do: the scheduler is real, the "model" writes KV bytes into the worker's cache and
samples a fixed token. KV caches live in shared memory allocated through the worker
connector's ``get_mem_pool_context`` and are registered with a real sidecar."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from itertools import count  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_HEADS = 2
HEAD_DIM = 64
EOS = 2


def write_tiny_model(path: str) -> str:
    """The 2-layer Llama of kvxfer.testing.vllm_pd, shaped like the KV caches built here."""
    from kvxfer.testing.vllm_pd import write_model

    return write_model(path, hidden_size=128, intermediate_size=256, num_key_value_heads=KV_HEADS,
                       head_dim=HEAD_DIM, num_hidden_layers=len(LAYERS), torch_dtype="float16",
                       eos_token_id=EOS)


def make_config(model: str, sidecar: str, *, policy: str = "recompute", multi: str = "",
                storage: str = "", tp: int = 1, block_size: int = BLOCK_SIZE, **extra: Any) -> VllmConfig:
    """``multi``: "" (kvxfer alone), "first" or "second" (kvxfer's place in a
    MultiConnector next to vLLM's ExampleConnector storing under ``storage``)."""
    kvxfer = {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.connector",
              "kv_role": "kv_both", "kv_connector_extra_config": {"sidecar": sidecar, **extra}}
    if multi:
        other = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": storage}}
        chain = [kvxfer, other] if multi == "first" else [other, kvxfer]
        transfer = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                                    kv_load_failure_policy=policy,
                                    kv_connector_extra_config={"connectors": chain})
    else:
        transfer = KVTransferConfig(kv_load_failure_policy=policy, **kvxfer)
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="float16", seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=2048,
            enable_chunked_prefill=True, is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True,
        ),
        cache_config=CacheConfig(block_size=block_size, gpu_memory_utilization=0.9,
                                 cache_dtype="auto", enable_prefix_caching=True),
        kv_transfer_config=transfer,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        device_config=DeviceConfig("cpu"),
    )


_ids = count(1)
_hash_ready = False


def make_request(prompt_len: int, *, params: dict[str, Any] | None = None, max_tokens: int = 1,
                 seed: int = 0, block_size: int = BLOCK_SIZE) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    req = Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=[3 + (seed * 7 + i) % 500 for i in range(prompt_len)],
        sampling_params=sp,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    req.kv_transfer_params = params
    return req


def kv_bytes(engine: TPEngine, blocks: list[int], rank: int = 0) -> list[torch.Tensor]:
    idx = torch.tensor(blocks)
    return [engine.kv[rank][layer][:, idx].clone() for layer in LAYERS]


@dataclass
class TPEngine:
    """A scheduler and ``tp`` worker connectors (ranks), outputs merged by vLLM's own
    ``KVOutputAggregator`` as the multiprocess executor does. ``lag[r]`` delays rank r's
    reports by that many steps (a rank finishing late). Works with any connector class
    the config names (KvxferConnector, or MultiConnector around it)."""

    name: str
    config: VllmConfig
    scheduler: Scheduler
    workers: list[Any]
    kv: list[dict[str, torch.Tensor]]
    aggregator: Any
    lag: dict[int, int] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    scheduled: dict[str, list[int]] = field(default_factory=dict)
    _queued: dict[int, list[Any]] = field(default_factory=dict)
    _inflight: Any = None  # async scheduling: the step the workers execute next
    steps: int = 0
    # (rank, req id) -> the step whose output first carried that rank's finished_recving of it
    delivered: dict[tuple[int, str], int] = field(default_factory=dict)

    @classmethod
    def start(cls, name: str, config: VllmConfig, tp: int = 1, *, async_scheduling: bool = False) -> TPEngine:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        heads = max(1, KV_HEADS // tp)  # fewer KV heads than ranks: replicated
        bs = config.cache_config.block_size
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=HEAD_DIM,
                                 dtype=torch.float16)
        kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        workers, caches = [], []
        for rank in range(tp):
            w = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
            for c in _kvxfer_children(w):
                assert c.worker is not None
                c.worker.tp_rank = rank  # no torch.distributed here: set the rank by hand
            ctx = w.get_mem_pool_context()
            assert ctx is not None
            with ctx:
                kv = {layer: torch.zeros(2, NUM_BLOCKS, bs, heads, HEAD_DIM, dtype=torch.float16)
                      for layer in LAYERS}
            w.register_kv_caches(kv)
            workers.append(w)
            caches.append(kv)
        if async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            sched_cls: type[Scheduler] = AsyncScheduler
        else:
            sched_cls = Scheduler
        scheduler = sched_cls(
            vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(config), block_size=bs,
        )
        agg = KVOutputAggregator.from_connector(workers[0], tp)
        return cls(name, config, scheduler, workers, caches, agg)

    @property
    def worker(self) -> Any:
        """Rank 0's worker connector."""
        return self.workers[0]

    def blocks(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def step(self) -> None:
        self.steps += 1
        out = self.scheduler.schedule()
        self._update(out, self._execute(out, self._starts(out)))

    def _starts(self, out: Any) -> dict[str, int]:
        """First position each request computes in this step, as of its schedule."""
        reqs = self.scheduler.requests
        return {rid: reqs[rid].num_computed_tokens - n for rid, n in out.num_scheduled_tokens.items()}

    def step_async(self, settle_s: float = 0.05) -> None:
        """One step as vLLM's async scheduling runs it: step N+1 is scheduled (a decode's
        ``Recv`` leaves from ``update_state_after_alloc`` here) while the workers still
        execute step N; ``settle_s`` lets transfers posted now finish before the workers
        drain their sidecar events for step N. Then step N's output is processed."""
        out = self.scheduler.schedule()
        prev, self._inflight = self._inflight, (out, self._starts(out))
        if prev is None:
            return
        time.sleep(settle_s)
        self._update(prev[0], self._execute(*prev))

    def _update(self, out: Any, merged: Any) -> None:
        for eco in self.scheduler.update_from_output(out, merged).values():
            for o in eco.outputs:
                self.outputs[o.request_id] = o

    def _execute(self, out: Any, starts: dict[str, int]) -> Any:
        from types import SimpleNamespace

        req_ids = list(out.num_scheduled_tokens)
        for rid in req_ids:
            self.scheduled.setdefault(rid, []).append(out.num_scheduled_tokens[rid])
        forward = SimpleNamespace(attn_metadata=None, no_compile_layers={})
        outputs = []
        for rank, w in enumerate(self.workers):
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(forward)
            for rid in req_ids:
                if rid in self.scheduler.requests:
                    self._compute(rank, rid, starts[rid], out.num_scheduled_tokens[rid])
            res = w.get_transfer_results(out.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            self._queued.setdefault(rank, []).append((res, invalid))
            lag = self.lag.get(rank, 0)
            if len(self._queued[rank]) > lag:
                res, invalid = self._queued[rank].pop(0)
            else:
                res, invalid = None, set()
            for rid in (res.finished_recving or ()) if res else ():
                self.delivered.setdefault((rank, rid), self.steps)
            outputs.append(ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[7] for _ in req_ids], logprobs=None, prompt_logprobs_dict={},
                pooler_output=None,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=(res.finished_sending or None) if res else None,
                    finished_recving=(res.finished_recving or None) if res else None,
                    invalid_block_ids=invalid, failed_recving=res.failed_recving if res else set(),
                ),
            ))
        return self.aggregator.aggregate(outputs)

    def _compute(self, rank: int, req_id: str, start: int, n_tokens: int) -> None:
        req = self.scheduler.requests[req_id]
        blocks, bs = self.blocks(req_id), self.config.cache_config.block_size
        for layer_idx, layer in enumerate(LAYERS):
            for pos in range(start, start + n_tokens):
                b, off = blocks[pos // bs], pos % bs
                token = req.all_token_ids[pos] if pos < len(req.all_token_ids) else 0
                val = float((token * 31 + pos + layer_idx * 7 + rank * 3) % 2048) / 8.0
                self.kv[rank][layer][0, b, off] = val
                self.kv[rank][layer][1, b, off] = -val

    def run_until(self, cond: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: timed out waiting for {what}")
            self.step()
            time.sleep(0.002)

    def is_empty(self) -> bool:
        s = self.scheduler
        free = s.kv_cache_manager.block_pool.free_block_queue.num_free_blocks
        return not s.requests and not s.waiting and not s.running and free == NUM_BLOCKS - 1

    def finished(self, req_id: str) -> bool:
        o = self.outputs.get(req_id)
        return o is not None and o.finish_reason is not None

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)


    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()


Engine = TPEngine  # one worker (tp 1), as tests/test_connector.py uses it


def _kvxfer_children(connector: Any) -> list[Any]:
    subs = getattr(connector, "sub_connectors", None)
    return [c for c in (subs if subs is not None else [connector]) if type(c).__name__ == "KvxferConnector"]
