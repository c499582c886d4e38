"""Pure modules: leases, config, layout validation, byte patterns."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.config import Config, load_config
from kvxfer.errors import ConfigError, ErrorCode, RequestError
from kvxfer.leases import READERS_MAX, Lease, LeaseTable
from kvxfer.memory import SharedKV, region_block_len
from kvxfer.sidecar.plan import desc_indices
from kvxfer.sidecar.validate import validate_registration
from kvxfer.testing.engine import make_layout
from kvxfer.testing.pattern import request_pattern


def lease(req: str, expires: float, reads: int = 1, engine: str = "e") -> Lease:
    return Lease(req_id=req, owner=b"w", block_ids=[1], expires=expires, reads_expected=reads, engine=engine)


def test_lease_released_once_after_all_reads() -> None:
    t = LeaseTable()
    t.add(lease("a", 10.0, reads=3))
    assert t.note_read(("e", "a"), reader=("d", 0, 0)) is None
    assert t.note_read(("e", "a"), reader=("d", 0, 0)) is None  # the same rank twice counts once
    assert t.note_read(("e", "a"), reader=("d", 1, 0)) is None  # another pipeline stage's rank 0 counts
    got = t.note_read(("e", "a"), reader=("d", 0, 1))
    assert got is not None
    assert got.reads_seen == 3
    assert ("e", "a") not in t
    assert t.note_read(("e", "a"), reader=("d", 0, 2)) is None
    assert t.expire(100.0) == []


def test_each_reader_agent_is_counted_against_its_own_rank_count() -> None:
    """Two decode engines of different TP sizes read one request (a router retry): one of 4
    ranks with 2 done, one of 2 ranks with 1 done. The second's count (2) once became the
    lease's, and the first's 2 of 4 then ended it (found by a review)."""
    t = LeaseTable()
    t.add(lease("a", 10.0))
    assert t.note_read(("e", "a"), reader=("tp4", 0, 0), expected=4) is None
    assert t.note_read(("e", "a"), reader=("tp4", 0, 1), expected=4) is None
    assert t.note_read(("e", "a"), reader=("tp2", 0, 0), expected=2) is None, "ended with neither finished"
    got = t.note_read(("e", "a"), reader=("tp2", 0, 1), expected=2)
    assert got is not None


def test_made_up_ranks_grow_a_lease_no_further_than_its_cap() -> None:
    t = LeaseTable()
    t.add(lease("a", 10.0, reads=2))
    for tp in range(READERS_MAX + 100):
        t.note_started(("e", "a"), ("liar", 0, tp))
    got = t._leases[("e", "a")]
    assert len(got.reading["liar"]) == READERS_MAX


def test_leases_of_two_engines_with_one_request_id_stay_apart() -> None:
    """Two DP ranks on one sidecar may hold the same request id: each its own blocks."""
    t = LeaseTable()
    t.add(lease("a", 10.0, engine="p_dp0"))
    t.add(lease("a", 20.0, engine="p_dp1"))
    assert t.resolve("p_dp1", "a") == ("p_dp1", "a")
    assert t.resolve("", "a") is None  # ambiguous without an engine: never guess
    got = t.note_read(("p_dp0", "a"), reader=("d", 0, 0))
    assert got is not None
    assert got.engine == "p_dp0"
    assert t.resolve("", "a") == ("p_dp1", "a")  # an older peer's notice: the one left
    assert [x.engine for x in t.drop(engine="p_dp1")] == ["p_dp1"]
    assert len(t) == 0


def test_lease_expiry_order_and_duplicates() -> None:
    t = LeaseTable()
    t.add(lease("late", 5.0))
    t.add(lease("early", 1.0))
    with pytest.raises(RequestError) as ei:
        t.add(lease("early", 2.0))
    assert ei.value.code == ErrorCode.DUPLICATE_REQUEST
    assert t.next_expiry() == 1.0
    assert [x.req_id for x in t.expire(1.0)] == ["early"]
    assert t.next_expiry() == 5.0
    assert t.pop(("e", "late")) is not None
    assert t.next_expiry() is None
    assert t.expired_total == 1


def test_renewing_a_lease_over_and_over_does_not_grow_the_expiry_heap() -> None:
    """A peer may renew a lease as often as it likes (one LeaseRenew may even name it 4,096
    times): each extension used to push a heap entry that stayed until its time came (up to
    300 s; gigabytes under a flood: found by a review). The lease's one entry is queued again
    when it comes up instead."""
    t = LeaseTable()
    t.add(lease("a", 10.0))
    for k in range(10_000):
        assert t.extend(("e", "a"), 10.0 + k * 0.01)
    assert len(t._heap) == 1
    assert t.expire(50.0) == []  # (its entry came up, and was queued again for ~109.99)
    assert len(t._heap) == 1
    assert [x.req_id for x in t.expire(110.0)] == ["a"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "extend", "expire", "pop"]), st.integers(0, 3),
                          st.integers(0, 40)), max_size=80))
def test_expiry_is_what_a_plain_model_says(ops: list[tuple[str, int, int]]) -> None:
    """Adds, extensions, pops and expiries in any order: the table ends exactly the leases a
    dict of deadlines would, when it would; ``next_expiry`` is never after the next deadline."""
    t, model, now = LeaseTable(), {}, 0.0
    for op, i, x in ops:
        key = ("e", str(i))
        if op == "add" and key not in model:
            t.add(lease(str(i), now + x))
            model[key] = now + x
        elif op == "extend":
            assert t.extend(key, now + x) == (key in model)
            if key in model:
                model[key] = max(model[key], now + x)
        elif op == "pop":
            assert (t.pop(key) is not None) == (key in model)
            model.pop(key, None)
        elif op == "expire":
            now += x / 4
            got = sorted(le.key for le in t.expire(now))
            assert got == sorted(k for k, d in model.items() if d <= now)
            model = {k: d for k, d in model.items() if d > now}
        nxt = t.next_expiry()
        assert (nxt is None) == (not model)
        if model:
            assert nxt is not None
            assert nxt <= min(model.values())
    assert len(t._heap) <= len(model) + len(ops)


def test_drop_owner() -> None:
    t = LeaseTable()
    t.add(lease("a", 1.0))
    t.add(Lease(req_id="b", owner=b"other", block_ids=[], expires=1.0))
    assert [x.req_id for x in t.drop(owner=b"w")] == ["a"]
    assert len(t) == 1


def test_config_precedence(tmp_path: os.PathLike[str]) -> None:
    toml = os.path.join(tmp_path, "k.toml")
    with open(toml, "w") as fh:
        fh.write('lease_s = 5.0\nengine_id = "from-toml"\nhandshake_port = 6000\n')
    env = {"KVXFER_CONFIG": toml, "KVXFER_ENGINE_ID": "from-env"}
    cfg = load_config({"handshake_port": 7000}, env=env)
    assert (cfg.lease_s, cfg.engine_id, cfg.handshake_port) == (5.0, "from-env", 7000)
    assert load_config({}, env={}) == Config()


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        ({"ucx_error_mode": "sometimes"}, {}),
        ({}, {"KVXFER_LEASE_S": "soon"}),
        ({}, {"KVXFER_LEASE_S": "-1"}),
        ({"handshake_port": 70000}, {}),
        ({"log_level": "verbose"}, {}),
        ({"engine_socket": "/run/kvxfer/engine.sock"}, {}),  # no ipc://
        ({"engine_socket": "ipc://engine.sock"}, {}),  # relative: / under systemd (a new-user trial)
        ({"engine_socket": "tcp://127.0.0.1:notaport"}, {}),  # passed --check, failed the start
        ({"control_target": "unix://control.sock"}, {}),  # relative too
        ({"control_target": "foo"}, {}),
        ({"health_target": "0.0.0.0:99999"}, {}),
        ({}, {"KVXFER_INSECURE": "maybe"}),  # not silently false
    ],
)
def test_config_rejects_bad_values(flags: dict[str, object], env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        load_config(flags, env=env)


@pytest.mark.parametrize(("line", "message"), [
    ("lease_s = true", "lease_s = true: expected a number"),  # once read as a 1 s lease
    ("handshake_port = 5700.5", "handshake_port = 5700.5: expected an integer"),
    ('metrics_port = "9400"', 'metrics_port = "9400": expected an integer'),
    ("insecure = 1", "insecure = 1: expected a boolean"),
    ("engine_id = 7", "engine_id = 7: expected a string"),
])
def test_config_file_values_must_have_their_types(
    tmp_path: os.PathLike[str], line: str, message: str
) -> None:
    toml = os.path.join(tmp_path, "k.toml")
    with open(toml, "w") as fh:
        fh.write(line + "\n")
    with pytest.raises(ConfigError, match=message.replace(".", "\\.")):
        load_config({"config": toml}, env={})


def test_config_sources_and_env_shadowing_a_file_key(tmp_path: os.PathLike[str]) -> None:
    from kvxfer.config import describe

    toml = os.path.join(tmp_path, "k.toml")
    with open(toml, "w") as fh:
        fh.write('lease_s = 5\nrole = "prefill"\n')
    sources: dict[str, str] = {}
    warnings: list[str] = []
    cfg = load_config({"config": toml, "handshake_port": 7000}, env={"KVXFER_ROLE": "decode"},
                      sources=sources, warnings=warnings)
    assert (cfg.lease_s, cfg.role, cfg.handshake_port) == (5.0, "decode", 7000)
    assert sources["lease_s"] == f"file {toml}"
    assert sources["role"] == "env KVXFER_ROLE"
    assert sources["handshake_port"] == "flag"
    assert sources["metrics_port"] == "default"
    assert warnings == [f"KVXFER_ROLE shadows role of {toml}"]
    text = describe(cfg, sources)
    assert "role" in text
    assert "'decode'" in text
    assert "(env KVXFER_ROLE)" in text


def test_config_rejects_unknown_toml_keys(tmp_path: os.PathLike[str]) -> None:
    toml = os.path.join(tmp_path, "k.toml")
    with open(toml, "w") as fh:
        fh.write("leese_s = 5.0\n")
    with pytest.raises(ConfigError, match="leese_s"):
        load_config({"config": toml}, env={})


def test_shared_kv_registration_is_valid_and_private() -> None:
    kv = SharedKV.create(make_layout(layers=3, num_blocks=5, heads=2, head_dim=16))
    try:
        assert os.stat(kv.path).st_mode & 0o777 == 0o600
        msg = kv.register_message()
        validate_registration(msg)
        assert len(msg.regions) == 6
        assert kv.nbytes == 6 * 5 * region_block_len(kv.layout)
    finally:
        kv.close()
    assert not os.path.exists(kv.path)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda m: msgspec.structs.replace(m, regions=m.regions[:-1]), "regions"),
        (lambda m: msgspec.structs.replace(
            m, layout=msgspec.structs.replace(m.layout, tp_rank=3)), "tp_rank"),
        (lambda m: msgspec.structs.replace(
            m, layout=msgspec.structs.replace(m.layout, dtype="float7")), "dtype"),
        (lambda m: msgspec.structs.replace(
            m, regions=[msgspec.structs.replace(m.regions[0], memory=4), *m.regions[1:]]), "memory"),
    ],
)
def test_validate_registration_rejects(change, fragment: str) -> None:  # type: ignore[no-untyped-def]
    kv = SharedKV.create(make_layout(layers=1, num_blocks=4, heads=2, head_dim=16))
    try:
        with pytest.raises(RequestError, match=fragment) as ei:
            validate_registration(change(kv.register_message()))
        assert ei.value.code == ErrorCode.INVALID_LAYOUT
    finally:
        kv.close()


def test_pattern_distinguishes_requests_blocks_heads_and_tokens() -> None:
    lay = make_layout(layers=2, num_blocks=8, heads=4, head_dim=8)
    a = request_pattern(lay, "a", 3)
    assert a.shape == (2, 2, 3, region_block_len(lay))
    assert np.array_equal(a, request_pattern(lay, "a", 3))  # deterministic
    assert not np.array_equal(a, request_pattern(lay, "b", 3))
    assert not np.array_equal(a[:, :, 0], a[:, :, 1])  # blocks differ
    assert not np.array_equal(a[0], a[1])  # layers differ
    assert not np.array_equal(a[:, 0], a[:, 1])  # K differs from V
    block = a[0, 0, 0].reshape(lay.block_size, lay.local_kv_heads, -1)
    assert not np.array_equal(block[0], block[1])  # tokens differ
    assert not np.array_equal(block[:, 0], block[:, 1])  # heads differ


def test_desc_indices_region_major() -> None:
    idx = desc_indices(np.arange(3), 10, np.array([7, 2]))
    assert idx.dtype == np.int32
    assert idx.tolist() == [7, 2, 17, 12, 27, 22]


def test_demo_defaults_move_at_least_one_gib() -> None:
    from kvxfer.testing.demo import DemoOptions

    opts = DemoOptions()
    assert opts.requests * opts.request_bytes() >= 1 << 30


def test_connector_layout_reads_nhd_hnd_and_fused_tensors() -> None:
    import torch

    from kvxfer.connector.layout import registration_from_tensors
    from kvxfer.protocol import ShmMemory

    def reg(kv: dict) -> object:
        return registration_from_tensors(
            kv, num_blocks=6, block_size=4, num_kv_heads=2, local_kv_heads=2, head_dim=8,
            tp_rank=0, tp_size=1, mla=False,
            memory_of=lambda t: (ShmMemory(path="/x", size=1 << 20), "x", 0),
        )

    nhd = torch.zeros(2, 6, 4, 2, 8, dtype=torch.float16)
    r = reg({"a": nhd, "b": torch.zeros_like(nhd)})
    assert (r.layout.kv_parts, r.layout.head_layout) == (2, "NHD")
    assert [x.block_len for x in r.regions] == [4 * 2 * 8 * 2] * 4
    assert r.regions[1].offset == 6 * 4 * 2 * 8 * 2  # V after all K blocks
    # vLLM's hybrid KV cache: layers of different groups share one tensor: one region set
    shared = reg({"full.0": nhd, "sliding.0": nhd.view(2, 6, 4, 2, 8)})
    assert shared.layout.num_layers == 1
    assert len(shared.regions) == 2
    hnd = torch.zeros(2, 6, 2, 4, 8, dtype=torch.float16).permute(0, 1, 3, 2, 4)  # vLLM's HND view
    assert reg({"a": hnd}).layout.head_layout == "HND"
    fused = torch.zeros(6, 2, 4, 16, dtype=torch.int8)  # [B, H, N, 2 * hd]: K|V in the content
    r = reg({"a": fused})
    assert (r.layout.kv_parts, r.layout.fused, r.layout.head_layout) == (1, "kv_content", "HND")
    assert r.regions[0].block_len == r.layout.region_block_len == 2 * 4 * 16
    with pytest.raises(RequestError, match="not one contiguous run"):
        reg({"a": torch.zeros(2, 6, 4, 2, 16)[..., :8]})


def test_lease_extended_while_a_reader_is_reading() -> None:
    t = LeaseTable()
    t.add(lease("a", 1.0))
    assert t.extend(("e", "a"), 5.0)
    assert t.extend(("e", "a"), 2.0)  # never shortened
    assert t.expire(1.5) == []
    assert t.next_expiry() == 5.0
    assert [x.req_id for x in t.expire(5.0)] == ["a"]
    assert not t.extend(("e", "a"), 9.0)


def test_gauges_are_coalesced_to_one_call_per_loop_turn() -> None:
    import asyncio

    from kvxfer.sidecar.app import Coalesced

    calls: list[int] = []
    c = Coalesced(lambda: calls.append(1))
    c()  # no running loop: at once
    assert calls == [1]

    async def turns() -> None:
        for _ in range(64):
            c()
        assert calls == [1]  # not yet: at the end of this turn
        await asyncio.sleep(0)
        assert calls == [1, 1]  # once for all 64
        c()
        await asyncio.sleep(0)
        assert calls == [1, 1, 1]

    asyncio.run(turns())

    loop = asyncio.new_event_loop()
    loop.call_soon(c)
    loop.call_soon(loop.stop)  # the loop stops, and closes, before the call it scheduled runs
    loop.run_forever()
    loop.close()
    n = len(calls)

    async def next_loop() -> None:
        c()
        await asyncio.sleep(0)

    asyncio.run(next_loop())
    assert len(calls) > n, "a call left scheduled on a closed loop blocked every later one"


def test_bench_vllm_buckets_ttft_by_prompt_length() -> None:
    """#36's table by prompt length (``make bench-vllm``): every request in the bucket its
    prompt falls in, failed ones and those shorter than the first bucket left out."""
    from kvxfer.testing.bench_vllm import Result, Run, by_length

    run = Run("kvxfer-push", 1.0)
    cases = [(0.05, 150, ""), (0.07, 999, ""), (0.2, 2500, ""), (0.1, 1000, ""), (0.3, 5000, "boom"),
             (0.01, 50, "")]
    run.results = {i: Result(ttft_s=t, prompt_len=n, error=e) for i, (t, n, e) in enumerate(cases)}
    got = by_length([run], [100, 1000, 2000])["kvxfer-push"]
    assert {k: v["n"] for k, v in got.items()} == {"100-999": 2, "1000-1999": 1, "2000+": 1}
    assert got["100-999"]["ttft_p50_ms"] == 50.0  # (pct: the lower of two)
    assert got["2000+"]["ttft_p99_ms"] == 200.0


def test_serve_check_refuses_what_the_start_would(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``kvxfer serve --check`` (``Config.preflight``) refuses what the start refuses of the
    secret and the files (found by a README audit: the README's own example passed --check
    and exited 2 when started)."""
    from kvxfer.errors import ConfigError

    with pytest.raises(ConfigError, match="beyond loopback"):
        Config(handshake_host="0.0.0.0").preflight()
    Config(handshake_host="0.0.0.0", insecure=True).preflight()
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    Config(handshake_host="0.0.0.0", secret_file=str(secret)).preflight()
    with pytest.raises(ConfigError, match="secret_file"):
        Config(secret_file=str(tmp_path / "missing")).preflight()
    with pytest.raises(ConfigError, match="control_tls_cert"):
        Config(control_tls_cert=str(tmp_path / "missing.pem")).preflight()
    Config().preflight()  # (loopback, no secret: the host key, made at start)


