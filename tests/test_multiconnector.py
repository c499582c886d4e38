"""KvxferConnector inside vLLM's MultiConnector (next to the ExampleConnector storage
connector, in either position) and under vLLM's KVOutputAggregator with TP workers."""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch

from kvxfer.testing.procs import SidecarFactory
from tests.vllm_harness import BLOCK_SIZE, LAYERS, TPEngine, make_config, make_request, write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-llama-multi")))


def pair(f: SidecarFactory, model: str, storage: str, multi: str, tp: int) -> tuple[TPEngine, TPEngine]:
    ps = f.start(f"m{multi}{tp}-p", "--handshake-timeout-s", "1")
    ds = f.start(f"m{multi}{tp}-d", "--handshake-timeout-s", "1")
    p = TPEngine.start("prefill", make_config(model, ps.endpoint, multi=multi, storage=storage, tp=tp,
                                              lease_s=20), tp)
    d = TPEngine.start("decode", make_config(model, ds.endpoint, multi=multi, storage=storage, tp=tp,
                                             transfer_timeout_s=5), tp)
    return p, d


def prefill(p: TPEngine, n: int, seed: int) -> tuple[str, dict, list[int]]:
    req = make_request(n, params={"do_remote_decode": True}, seed=seed)
    p.scheduler.add_request(req)
    p.run_until(lambda: p.finished(req.request_id), what="prefill")
    params = p.outputs[req.request_id].kv_transfer_params
    assert params is not None
    return req.request_id, params, p.blocks(req.request_id)


def same_kv(p: TPEngine, pb: list[int], d: TPEngine, db: list[int]) -> bool:
    return all(torch.equal(p.kv[r][layer][:, torch.tensor(pb)], d.kv[r][layer][:, torch.tensor(db)])
               for r in range(len(p.kv)) for layer in LAYERS)


@pytest.fixture
def storage(tmp_path: os.PathLike[str]) -> str:
    return str(tmp_path)


@pytest.mark.parametrize("multi", ["first", "second"])
def test_remote_prefill_through_multiconnector(model: str, storage: str, multi: str) -> None:
    with SidecarFactory() as f:
        p, d = pair(f, model, storage, multi, tp=1)
        try:
            _, params, pb = prefill(p, 3 * BLOCK_SIZE + 5, seed=61)
            # Only kvxfer produced kv_transfer_params, and they survived MultiConnector.
            assert params["remote_engine_id"] == p.config.kv_transfer_config.engine_id
            req = make_request(3 * BLOCK_SIZE + 5, params=json.loads(json.dumps(params)), max_tokens=2,
                               seed=61)
            d.scheduler.add_request(req)
            d.step()
            db = d.blocks(req.request_id)
            d.run_until(lambda: req.request_id in d.scheduled, what="KV to arrive")
            assert d.scheduled[req.request_id][0] == 1
            assert same_kv(p, pb, d, db)
            d.run_until(lambda: d.finished(req.request_id), what="decode")
            d.run_until(d.is_empty, what="decode free")
            p.run_until(p.is_empty, what="prefill released")
        finally:
            p.shutdown()
            d.shutdown()


def test_other_connector_cache_hit_still_releases_prefill(model: str, storage: str) -> None:
    with SidecarFactory() as f:
        p, d = pair(f, model, storage, "second", tp=1)  # ExampleConnector is asked first
        try:
            n = 4 * BLOCK_SIZE + 1
            _, params, _ = prefill(p, n, seed=62)
            req = make_request(n, params=copy.deepcopy(params), max_tokens=1, seed=62)
            # Make the ExampleConnector's storage claim the prompt (a hit in its cache).
            example = d.scheduler.connector.sub_connectors[0]
            folder = example._generate_foldername_debug(
                torch.tensor(req.prompt_token_ids)[: (n - 1) // BLOCK_SIZE * BLOCK_SIZE], [],
                create_folder=True)
            assert os.path.isdir(folder)
            d.scheduler.add_request(req)
            d.run_until(lambda: d.finished(req.request_id), what="decode via the other connector")
            assert d.scheduler.connector._requests_to_connector.get(req.request_id, 0) == 0
            p.run_until(p.is_empty, what="kvxfer still releases the prefill blocks")
            d.run_until(d.is_empty, what="decode free")
        finally:
            p.shutdown()
            d.shutdown()


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_workers_aggregated_with_a_late_rank(model: str, storage: str, tp: int) -> None:
    with SidecarFactory() as f:
        p, d = pair(f, model, storage, "first", tp=tp)
        try:
            d.lag = {tp - 1: 2}  # the last rank reports two steps late
            p.lag = {0: 1}
            _, params, pb = prefill(p, 2 * BLOCK_SIZE + 3, seed=63 + tp)
            req = make_request(2 * BLOCK_SIZE + 3, params=copy.deepcopy(params), max_tokens=2, seed=63 + tp)
            d.scheduler.add_request(req)
            d.step()
            db = d.blocks(req.request_id)
            # Ranks other than the late one report done; vLLM must keep waiting for it.
            seen_partial = False
            scheduled_at = 0
            deadline = time.monotonic() + 30.0  # wall time, not steps: a loaded CI machine
            while time.monotonic() < deadline:    # takes longer per transfer than per step
                d.step()
                if req.request_id in d.scheduled:
                    scheduled_at = d.steps
                    break
                pending = d.aggregator._recv_remaining_count.get(req.request_id)
                seen_partial |= pending is not None and 0 < pending < tp
                time.sleep(0.002)  # leave the sidecars the CPU (CI has two cores)
            rid = req.request_id
            assert scheduled_at, f"the request was never scheduled in 30 s ({d.steps} steps)"
            late = d.delivered[(tp - 1, rid)]
            others = [d.delivered[(r, rid)] for r in range(tp - 1)]
            # (under load the others' transfers can finish as late as the late rank's report:
            # then no step has a partial count to see, and only the ordering below is checkable)
            if min(others) < late:
                assert seen_partial, "some ranks were done before the late one, vLLM never waited"
            assert scheduled_at > late, "the request ran before the late rank reported its KV"
            assert d.scheduled[req.request_id][0] == 1
            assert same_kv(p, pb, d, db)
            d.run_until(lambda: d.finished(req.request_id), what="decode")
            d.run_until(d.is_empty, what="decode free")
            p.run_until(p.is_empty, what="every prefill rank reported the release")
        finally:
            p.shutdown()
            d.shutdown()
