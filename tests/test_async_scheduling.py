"""Async scheduling (vLLM's default on CUDA): the scheduler runs step N+1 while the workers
still execute step N. vLLM's real ``AsyncScheduler`` drives the connector here the way the
engine core does, with two real sidecars moving the KV over NIXL.

A decode's ``Recv`` leaves from ``update_state_after_alloc`` during schedule(N+1) and a
small transfer finishes before the workers drain their events for step N, i.e. before the
step whose metadata names the request. Likewise a prefill's ``Released`` can arrive before
the hold's metadata reaches the workers. Dropping those early events left the load waiting
for its deadline (then recomputed) and the prefill blocks pinned until the lease ran out."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvxfer.testing.procs import SidecarFactory
from tests.vllm_harness import BLOCK_SIZE, Engine, make_config, make_request, write_tiny_model

DEADLINE_S = 30.0  # the decode's transfer deadline and the prefill's lease: far above the waits below


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    model = write_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))
    with SidecarFactory() as f:
        ps = f.start("async-p", "--handshake-timeout-s", "2")
        ds = f.start("async-d", "--handshake-timeout-s", "2")
        p = Engine.start("prefill", make_config(model, ps.endpoint, lease_s=DEADLINE_S),
                         async_scheduling=True)
        d = Engine.start("decode", make_config(model, ds.endpoint, transfer_timeout_s=DEADLINE_S),
                         async_scheduling=True)
        try:
            yield p, d
        finally:
            p.shutdown()
            d.shutdown()


def run_async(e: Engine, cond: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{e.name}: {what} not within {timeout}s (async scheduling)")
        e.step_async()
    return time.monotonic() - t0


@pytest.mark.parametrize("prompt_len", [BLOCK_SIZE + 3, 4 * BLOCK_SIZE])
def test_transfers_finishing_inside_one_step_are_not_lost(engines: tuple[Engine, Engine],
                                                          prompt_len: int) -> None:
    p, d = engines
    req = make_request(prompt_len, params={"do_remote_decode": True}, seed=prompt_len)
    p.scheduler.add_request(req)
    run_async(p, lambda: p.finished(req.request_id), 10, "prefill")
    params = p.outputs[req.request_id].kv_transfer_params
    assert params is not None
    p_blocks = p.blocks(req.request_id)

    dreq = make_request(prompt_len, params=dict(params), max_tokens=2, seed=prompt_len)
    d.scheduler.add_request(dreq)
    took = run_async(d, lambda: dreq.request_id in d.scheduled, 5, "the KV load")
    assert took < 5 < DEADLINE_S  # loaded, not failed at its deadline and recomputed
    assert d.scheduled[dreq.request_id][0] == 1  # only the last prompt token was computed
    # Every transferred position (all but the last prompt token) holds the prefill's KV.
    # (Positions after it may differ: async scheduling runs a step ahead on both sides.)
    d_blocks = d.blocks(dreq.request_id)
    for pos in range(prompt_len - 1):
        b, off = divmod(pos, BLOCK_SIZE)
        for layer in p.kv[0]:
            assert torch.equal(d.kv[0][layer][:, d_blocks[b], off], p.kv[0][layer][:, p_blocks[b], off]), pos
    run_async(d, lambda: d.finished(dreq.request_id), 10, "decode")
    # The prefill's Released came before the step that binds the hold: still freed at once.
    run_async(p, p.is_empty, 5, "prefill blocks to be released")
    run_async(d, d.is_empty, 5, "decode blocks to be freed")
    stats = d.worker.get_kv_connector_stats()
    assert stats is not None
    assert stats.data["recv_failed"] == 0
    assert stats.data["recv_ok"] == 1