def test_serve_check_refuses_a_shared_socket_directory_and_never_advises_chmod_on_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A new-user trial: ``--check`` passed an engine socket in /tmp that the start refused,
    and the refusal advised ``install -d -m 0700 /tmp`` (pasted by root: /tmp 0700 for all)."""
    from kvxfer.cli import main

    assert main(["serve", "--engine-socket", "ipc:///tmp/kvxfer-check.sock", "--check"]) == 2
    err = capsys.readouterr().err
    assert "writable by others" in err
    assert "install -d -m 0700 /tmp/kvxfer`" in err
    assert "install -d -m 0700 /tmp`" not in err


def test_a_secret_file_others_can_read_or_a_short_secret_is_warned_of(
        tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture) -> None:
    import pathlib

    secret = pathlib.Path(tmp_path) / "secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o644)
    with caplog.at_level("WARNING", logger="kvxfer.config"):
        assert Config(secret_file=str(secret)).load_secret() == b"s3cret"
    assert "readable by others" in caplog.text
    assert "6-byte secret" in caplog.text
    caplog.clear()
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    with caplog.at_level("WARNING", logger="kvxfer.config"):
        Config(secret_file=str(secret)).load_secret()
    assert caplog.text == ""


@pytest.mark.parametrize(("preset", "want"), [(None, "1"), ("3", "3")])
def test_serve_runs_torchs_copies_on_one_openmp_thread_unless_told(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], preset: str | None,
        want: str) -> None:
    """``kvxfer serve`` sets ``OMP_NUM_THREADS=1`` before anything loads torch or numpy:
    ``torch.set_num_threads(1)`` misses a thread that already ran a torch op, and an arena's
    warm-up on the NIXL thread did (staged reads with VRAM's copies on host memory took 17-24
    ms a block on 2 cores, 2.7-2.9 with one thread). The operator's own value wins; other
    commands leave it alone."""
    import contextlib

    from kvxfer.cli import main

    for cmd in (["status", "--help"], ["serve", "--check"]):
        if preset is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", preset)
        with contextlib.suppress(SystemExit):
            main(cmd)
        assert os.environ.get("OMP_NUM_THREADS") == (want if cmd[0] == "serve" else preset), cmd
    capsys.readouterr()


def test_the_control_verbs_do_not_load_the_test_harness() -> None:
    """``kvxfer status`` and the other verbs built every parser, the demo's too, whose defaults
    loaded the synthetic engines and numpy (~0.1 s of a 0.27 s start); the demo's options are
    built only for ``kvxfer demo``, which still has them all."""
    import subprocess
    import sys

    code = ("import sys\nfrom kvxfer import cli\ntry:\n    cli.main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\n"
            "print('LOADED', 'kvxfer.testing.demo' in sys.modules, 'numpy' in sys.modules)")
    for cmd, loaded in ((["status", "--help"], "False False"), (["demo", "--help"], "True True")):
        out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        assert f"LOADED {loaded}" in out, (cmd, out[-500:])
        if cmd[0] == "demo":
            assert "--blocks-per-request" in out


def test_an_agent_in_use_stays_authenticated_however_many_others_handshake() -> None:
    """The authenticated agents are bounded (4,096); the oldest *handshake* used to go first,
    so that many newer agents (restarted decodes, each a new name) pushed out a decode that
    was reading all along: its renewals and notices were then refused (found by a review)."""
    from kvxfer.sidecar.peer_book import Authenticated

    auth = Authenticated(b"secret")
    auth.add("long-lived")
    for i in range(Authenticated.LIMIT * 2):
        auth.add(f"restarted-{i}")
        if i % 1000 == 0:
            assert auth("long-lived")  # (it renews, notifies, stages: each a use)
    assert auth("long-lived")
    assert not auth("restarted-0")
    assert Authenticated(b"")("anyone")  # (no secret: nobody is authenticated, anyone may)


def test_one_undecodable_message_from_the_sidecar_costs_only_itself() -> None:
    """The client decoded a poll's messages in one go: one it could not decode (a newer
    sidecar's event, a corrupt frame) raised, and every event drained beside it was lost (a
    lost Released pinned its hold for good; found by a review)."""
    from kvxfer.client import decode_each
    from kvxfer.protocol import Done, Released, encode

    got, skipped = decode_each([encode(Released(req_id="a", reason="read")), b"\x93garbage",
                                encode(Done(req_id="b", nbytes=1, seconds=0.1))])
    assert skipped == 1
    assert [type(e).__name__ for e in got] == ["Released", "Done"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_serve_check_as_root_accepts_a_units_runtime_directory(
        tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]) -> None:
    """systemd's RuntimeDirectory=kvxfer/%i with User=vllm: 0700, owned by vllm. The unit's
    sidecar (as vllm) starts; ``sudo kvxfer serve --check`` with that socket warns, not refuses
    (a review: it exited 2 and advised root to make a directory the service could not use)."""
    from kvxfer.cli import main

    run = os.path.join(tmp_path, "prefill0")
    os.mkdir(run, 0o700)
    os.chown(run, 999, 999)
    assert main(["serve", "--engine-socket", f"ipc://{run}/engine.sock", "--check"]) == 0
    assert "owned by uid 999" in capsys.readouterr().err
