"""A sidecar outage never crashes or stalls the engine. vLLM's real Scheduler keeps stepping
a decode engine while its sidecar is frozen (SIGSTOP), then dead (SIGKILL), then restarted:
every step returns promptly, loads that cannot be posted or answered are recomputed, and
P/D transfers resume once the worker re-registered with the new sidecar."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from kvxfer.testing.procs import SidecarFactory, SidecarProc
from tests.vllm_harness import BLOCK_SIZE, Engine, kv_bytes, make_config, make_request, write_tiny_model

LEN = 2 * BLOCK_SIZE + 5
World = tuple[Engine, Engine, SidecarFactory, SidecarProc]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    model = write_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))
    with SidecarFactory() as f:
        ps = f.start("out-p", "--handshake-timeout-s", "1")
        ds = f.start("out-d", "--handshake-timeout-s", "1")
        p = Engine.start("prefill", make_config(model, ps.endpoint, lease_s=4))
        d = Engine.start("decode", make_config(model, ds.endpoint, transfer_timeout_s=2, grace_s=1,
                                               settle_s=2, heartbeat_s=0.2, send_queue=4))
        try:
            yield p, d, f, ds
        finally:
            p.shutdown()
            d.shutdown()


def prefilled(p: Engine, seed: int) -> dict:
    req = make_request(LEN, params={"do_remote_decode": True}, seed=seed)
    p.scheduler.add_request(req)
    p.run_until(lambda: p.finished(req.request_id), what="prefill")
    params = p.outputs[req.request_id].kv_transfer_params
    assert params is not None
    return dict(params)


def decode_all(p: Engine, d: Engine, seeds: list[int], timeout: float) -> tuple[list[str], float]:
    """Submit one decode per seed and step until all finished; returns ids and the slowest step."""
    ids = []
    for s in seeds:
        req = make_request(LEN, params=prefilled(p, s), max_tokens=2, seed=s)
        d.scheduler.add_request(req)
        ids.append(req.request_id)
    slowest = 0.0
    end = time.monotonic() + timeout
    while not all(d.finished(i) for i in ids):
        assert time.monotonic() < end, "decode requests did not finish"
        t0 = time.monotonic()
        d.step()  # must never raise, never block for long
        p.step()
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.01)
    return ids, slowest


def loaded_externally(d: Engine, req_id: str) -> bool:
    return d.scheduled[req_id][0] == 1  # only the last prompt token computed


def test_frozen_then_dead_then_restarted_sidecar(world: World) -> None:
    p, d, f, ds = world
    ids, _ = decode_all(p, d, [1], 20)
    assert loaded_externally(d, ids[0])

    os.kill(ds.proc.pid, signal.SIGSTOP)
    try:
        ids, slowest = decode_all(p, d, [2, 3, 4, 5, 6, 7], 30)
        assert slowest < 1.0, slowest
        assert not any(loaded_externally(d, i) for i in ids)  # all recomputed
    finally:
        os.kill(ds.proc.pid, signal.SIGKILL)
        ds.proc.wait()
    ids, slowest = decode_all(p, d, [8, 9, 10], 30)  # dead: nothing answers at all
    assert slowest < 1.0, slowest
    assert not any(loaded_externally(d, i) for i in ids)

    f.start("out-d", "--handshake-timeout-s", "1")  # same socket, new instance
    resumed = None
    for seed in range(11, 60):  # until the worker re-registered and a load is external again
        (rid,), slowest = decode_all(p, d, [seed], 30)
        assert slowest < 1.0, slowest
        if loaded_externally(d, rid):
            resumed = (rid, seed)
            break
    assert resumed is not None, "P/D never resumed after the sidecar restart"
    d.run_until(d.is_empty, what="decode blocks to be freed")
    p.run_until(p.is_empty, timeout=30, what="prefill holds to be released or expire")


def test_kv_bytes_right_after_the_outage(world: World) -> None:
    p, d, _, _ = world
    params = prefilled(p, 99)
    want = kv_bytes(p, list(params["remote_block_ids"]))
    req = make_request(LEN, params=params, max_tokens=2, seed=99)
    d.scheduler.add_request(req)
    d.step()
    blocks = d.blocks(req.request_id)
    d.run_until(lambda: req.request_id in d.scheduled, what="KV load")
    assert loaded_externally(d, req.request_id)
    full = LEN // BLOCK_SIZE  # full blocks: the last one also holds the locally computed token
    got = kv_bytes(d, blocks)
    assert all(torch.equal(g[:, :full], w[:, :full]) for g, w in zip(got, want, strict=True))
